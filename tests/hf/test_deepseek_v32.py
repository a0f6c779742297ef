"""DeepSeek-V3.2 on attnkit (attnkit.hf.use), and dots3_note and hy_v4, which share its indexer:
the indexer reads attnkit's mask as the tensor it stands for, and the keys it selects for each
query (``indices``) restrict attnkit's attention, as they restrict eager's. Against eager with the
same weights: logits of a left-padded batch on its real tokens, every gradient, greedy generation
with the model's cache, bf16. Tiny random models, built offline."""

from __future__ import annotations

import os

import pytest
import torch

import attnkit.hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V3.2", allow_module_level=True)


SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "n_shared_experts": 1, "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
         "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8, "n_group": 1,
         "topk_group": 1, "num_experts_per_tok": 2, "index_topk": 4, "index_head_dim": 16,
         "index_n_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
FAMILIES = {  # config class, model class, the family's own sizes
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     {"first_k_dense_replace": 1}),
    "dots3_note": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM",
                   {"layer_types": ["indexed_attention", "sliding_attention"], "sliding_window": 4,
                    "head_dim": 16, "shared_experts_intermediate_size": 16}),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", {}),
}  # fmt: skip
NAMES = [name for name, (_, model, _) in FAMILIES.items() if hasattr(transformers, model)]


def model_of(name="deepseek_v32", dtype=torch.float32):
    torch.manual_seed(0)
    config, model, sizes = FAMILIES[name]
    config = getattr(transformers, config)(**SIZES, **sizes)
    return getattr(transformers, model)(config).to(dtype).eval()


def padded_batch():
    ids = torch.randint(0, 64, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return ids, mask


def eager_then_attnkit(model, fn):
    model.set_attn_implementation("eager")
    first = fn()
    attnkit.hf.use(model)
    return first, fn()


@pytest.mark.parametrize("name", NAMES)
def test_logits_on_the_real_tokens_match_eager_and_the_selection_is_used(name, monkeypatch):
    model = model_of(name)
    ids, mask = padded_batch()
    seen = []
    real = attnkit.hf.attention

    def counted(*args, **kwargs):
        seen.append((kwargs.get("indices"), kwargs.get("attn_mask")))
        return real(*args, **kwargs)

    monkeypatch.setattr(attnkit.hf, "attention", counted)
    want, got = eager_then_attnkit(model, lambda: model(ids, attention_mask=mask).logits)
    real_tokens = mask.bool()
    torch.testing.assert_close(got[real_tokens], want[real_tokens])
    selections = [indices for indices, _ in seen if indices is not None]
    # 4 keys chosen for each query: the indexer's choice reached attention as indices, no mask
    assert selections and all(x.shape == (2, 13, 4) for x in selections)
    assert all(m is None for indices, m in seen if indices is not None)


@pytest.mark.parametrize("name", NAMES)
def test_every_gradient_matches_eager(name):
    model = model_of(name).train()
    ids, mask = padded_batch()
    # no loss from a padded position's prediction: eager's rows with no key are not zeros
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)

    def step():
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = eager_then_attnkit(model, step)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_with_the_cache_matches_eager(name):
    model = model_of(name)
    ids, mask = padded_batch()

    def generate():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                              do_sample=False, pad_token_id=0)  # fmt: skip

    want, got = eager_then_attnkit(model, generate)
    assert torch.equal(got, want)


def test_bf16_is_as_close_to_float32_as_eager():
    ids, mask = padded_batch()
    real_tokens = mask.bool()
    exact = model_of()(ids, attention_mask=mask).logits.detach()[real_tokens]
    model = model_of(dtype=torch.bfloat16)
    want, got = eager_then_attnkit(
        model, lambda: model(ids, attention_mask=mask).logits.detach().float()[real_tokens]
    )
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max()


@pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
    reason="before transformers 5.24 this model's mixture of experts does not compile, with "
    "transformers' own attention neither (a data-dependent guard in its grouped matmul)",
)
def test_compiled_whole_it_matches_transformers_own_attention():
    """torch.compile(fullgraph=True) works with attnkit standing in, as with sdpa: the indexer's
    read of the mask and the selection of keys trace into one graph."""
    model = model_of()
    ids = torch.randint(0, 64, (1, 13))
    want = model(ids).logits  # transformers' own attention (sdpa)
    attnkit.hf.use(model)
    try:
        got = torch.compile(model, fullgraph=True)(ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)


def test_the_selection_travels_as_indices_or_as_a_mask_where_a_dense_backend_runs():
    from attnkit.hf import _with_selection

    indices = torch.tensor([[[0, 5], [1, 9]]])  # keys 5 and 9: a static cache's empty slots
    sparse = _with_selection({"causal": True}, indices, 4, dropout=0.0)
    assert sparse["indices"].tolist() == [[[0, -1], [1, -1]]] and "attn_mask" not in sparse
    for masks, dropout in (
        ({"attn_mask": torch.ones(1, 1, 2, 4, dtype=torch.bool)}, 0.0),
        ({}, 0.1),
    ):
        dense = _with_selection(masks, indices, 4, dropout)
        assert "indices" not in dense
        assert dense["attn_mask"][0, 0].tolist() == [[True, False, False, False],
                                                     [False, True, False, False]]  # fmt: skip
