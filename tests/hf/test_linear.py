"""attnkit.hf.linear: the Gated DeltaNet layers of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE on
attnkit, against transformers' own reference path with the same weights: logits on a left-padded
batch, every gradient, greedy generation with the model's cache, bf16; the undo. The models are
tiny, random and built offline."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from attnkit.hf.linear import FUNCTIONS, use_gated_delta_rule

LINEAR = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}  # fmt: skip
LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def model_of(name: str, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "layer_types": LAYERS, **LINEAR}  # fmt: skip
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 16}  # fmt: skip
    if name == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**sizes, **moe))
    elif name == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(**sizes, **moe)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        config = transformers.Qwen3_5TextConfig(**sizes)
        model = transformers.Qwen3_5ForCausalLM(config)
    for name_, p in model.named_parameters():  # the decays away from the initial ones
        if name_.endswith("A_log"):
            torch.nn.init.normal_(p, std=0.5)
    return model.to(dtype).eval()


def padded_batch():
    ids = torch.randint(0, 64, (2, 21))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    return ids, mask


def twice(fn):
    """``fn()`` on transformers' reference path, then on attnkit."""
    first = fn()
    undo = use_gated_delta_rule()
    try:
        return first, fn()
    finally:
        undo()


@pytest.fixture
def attnkit_calls(monkeypatch) -> list[int]:
    """The number of tokens of each call that reached attnkit's gated_delta_rule."""
    import attnkit.hf.linear

    calls = []
    real = attnkit.hf.linear.gated_delta_rule

    def counted(q, *args, **kwargs):
        calls.append(q.shape[1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attnkit.hf.linear, "gated_delta_rule", counted)
    return calls


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_logits_and_every_gradient_match_transformers_reference(name, attnkit_calls):
    model = model_of(name).train()
    ids, mask = padded_batch()

    def step():
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), grads

    (want, want_grads), (got, got_grads) = twice(step)
    assert attnkit_calls == [21] * 3  # the three linear layers; transformers ran the first pass
    torch.testing.assert_close(got, want)
    assert got_grads.keys() == want_grads.keys() and any("A_log" in n for n in got_grads)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_greedy_generation_with_the_models_cache_matches(name, attnkit_calls):
    model = model_of(name)
    ids, mask = padded_batch()

    def generate():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                              do_sample=False, pad_token_id=0)  # fmt: skip

    want, got = twice(generate)
    assert attnkit_calls == [21] * 3 + [1] * 3 * 7  # the prompt, then seven decoding steps
    assert torch.equal(got, want)


def test_bf16_logits_are_as_close_to_float32_as_transformers(attnkit_calls):
    ids, mask = padded_batch()
    exact = model_of("qwen3_next")(ids, attention_mask=mask).logits.detach()
    model = model_of("qwen3_next", torch.bfloat16)
    want, got = twice(lambda: model(ids, attention_mask=mask).logits.detach().float())
    assert attnkit_calls == [21] * 3
    their_error = (want - exact).abs().max()
    assert (got - exact).abs().max() <= 2 * their_error


def test_the_functions_are_replaced_and_put_back():
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    originals = [getattr(modeling, name) for name in FUNCTIONS]
    undo = use_gated_delta_rule()
    assert all(getattr(modeling, n).__module__ == "attnkit.hf.linear" for n in FUNCTIONS)
    undo()
    assert [getattr(modeling, name) for name in FUNCTIONS] == originals
    with pytest.raises(ValueError, match="transformers has no model 'qwen9'"):
        use_gated_delta_rule(("qwen9",))
    assert [getattr(modeling, name) for name in FUNCTIONS] == originals


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_a_packed_row_equals_its_sequences_run_alone_forward_and_backward(name):
    """transformers refuses packed sequences in these layers without flash-linear-attention; on
    attnkit each sequence starts from its own state, and the convolution from zeros."""
    model = model_of(name)
    ids = torch.randint(0, 64, (1, 15))
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in (5, 1, 9)])[None]
    packing = {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
               "max_length_q": 9, "max_length_k": 9, "use_cache": False}  # fmt: skip
    undo = use_gated_delta_rule()
    try:
        packed = model(ids, **packing).logits
        packed.square().sum().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        bounds = cu.tolist()
        parts = [model(ids[:, a:b], use_cache=False).logits for a, b in itertools.pairwise(bounds)]
        alone = torch.cat(parts, dim=1)
        alone.square().sum().backward()
    finally:
        undo()
    torch.testing.assert_close(packed, alone)
    for n, grad in want.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[n].grad, msg=n)


def test_packed_inputs_that_do_not_cover_the_convolutions_inputs_are_refused():
    from attnkit.hf.linear import transformers_causal_conv1d

    x, weight = torch.randn(1, 6, 10), torch.randn(6, 4)
    torch.testing.assert_close(  # without packing: transformers' causal convolution
        transformers_causal_conv1d(x, weight),
        torch.nn.functional.conv1d(x, weight[:, None], padding=3, groups=6)[..., :10],
    )
    with pytest.raises(ValueError, match="run packed sequences with use_cache=False"):
        transformers_causal_conv1d(x, weight, cu_seq_lens_q=torch.tensor([0, 4, 8]))


def test_a_model_on_attnkit_compiles_whole_and_matches_transformers_eager():
    """torch.compile(fullgraph=True) works with attnkit standing in, as it does with transformers'
    own functions (one linear and one softmax layer: the compile is what costs)."""
    torch.manual_seed(0)
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "layer_types": ["linear_attention", "full_attention"], **LINEAR}  # fmt: skip
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**sizes)).eval()
    ids = torch.randint(0, 64, (2, 21))
    want = model(input_ids=ids).logits
    undo = use_gated_delta_rule()
    try:
        got = torch.compile(model, fullgraph=True)(input_ids=ids).logits
    finally:
        undo()
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)
