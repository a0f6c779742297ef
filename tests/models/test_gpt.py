"""The book's GPT on attnkit's modules: shapes, causality, the attention-only variant, its weights
(those of attnkit's MultiHeadAttention), its bad sizes, that it can learn, and the hybrid of
Gated DeltaNet and softmax blocks: it learns too, and generates through its caches what it would
generate reading the whole sequence again at every token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.models.gpt import GPTModel


def test_logits_and_weights_have_the_documented_shapes():
    model = GPTModel(vocab_size=11, context_length=9, emb_dim=12, num_heads=3, num_layers=2)
    idx = torch.randint(0, 11, (2, 7))  # t < context_length
    logits, attn_weights = model(idx, need_weights=True)
    assert logits.shape == (2, 7, 11)
    assert attn_weights.shape == (2, 2, 3, 7, 7)
    torch.testing.assert_close(attn_weights.sum(-1), torch.ones(2, 2, 3, 7))
    assert (attn_weights.triu(1) == 0).all()  # causal: no weight on a later token
    torch.testing.assert_close(model(idx), logits)  # the same logits without the weights


def test_a_token_does_not_change_the_logits_before_it():
    model = GPTModel(13, 8, 16, 2, 2).eval()
    idx = torch.randint(0, 13, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 13
    torch.testing.assert_close(model(idx)[:, :5], model(changed)[:, :5])
    assert not torch.allclose(model(idx)[:, 5:], model(changed)[:, 5:])


def test_each_blocks_weights_are_its_attention_modules():
    """The weights returned are what the block's MultiHeadAttention returns on its input."""
    model = GPTModel(10, 6, 8, 2, 1).eval()
    idx = torch.randint(0, 10, (3, 6))
    _, attn_weights = model(idx, need_weights=True)
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(6))
    block = model.trf_blocks[0]
    _, expected = block.att(block.norm1(x), need_weights=True, average_weights=False)
    torch.testing.assert_close(attn_weights[0], expected)


def test_the_attention_only_variant_has_no_feed_forward():
    full = GPTModel(10, 6, 8, 2, 2)
    attention_only = GPTModel(10, 6, 8, 2, 2, feed_forward=False)
    assert all(block.ff is not None for block in full.trf_blocks)
    assert all(block.ff is None and block.norm2 is None for block in attention_only.trf_blocks)
    n_ff = sum(p.numel() for b in full.trf_blocks for p in b.ff.parameters())
    n_norm2 = sum(p.numel() for b in full.trf_blocks for p in b.norm2.parameters())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(full) - count(attention_only) == n_ff + n_norm2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"emb_dim": 10, "num_heads": 3}, r"emb_dim \(10\) must be divisible by num_heads \(3\)"),
        ({"num_layers": 0}, r"num_layers must be >= 1, got 0"),
        ({"vocab_size": 0}, r"vocab_size must be >= 1, got 0"),
        ({"layers": "LLM"}, r"layers must be a pattern of A and L \(e.g. 'LLLA'\), got 'LLM'"),
    ],
)
def test_bad_sizes_are_named(kwargs, message):
    sizes = {"vocab_size": 5, "context_length": 4, "emb_dim": 8, "num_heads": 2, "num_layers": 1}
    with pytest.raises(ValueError, match=message):
        GPTModel(**{**sizes, **kwargs})


def test_a_sequence_longer_than_the_context_is_refused():
    model = GPTModel(5, 4, 8, 2, 1)
    with pytest.raises(ValueError, match=r"5 tokens, longer than context_length \(4\)"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("layers", ["A", "LA"], ids=["softmax blocks", "a hybrid"])
def test_it_learns_to_predict_a_fixed_sequence(layers):
    torch.manual_seed(0)
    model = GPTModel(7, 8, 16, 2, 1 if layers == "A" else 2, layers=layers)
    idx = torch.arange(8).remainder(7)[None]  # 0 1 2 ... 6 0: each next token is fixed
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = F.cross_entropy(model(idx[:, :-1]).transpose(1, 2), idx[:, 1:])
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1 * first


@pytest.mark.parametrize("layers", ["A", "LLLA"], ids=["softmax blocks", "the 3:1 hybrid"])
def test_generation_through_the_caches_is_greedy_decoding_of_the_whole_sequence(layers):
    torch.manual_seed(0)
    model = GPTModel(50, 24, 32, 4, 4, layers=layers).eval()
    assert model.layers == layers * (4 // len(layers))
    kinds = [type(block.att).__name__ for block in model.trf_blocks]
    assert kinds.count("GatedDeltaNet") == layers.count("L") * (4 // len(layers))
    prompt = torch.randint(0, 50, (2, 5))
    out = model.generate(prompt, 12)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):  # every token read again each step, no cache
            seq = torch.cat([seq, model(seq)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    with pytest.raises(ValueError, match=r"prompt \+ max_new_tokens has 25 tokens"):
        model.generate(prompt, 20)


def test_the_hybrids_weights_are_those_of_its_softmax_blocks():
    model = GPTModel(20, 8, 16, 2, 4, layers="LLLA")
    _, weights = model(torch.randint(0, 20, (3, 8)), need_weights=True)
    assert weights.shape == (1, 3, 2, 8, 8)  # one softmax block of four
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(1, 3, 2, 8))


def test_weights_are_refused_with_caches_and_in_a_model_without_softmax_blocks():
    model = GPTModel(20, 8, 16, 2, 2, layers="LA")
    idx = torch.randint(0, 20, (1, 4))
    with pytest.raises(ValueError, match="need_weights cannot be used with caches"):
        model(idx, need_weights=True, caches=model.new_caches(1))
    with pytest.raises(ValueError, match="has no softmax-attention block"):
        GPTModel(20, 8, 16, 2, 2, layers="L")(idx, need_weights=True)
