"""MultiHeadAttention against a float64 reference and against torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import KVCache, MultiHeadAttention, alibi_slopes
from helpers.devices import CUDA
from helpers.oracle import projected_attention_reference
from helpers.zoo import H

# (b, t, d_in, d_out, num_heads, num_kv_heads)
CONFIGS = {
    "mha": (2, 7, 16, 16, 4, None),
    "gqa": (2, 9, 12, 24, 6, 2),
    "mqa": (1, 5, 8, 12, 3, 1),
    "t=1": (3, 1, 8, 8, 2, None),
    "head_dim 40": (1, 13, 20, 80, 2, None),
    "head_dim 59, odd t": (2, 11, 30, 118, 2, 1),
}


def float64_leaves(module):
    return {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}


def on_devices(values, cuda):
    """``(value, device)`` parameters: every value on the CPU, those in ``cuda`` on CUDA too."""
    return [
        *(pytest.param(v, torch.device("cpu"), id=f"{v}-cpu") for v in values),
        *(pytest.param(v, torch.device("cuda"), id=f"{v}-cuda", marks=CUDA.marks) for v in cuda),
    ]


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("masked", "device"), on_devices([False, True], [True]))
def test_matches_float64_reference_outputs_weights_gradients(config, causal, masked, device):
    b, t, d_in, d_out, h, h_kv = config
    module = MultiHeadAttention(
        d_in, d_out, 32, 0.3, h, num_kv_heads=h_kv, causal=causal, qkv_bias=True
    )
    module = module.eval().to(device)
    x = torch.randn(b, t, d_in, requires_grad=True, device=device)
    key_mask = torch.rand(b, t, device=device) > 0.3 if masked else None
    out, weights = module(x, key_mask=key_mask, need_weights=True, average_weights=False)

    params64 = float64_leaves(module)
    x64 = x.detach().double().requires_grad_()
    out64, weights64 = projected_attention_reference(
        params64, x64, x64, h, h_kv or h, causal=causal, key_mask=key_mask
    )
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(weights, weights64.float())
    assert out.shape == (b, t, d_out) and weights.shape == (b, h, t, t)

    dout = torch.randn_like(out)
    names = [n for n, _ in module.named_parameters()]
    grads = torch.autograd.grad(out, [x, *module.parameters()], dout)
    grads64 = torch.autograd.grad(out64, [x64, *(params64[n] for n in names)], dout.double())
    for g, g64 in zip(grads, grads64):
        torch.testing.assert_close(g, g64.float())


def test_average_weights_is_the_mean_over_heads(device):
    module = MultiHeadAttention(8, 8, None, 0.0, 2).eval().to(device)
    x = torch.randn(2, 5, 8, device=device)
    _, per_head = module(x, need_weights=True, average_weights=False)
    _, averaged = module(x, need_weights=True)
    torch.testing.assert_close(averaged, per_head.mean(1))


def test_bool_and_float_attn_masks_agree(device):
    module = MultiHeadAttention(8, 8, None, 0.0, 2, causal=False).eval().to(device)
    x = torch.randn(2, 5, 8, device=device)
    allowed = torch.rand(5, 5, device=device) > 0.3
    allowed.fill_diagonal_(True)
    as_float = torch.zeros(5, 5, device=device).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(module(x, attn_mask=allowed), module(x, attn_mask=as_float))


def test_causal_output_ignores_future_tokens(device):
    module = MultiHeadAttention(8, 8, 16, 0.0, 2, num_kv_heads=1).eval().to(device)
    x = torch.randn(1, 9, 8, device=device)
    changed = x.clone()
    changed[:, 6:] = torch.randn(1, 3, 8, device=device)
    torch.testing.assert_close(module(x)[:, :6], module(changed)[:, :6], rtol=0, atol=0)


def test_fully_masked_row_gives_bias_only_and_finite_gradients(device):
    module = MultiHeadAttention(8, 8, None, 0.0, 2, causal=False).eval().to(device)
    x = torch.randn(2, 4, 8, requires_grad=True, device=device)
    key_mask = torch.tensor([[True, True, False, True], [False] * 4], device=device)
    out = module(x, key_mask=key_mask)
    # batch row 1 attends to nothing: its context is zero, so only the output bias remains
    torch.testing.assert_close(out[1], module.out_proj.bias.expand(4, 8))
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())
    assert torch.isfinite(x.grad).all()


def test_dropout_in_training_only(device):
    module = MultiHeadAttention(8, 8, None, 0.5, 2).to(device)
    x = torch.randn(2, 6, 8, device=device)
    assert not torch.equal(module(x), module(x))
    module.eval()
    assert torch.equal(module(x), module(x))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: MultiHeadAttention(10, 10, None, 0.0, 3), ValueError, r"d_out \(10\) must be divisible by num_heads \(3\)"),
        (lambda: MultiHeadAttention(12, 12, None, 0.0, 6, num_kv_heads=4), ValueError, r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"),
        (lambda: MultiHeadAttention(8, 8, None, 1.5, 2), ValueError, r"dropout must be in \[0, 1\), got 1.5"),
        (lambda: MultiHeadAttention(8, 8, 4, 0.0, 2)(torch.randn(1, 5, 8)), ValueError, r"x has 5 tokens, longer than context_length \(4\)"),
        (lambda: MultiHeadAttention(8, 8, 4, 0.0, 2)(torch.randn(8)), ValueError, r"x must be \(batch, tokens, features\) or \(tokens, features\), got shape \(8,\)"),
        (lambda: MultiHeadAttention(8, 8, 4, 0.0, 2)(torch.randn(1, 3, 6)), ValueError, "x has 6 features in its last dim, but d_in is 8"),
        (lambda: MultiHeadAttention(8, 8, 4, 0.0, 2)(torch.randn(2, 3, 8), key_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"key_mask must have shape \(batch, key_length\) = \(2, 3\), got \(2, 4\)"),
        (lambda: MultiHeadAttention(8, 8, 4, 0.0, 2)(torch.randn(2, 3, 8), attn_mask=torch.ones(3, 3, dtype=torch.long)), TypeError, "attn_mask must be bool"),
        (lambda: MultiHeadAttention(8, 8, 4, 0.0, 2)(torch.randn(2, 3, 8, dtype=torch.float64)), TypeError, r"x has dtype torch.float64 but the module's parameters are torch.float32"),
    ],
)  # fmt: skip
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "options",
    [{"window": 4}, {"window": 5}, {"alibi": True}, {"softcap": 2.0}, {"window": 3, "alibi": True, "softcap": 4.0}],
    ids=["window 4", "window 5", "alibi", "softcap", "all"],
)  # fmt: skip
def test_window_alibi_softcap_match_float64_reference(causal, options, device):
    h, h_kv = 6, 2
    module = MultiHeadAttention(12, 24, None, 0.0, h, num_kv_heads=h_kv, causal=causal, **options)
    module = module.to(device)
    x = torch.randn(2, 11, 12, requires_grad=True, device=device)
    out = module(x)
    W = options.get("window")
    expected_window = None if W is None else ((W - 1, 0) if causal else (W // 2, (W - 1) // 2))
    assert module.window == expected_window
    reference_options = {
        "causal": causal,
        "window": expected_window,
        "softcap": options.get("softcap"),
    }
    if options.get("alibi"):
        reference_options["alibi_slopes"] = alibi_slopes(h).double().to(device)
    params64 = float64_leaves(module)
    x64 = x.detach().double().requires_grad_()
    out64, _ = projected_attention_reference(params64, x64, x64, h, h_kv, **reference_options)
    torch.testing.assert_close(out, out64.float())
    dout = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, dout)
    (gx64,) = torch.autograd.grad(out64, x64, dout.double())
    torch.testing.assert_close(gx, gx64.float())


def test_causal_window_sees_exactly_the_last_w_positions(device):
    module = MultiHeadAttention(8, 8, None, 0.0, 2, window=3).eval().to(device)
    _, weights = module(torch.randn(1, 6, 8, device=device), need_weights=True)
    visible = weights[0] > 0
    for i in range(6):
        assert visible[i].nonzero().flatten().tolist() == list(range(max(0, i - 2), i + 1))


EVERY_OPTION = {"softcap": 5.0, "window": 3, "alibi": True}


@pytest.mark.parametrize(
    ("options", "device"),
    [
        pytest.param({}, torch.device("cpu"), id="plain-cpu"),
        pytest.param(EVERY_OPTION, torch.device("cpu"), id="every option-cpu"),
        # one compilation on CUDA (minutes of the GPU's short run each): the tiled loop's
        pytest.param(EVERY_OPTION, torch.device("cuda"), id="every option-cuda", marks=CUDA.marks),
    ],
)
def test_compiles_with_fullgraph(options, device):
    module = MultiHeadAttention(16, 16, None, 0.0, 4, num_kv_heads=2, **options).eval().to(device)
    x = torch.randn(2, 7, 16, device=device)
    key_mask = torch.rand(2, 7, device=device) > 0.3
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(x, key_mask=key_mask), module(x, key_mask=key_mask))


@pytest.mark.parametrize(
    "dtype, t", [(torch.float32, 300), (torch.bfloat16, 17)], ids=["fp32 long", "bf16"]
)
def test_training_compiles_with_fullgraph_where_auto_weighs_the_cpu(
    dtype, t, monkeypatch, tiled_blocks
):
    """Lengths and dtypes at which auto asks what the CPU has (the tiled kernel's speed rules):
    read once, outside dynamo's tracing, so the whole step is one graph. In the production
    blocks (256 x 512): dynamo unrolls the block loop, and the tests' blocks of 5 x 7 made 300
    tokens take two minutes to trace and compile."""
    tiled_blocks(256, 512)
    module = MultiHeadAttention(16, 16, None, 0.0, 2, window=8, alibi=True).to(dtype)
    x = torch.randn(1, t, 16, dtype=dtype, requires_grad=True)
    out = torch.compile(module, fullgraph=True)(x)
    out.float().sum().backward()
    torch.testing.assert_close(
        out,
        module(x),
        atol=2e-2 if dtype == torch.bfloat16 else None,
        rtol=None if dtype == torch.float32 else 2e-2,
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_traces_with_jit_trace(num_kv_heads, device):
    # Traced sizes are tensors: every size that reaches torch as an argument must become a Python
    # value first (SDPA's enable_gqa refused a tensor).
    module = MultiHeadAttention(16, 16, None, 0.0, 4, num_kv_heads=num_kv_heads).eval().to(device)
    with torch.no_grad():
        traced = torch.jit.trace(module, torch.randn(1, 5, 16, device=device))
        x = torch.randn(1, 5, 16, device=device)
        torch.testing.assert_close(traced(x), module(x))


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_a_module_traced_on_one_token_runs_on_five():
    # No branch on the token count outside the masks: the head reshapes stay general.
    module = MultiHeadAttention(16, 16, None, 0.0, 4, causal=False).eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, torch.randn(1, 1, 16))
        x = torch.randn(1, 5, 16)
        torch.testing.assert_close(traced(x), module(x))


def test_options_are_checked():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        MultiHeadAttention(8, 8, None, 0.0, 2, window=0)
    with pytest.raises(ValueError, match="softcap must be > 0, got -1"):
        MultiHeadAttention(8, 8, None, 0.0, 2, softcap=-1)
    with pytest.raises(ValueError, match=r"softcap has no counterpart in nn\.MultiheadAttention"):
        MultiHeadAttention(8, 8, None, 0.0, 2, causal=False, softcap=3.0).to_torch()


def test_module_dtype_and_switches_are_checked():
    with pytest.raises(
        TypeError, match=r"dtype must be a floating-point torch.dtype or None, got torch.int32"
    ):
        MultiHeadAttention(8, 8, None, 0.0, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="causal must be a bool, got str 'yes'"):
        MultiHeadAttention(8, 8, None, 0.0, 2, causal="yes")
    module = MultiHeadAttention(8, 8, None, 0.0, 2)
    with pytest.raises(TypeError, match="need_weights must be a bool"):
        module(torch.randn(1, 3, 8), need_weights="no")


def test_a_cache_with_gradients_raises_before_backward_would():
    """Was torch's in-place-modification error at backward, after a forward that had silently
    detached the cached keys."""
    module = MultiHeadAttention(8, 8, 16, 0.0, 2)
    cache = KVCache(1, 2, 16, 4)
    with pytest.raises(ValueError, match=r"decode under torch\.no_grad\(\)"):
        module(torch.randn(1, 3, 8), cache=cache)
    with torch.no_grad():
        assert module(torch.randn(1, 3, 8), cache=cache).shape == (1, 3, 8)


def test_an_empty_sequence_gives_an_empty_result_as_torchs_module_does(device):
    module = MultiHeadAttention(16, 16, None, 0.0, 4, causal=False).to(device)
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True).to(device)
    x = torch.randn(2, 0, 16, device=device)
    assert module(x).shape == theirs(x, x, x)[0].shape == (2, 0, 16)
    out, weights = module(x, need_weights=True)
    assert out.shape == (2, 0, 16) and weights.shape == (2, 0, 0)


def test_a_packed_batch_trains_through_the_module_as_its_documents_alone(device):
    mha = attnkit.MultiHeadAttention(32, 32, 64, 0.0, H).to(device)
    lengths = [7, 12, 5]
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).to(device)
    x = torch.randn(1, 24, 32, requires_grad=True, device=device)
    packed = mha(x, documents=documents)
    alone = torch.cat([mha(part) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone)
    (grad,) = torch.autograd.grad(packed.square().sum(), x)
    (want,) = torch.autograd.grad(alone.square().sum(), x)
    torch.testing.assert_close(grad, want)
    with pytest.raises(ValueError, match="with a cache, give mask_mod"), torch.no_grad():
        mha(x[:, :3], cache=attnkit.KVCache(1, H, 64, 8, device=device), documents=documents[:3])


def test_learned_sinks_start_at_zero_train_and_decode_as_the_whole_sequence(device):
    module = MultiHeadAttention(16, 16, 32, 0.0, 4, num_kv_heads=2, sinks=True).to(device)
    assert torch.equal(module.sinks, torch.zeros(4, device=device))
    assert "sinks" in module.state_dict()
    assert MultiHeadAttention(16, 16, 32, 0.0, 4).sinks is None
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4) * 2)
    x = torch.randn(2, 9, 16, requires_grad=True, device=device)
    out = module(x)
    q, k, v = (
        w(x).unflatten(-1, (-1, 4)).transpose(1, 2)
        for w in (module.W_query, module.W_key, module.W_value)
    )
    context = attnkit.attention(q, k, v, causal=True, sinks=module.sinks, backend="reference")
    expected = module.out_proj(context.transpose(1, 2).flatten(2))
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.sum(), (x, module.sinks))
    want = torch.autograd.grad(expected.sum(), (x, module.sinks))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    cache = KVCache(2, 2, 32, 4, device=device)
    with torch.no_grad():
        steps = [module(x[:, :4], cache=cache)]
        steps += [module(x[:, i : i + 1], cache=cache) for i in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), out.detach())
    with pytest.raises(TypeError, match="sinks must be a bool"):
        MultiHeadAttention(16, 16, 32, 0.0, 4, sinks="yes")
