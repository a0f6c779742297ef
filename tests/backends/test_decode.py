"""The decode backend (a C++ kernel, one pass over a key/value cache) against the float64 oracle, and
when "auto" takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import CrossAttention, KVCache, MultiHeadAttention, attention
from attnkit.backends import BACKENDS, choose_backend, decode
from attnkit.backends._native import Kernel
from attnkit.backends.base import call_of
from attnkit.masks import Masks
from attnkit.modules._common import project
from helpers.oracle import naive_attention

pytestmark = pytest.mark.skipif(
    not decode.KERNEL.usable()[0], reason=f"decode kernel unavailable: {decode.KERNEL.usable()[1]}"
)

# (b, h, h_kv, t, s, d): head dims the kernel specialises (64, 128) and others (40, 59), lengths
# that do not divide its blocks of 64 keys, GQA/MQA groups, a few queries.
SHAPES = {
    "mha d=64": (2, 4, 4, 1, 200, 64),
    "gqa d=128": (1, 6, 2, 1, 129, 128),
    "mqa d=59, t=2": (2, 8, 1, 2, 77, 59),
    "t=3 d=40": (1, 2, 2, 3, 65, 40),
    "one key": (1, 2, 1, 1, 1, 8),
}


def inputs(shape, dtype=torch.float32, masked=False):
    b, h, h_kv, t, s, d = shape
    q, k, v = (torch.randn(b, n, m, d, dtype=dtype) for n, m in ((h, t), (h_kv, s), (h_kv, s)))
    key_mask = None
    if masked:
        key_mask = torch.rand(b, s) > 0.4
        key_mask[0, -1] = True
        if b > 1:
            key_mask[-1] = False  # a batch row of padding only: zeros out
    return q, k, v, key_mask


@pytest.fixture(params=[1024, 16], ids=["splits as in use", "many splits"])
def split_size(request, monkeypatch):
    monkeypatch.setattr(decode, "MIN_KEYS_PER_SPLIT", request.param)
    return request.param


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("masked", [False, True])
def test_float32_matches_the_float64_oracle(shape, masked, split_size):
    q, k, v, key_mask = inputs(shape, masked=masked)
    out = attention(q, k, v, key_mask=key_mask, backend="decode")
    expected, _, _ = naive_attention(q.double(), k.double(), v.double(), key_mask=key_mask)
    torch.testing.assert_close(out, expected.float())
    if masked and shape[0] > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_half_caches_within_twice_the_naive_error(dtype, masked, split_size):
    q, k, v, key_mask = inputs((2, 6, 2, 1, 300, 64), dtype, masked)
    out = attention(q, k, v, key_mask=key_mask, backend="decode")
    expected, _, _ = naive_attention(q.double(), k.double(), v.double(), key_mask=key_mask)
    naive, _, _ = naive_attention(q, k, v, key_mask=key_mask)
    assert out.dtype == dtype

    def err(x):
        return (x.double() - expected).abs().max().item()

    assert err(out) <= 2 * err(naive) + 1e-6


def test_scale_and_strided_views_of_a_cache():
    cache = KVCache(2, 2, 300, 16)
    keys, values = cache.update(torch.randn(2, 2, 150, 16), torch.randn(2, 2, 150, 16))
    wide_k = torch.randn(2, 150, 2, 16).transpose(1, 2)  # (b, s, h, d) -> (b, h, s, d), as modules
    q = torch.randn(2, 4, 1, 16)
    for k, v in ((keys, values), (wide_k, wide_k)):
        out = attention(q, k, v, scale=0.3, backend="decode")
        expected, _, _ = naive_attention(q.double(), k.double(), v.double(), scale=0.3)
        torch.testing.assert_close(out, expected.float())


def test_auto_takes_the_decode_kernel_for_a_few_queries_over_a_long_cache():
    def picked(t=1, s=None, h_kv=4, dtype=torch.float32, grad=False, **options):
        s = 1024 if s is None else s
        q = torch.empty(1, 12, t, 64, dtype=dtype, requires_grad=grad)
        k = v = torch.empty(1, h_kv, s, 64, dtype=dtype)
        masks = Masks(key_mask=options.pop("key_mask", None), window=options.pop("window", None))
        return choose_backend("auto", call_of(q, k, v, masks, 1.0, **options)).backend

    assert picked() == "decode"
    mask = torch.ones(1, 1024, dtype=torch.bool)
    assert picked(dtype=torch.bfloat16, key_mask=mask) == "decode"
    assert picked(dtype=torch.bfloat16, s=16) == "decode"
    assert picked(t=5, h_kv=4) == "decode"  # 3 query heads per kv head x 5 queries: 15 rows
    assert picked(t=6, h_kv=4) == "sdpa"  # 18 rows
    assert picked(s=1) == "decode"  # every length: SDPA would scan k again for the NaN rule
    assert picked(grad=True) == "sdpa"
    assert picked(dtype=torch.float64) == "sdpa"
    assert picked(t=2, window=(-1, 0)) == "tiled"  # two causal queries: SDPA would need a mask
    assert picked(alibi_slopes=torch.ones(12)) == "sdpa"
    assert picked(return_lse=True) == "tiled"


def test_a_module_decoding_with_a_cache_runs_the_kernel_and_equals_the_full_forward(
    monkeypatch,
):
    calls = []
    real = BACKENDS["decode"].run
    monkeypatch.setattr(BACKENDS["decode"], "run", lambda call: calls.append(1) or real(call))
    prompt = 40
    module = MultiHeadAttention(32, 32, prompt + 4, 0.0, 4, num_kv_heads=2, rope=True).eval()
    x = torch.randn(1, prompt + 4, 32)
    with torch.no_grad():
        full = module(x)
        cache = KVCache(1, 2, x.shape[1], module.head_dim)
        module(x[:, :prompt], cache=cache)
        steps = [module(x[:, i : i + 1], cache=cache) for i in range(prompt, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, prompt:])
    assert len(calls) == 4  # one per decoded token; the prefill went elsewhere


def test_named_decode_refuses_what_it_cannot_run():
    q = torch.randn(1, 2, 2, 8)
    k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="backend 'decode' does not support causal"):
        attention(q, k, v, causal=True, backend="decode")
    with pytest.raises(ValueError, match="backend 'decode' cannot run inputs that require grad"):
        attention(q.requires_grad_(), k, v, backend="decode")
    with pytest.raises(ValueError, match=r"cannot run dtype torch\.float64"):
        attention(q.double().detach(), k.double(), v.double(), backend="decode")
    with pytest.raises(ValueError, match="cannot run 32 query rows per key/value head"):
        attention(torch.randn(1, 2, 32, 8), k, v, backend="decode")


def test_without_the_kernel_auto_uses_sdpa_and_a_named_call_says_why(monkeypatch):
    monkeypatch.setattr(decode, "KERNEL", Kernel("decode"))
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    q = torch.randn(1, 2, 1, 8)
    k = v = torch.randn(1, 2, 64, 8)
    assert choose_backend("auto", call_of(q, k, v, Masks(), 1.0)).backend == "sdpa"
    with torch.no_grad():  # the projections stay with nn.Linear
        assert not decode.runs_linear(torch.randn(1, 8), [torch.randn(4, 8)], [None])
    with pytest.raises(
        ValueError,
        match=r"backend 'decode' cannot run without its kernel: disabled by ATTNKIT_NATIVE=0",
    ):
        attention(q, k, v, backend="decode")


# The matrix-vector product of a decoding step's projections: (rows, in, out) with one token, widths
# that are not multiples of its 16 lanes, and rows that are not multiples of its groups of four.
LINEAR_SHAPES = [(1, 768, 768), (1, 59, 37), (3, 40, 129), (16, 17, 5), (1, 1, 1)]


@pytest.mark.parametrize("rows,d_in,d_out", LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_float32_matches_float64(rows, d_in, d_out, bias):
    x, weight = torch.randn(2, rows, d_in), torch.randn(d_out, d_in)
    b = torch.randn(d_out) if bias else None
    x = x[:1]  # (1, rows, d_in): leading dims are kept
    expected = torch.nn.functional.linear(
        x.double(), weight.double(), None if b is None else b.double()
    )
    with torch.no_grad():
        assert decode.runs_linear(x, [weight], [b])
        [out] = decode.linear(x, [weight], [b])
    assert out.shape == (1, rows, d_out) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d_in,d_out", LINEAR_SHAPES[:3])
def test_linear_half_within_twice_the_error_of_torch_in_the_same_dtype(dtype, rows, d_in, d_out):
    x, weight, b = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
    expected = torch.nn.functional.linear(x.double(), weight.double(), b.double())
    low = [t.to(dtype) for t in (x, weight, b)]
    with torch.no_grad():
        [out] = decode.linear(low[0], low[1:2], low[2:])
    torch_error = (torch.nn.functional.linear(*low).double() - expected).abs().max()
    assert out.dtype == dtype
    assert (out.double() - expected).abs().max() <= 2 * torch_error + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_of_several_weights_equals_one_call_each(dtype):
    # 100 + 3 + 70 rows of weights: the threads' shares (64 rows or more) cross from one to the next
    x = torch.randn(2, 40, dtype=dtype)
    weights = [torch.randn(out, 40, dtype=dtype) for out in (100, 3, 70)]
    biases = [torch.randn(100, dtype=dtype), None, torch.randn(70, dtype=dtype)]
    with torch.no_grad():
        assert decode.runs_linear(x, weights, biases)
        outs = decode.linear(x, weights, biases)
        singles = [decode.linear(x, [w], [b])[0] for w, b in zip(weights, biases, strict=True)]
    assert [o.shape for o in outs] == [(2, 100), (2, 3), (2, 70)]
    for out, single, w, b in zip(outs, singles, weights, biases, strict=True):
        assert torch.equal(out, single)
        if dtype is torch.float32:  # bf16's accuracy: the test above
            expected = torch.nn.functional.linear(
                x.double(), w.double(), None if b is None else b.double()
            )
            torch.testing.assert_close(out, expected.float())


def test_linear_takes_a_non_contiguous_or_one_dimensional_input():
    weight, bias = torch.randn(5, 8), torch.randn(5)
    with torch.no_grad():
        for x in (torch.randn(8, 3).t(), torch.randn(8)):
            assert decode.runs_linear(x, [weight], [bias])
            [out] = decode.linear(x, [weight], [bias])
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))


def test_the_linear_kernel_refuses_misfitting_operands_with_a_message():
    weight = torch.randn(4, 8)
    with pytest.raises(
        RuntimeError, match=r"linear: x \(\.\.\., in\) and each weight a contiguous"
    ):
        decode.linear(torch.randn(1, 7), [weight], [None])
    with pytest.raises(
        RuntimeError, match=r"linear: x \(\.\.\., in\) and each weight a contiguous"
    ):
        decode.linear(torch.randn(1, 4), [weight.t()], [None])
    with pytest.raises(RuntimeError, match="linear: each bias must be None or"):
        decode.linear(torch.randn(1, 8), [weight], [torch.randn(3)])
    with pytest.raises(RuntimeError, match=r"linear: one bias \(or None\) for each of one or more"):
        decode.linear(torch.randn(1, 8), [weight], [])


def test_linear_is_refused_where_it_would_differ_from_torch():
    x, weight = torch.randn(1, 8), torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(4)
    plain = torch.randn(4, 8)
    assert not decode.runs_linear(x, [weight], [None])  # the weight needs a gradient
    assert not decode.runs_linear(x, [plain, weight], [None, None])  # the second one does
    assert not decode.runs_linear(x, [plain], [bias.requires_grad_()])  # the bias does
    with torch.no_grad():
        assert decode.runs_linear(x, [weight, plain], [bias, None])
        assert not decode.runs_linear(torch.randn(17, 8), [weight], [None])  # more than MAX_ROWS
        assert not decode.runs_linear(torch.randn(1, 0), [torch.randn(4, 0)], [None])
        assert not decode.runs_linear(x.double(), [weight.double()], [None])
        assert not decode.runs_linear(x.bfloat16(), [weight], [None])
        assert not decode.runs_linear(x, [weight, plain.bfloat16()], [None, None])
        assert not decode.runs_linear(x, [weight], [bias.bfloat16()])
        assert not decode.runs_linear(x, [torch.randn(8, 4).t()], [None])  # a non-contiguous weight
        assert not decode.runs_linear(x, [weight], [torch.randn(4, 2)[:, 0]])  # and bias
        assert not decode.runs_linear(x, [], [])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not decode.runs_linear(x, [weight], [None])  # autocast would run it in bf16
        in_vmap = torch.vmap(lambda row: torch.tensor(decode.runs_linear(row, [weight], [None])))
        assert in_vmap(x).sum() == 0
        batched = torch.vmap(lambda w: torch.tensor(decode.runs_linear(x, [w], [None])))
        assert batched(torch.randn(3, 4, 8)).sum() == 0  # weights batched (model ensembling)


class Tagged(torch.Tensor):
    """A tensor subclass: torch functions return Tagged, which the kernel would not."""


class Watching(torch.overrides.TorchFunctionMode):
    """A mode that sees every torch function, as a profiler or tracer would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class WatchingDispatch(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_linear_is_refused_under_torch_function_overrides_and_modes():
    x, weight = torch.randn(1, 8), torch.randn(4, 8)
    with torch.no_grad():
        assert not decode.runs_linear(x.as_subclass(Tagged), [weight], [None])
        assert not decode.runs_linear(x, [weight.as_subclass(Tagged)], [None])
        with Watching():
            assert not decode.runs_linear(x, [weight], [None])
        with WatchingDispatch():
            assert not decode.runs_linear(x, [weight], [None])


def test_a_training_step_never_loads_the_kernel(monkeypatch):
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).train()

    def refuse():
        raise AssertionError("a step with gradients loaded the decode kernel")

    monkeypatch.setattr(decode.KERNEL, "load", refuse)
    module(torch.randn(1, 1, 16)).sum().backward()
    assert module.W_query.weight.grad is not None


def test_a_hook_on_one_projection_sends_all_three_through_their_modules(monkeypatch):
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    x = torch.randn(1, 1, 16)
    projected = []  # the weights that reach the kernel
    kernel_linear = decode.linear
    monkeypatch.setattr(
        decode, "linear", lambda x, ws, bs: projected.extend(ws) or kernel_linear(x, ws, bs)
    )
    with torch.no_grad():
        expected = module(x)
        assert len(projected) == 4  # q, k and v in one call, then the output projection
        projected.clear()
        seen = []
        module.W_value.register_forward_hook(lambda layer, inp, out: seen.append(out))
        torch.testing.assert_close(module(x), expected)
    assert len(seen) == 1 and projected == [module.out_proj.weight]


def test_cross_attention_projects_keys_and_values_in_one_call_as_nn_linear_would():
    module = CrossAttention(16, 12, 16, 2).eval()
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 12)  # 10 memory rows: the kernel's
    with torch.no_grad():
        fast = module(x, memory)
    torch.testing.assert_close(fast, module(x, memory))  # gradients enabled: nn.Linear


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_projections_follow_autocast_tracing_and_a_replaced_forward():
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    x, other = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(x).dtype == torch.bfloat16
    layer = module.W_query

    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, inp):
            return project(self.layer, inp)

    with torch.no_grad():
        traced = torch.jit.trace(Projection(), x)
        torch.testing.assert_close(traced(other), layer(other))  # no constant baked in
        calls = []
        layer.forward = lambda inp: calls.append(1) or nn.Linear.forward(layer, inp)
        module(x)
    assert calls == [1]


def test_a_bias_set_as_a_plain_tensor_is_used():
    """project_all reads a plain nn.Linear's parameters from its _parameters dict: a bias deleted
    and set again as a plain attribute lives outside it, and must still count."""
    layer = nn.Linear(8, 4)
    x = torch.randn(1, 1, 8)
    with torch.no_grad():
        bias = layer.bias + 1
        del layer.bias
        layer.bias = bias
        torch.testing.assert_close(project(layer, x), F.linear(x, layer.weight, bias))


@pytest.mark.parametrize("backend", ["auto", "decode"])
def test_an_empty_batch_or_no_query_gives_an_empty_output(backend):
    k = v = torch.randn(0, 2, 2048, 64)
    with torch.no_grad():
        assert attention(torch.randn(0, 8, 1, 64), k, v, backend=backend).shape == (0, 8, 1, 64)
        k = v = torch.randn(1, 2, 2048, 64)
        assert attention(torch.randn(1, 8, 0, 64), k, v, backend=backend).shape == (1, 8, 0, 64)


def test_a_forward_patched_on_the_linear_class_is_called(monkeypatch):
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    x = torch.randn(1, 1, 16)
    calls = []
    linear_forward = nn.Linear.forward
    monkeypatch.setattr(
        nn.Linear, "forward", lambda self, inp: calls.append(1) or linear_forward(self, inp)
    )
    with torch.no_grad():
        module(x)
    assert len(calls) == 4  # the query, key, value and output projections
