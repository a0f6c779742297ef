"""The projections' fused matrix-vector product of a cached decoding step (``gemv.h``), against
float64 and ``nn.Linear``, and where the modules use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import CrossAttention, KVCache, MultiHeadAttention
from attnkit.kernels import gemv
from attnkit.kernels.loader import Kernel

pytestmark = pytest.mark.skipif(
    not gemv.KERNEL.usable()[0], reason=f"decode kernel unavailable: {gemv.KERNEL.usable()[1]}"
)


# (rows, in, out) with one token, widths that are not multiples of the product's 16 lanes, and rows
# that are not multiples of its groups of four.
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
        assert gemv.runs_linear(x, [weight], [b])
        [out] = gemv.linear(x, [weight], [b])
    assert out.shape == (1, rows, d_out) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d_in,d_out", LINEAR_SHAPES[:3])
def test_linear_half_within_twice_the_error_of_torch_in_the_same_dtype(dtype, rows, d_in, d_out):
    x, weight, b = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
    expected = torch.nn.functional.linear(x.double(), weight.double(), b.double())
    low = [t.to(dtype) for t in (x, weight, b)]
    with torch.no_grad():
        [out] = gemv.linear(low[0], low[1:2], low[2:])
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
        assert gemv.runs_linear(x, weights, biases)
        outs = gemv.linear(x, weights, biases)
        singles = [gemv.linear(x, [w], [b])[0] for w, b in zip(weights, biases, strict=True)]
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
            assert gemv.runs_linear(x, [weight], [bias])
            [out] = gemv.linear(x, [weight], [bias])
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))


def test_the_linear_kernel_refuses_misfitting_operands_with_a_message():
    weight = torch.randn(4, 8)
    with pytest.raises(
        RuntimeError, match=r"linear: x \(\.\.\., in\) and each weight a contiguous"
    ):
        gemv.linear(torch.randn(1, 7), [weight], [None])
    with pytest.raises(
        RuntimeError, match=r"linear: x \(\.\.\., in\) and each weight a contiguous"
    ):
        gemv.linear(torch.randn(1, 4), [weight.t()], [None])
    with pytest.raises(RuntimeError, match="linear: each bias must be None or"):
        gemv.linear(torch.randn(1, 8), [weight], [torch.randn(3)])
    with pytest.raises(RuntimeError, match=r"linear: one bias \(or None\) for each of one or more"):
        gemv.linear(torch.randn(1, 8), [weight], [])


def test_linear_is_refused_where_it_would_differ_from_torch():
    x, weight = torch.randn(1, 8), torch.randn(4, 8, requires_grad=True)
    bias = torch.randn(4)
    plain = torch.randn(4, 8)
    assert not gemv.runs_linear(x, [weight], [None])  # the weight needs a gradient
    assert not gemv.runs_linear(x, [plain, weight], [None, None])  # the second one does
    assert not gemv.runs_linear(x, [plain], [bias.requires_grad_()])  # the bias does
    with torch.no_grad():
        assert gemv.runs_linear(x, [weight, plain], [bias, None])
        assert not gemv.runs_linear(torch.randn(17, 8), [weight], [None])  # more than MAX_ROWS
        assert not gemv.runs_linear(torch.randn(1, 0), [torch.randn(4, 0)], [None])
        assert not gemv.runs_linear(x.double(), [weight.double()], [None])
        assert not gemv.runs_linear(x.bfloat16(), [weight], [None])
        assert not gemv.runs_linear(x, [weight, plain.bfloat16()], [None, None])
        assert not gemv.runs_linear(x, [weight], [bias.bfloat16()])
        assert not gemv.runs_linear(x, [torch.randn(8, 4).t()], [None])  # a non-contiguous weight
        assert not gemv.runs_linear(x, [weight], [torch.randn(4, 2)[:, 0]])  # and bias
        assert not gemv.runs_linear(x, [], [])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not gemv.runs_linear(x, [weight], [None])  # autocast would run it in bf16
        in_vmap = torch.vmap(lambda row: torch.tensor(gemv.runs_linear(row, [weight], [None])))
        assert in_vmap(x).sum() == 0
        batched = torch.vmap(lambda w: torch.tensor(gemv.runs_linear(x, [w], [None])))
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
        assert not gemv.runs_linear(x.as_subclass(Tagged), [weight], [None])
        assert not gemv.runs_linear(x, [weight.as_subclass(Tagged)], [None])
        with Watching():
            assert not gemv.runs_linear(x, [weight], [None])
        with WatchingDispatch():
            assert not gemv.runs_linear(x, [weight], [None])


def test_a_training_step_never_loads_the_kernel(monkeypatch):
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).train()

    def refuse():
        raise AssertionError("a step with gradients loaded the decode kernel")

    monkeypatch.setattr(gemv.KERNEL, "load", refuse)
    module(torch.randn(1, 1, 16)).sum().backward()
    assert module.W_query.weight.grad is not None


def test_a_hook_on_one_projection_sends_all_three_through_their_modules(monkeypatch):
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    x = torch.randn(1, 1, 16)
    projected = []  # the weights that reach the kernel
    kernel_linear = gemv.linear
    monkeypatch.setattr(
        gemv, "linear", lambda x, ws, bs: projected.extend(ws) or kernel_linear(x, ws, bs)
    )
    cache = KVCache(1, 2, 8, module.head_dim)
    with torch.no_grad():
        expected = module(x, cache=cache)
        assert len(projected) == 4  # q, k and v in one call, then the output projection
        projected.clear()
        seen = []
        module.W_value.register_forward_hook(lambda layer, inp, out: seen.append(out))
        cache.reset()
        torch.testing.assert_close(module(x, cache=cache), expected)
    assert len(seen) == 1 and projected == [module.out_proj.weight]


def test_cross_attention_projects_keys_and_values_in_one_call_as_nn_linear_would(monkeypatch):
    module = CrossAttention(16, 12, 16, 2).eval()
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 12)  # 10 memory rows: the kernel's
    fused = []
    kernel_linear = gemv.linear
    monkeypatch.setattr(
        gemv, "linear", lambda x, ws, bs: fused.append(len(ws)) or kernel_linear(x, ws, bs)
    )
    with torch.no_grad():
        fast = module(x, memory, cache=KVCache(2, 2, 5, module.head_dim))
    assert fused == [1, 2, 1]  # the queries, the keys and values in one call, the output
    torch.testing.assert_close(fast, module(x, memory))  # gradients enabled: nn.Linear


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_projections_follow_autocast_tracing_and_a_replaced_forward():
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    x, other = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = KVCache(1, 2, 8, module.head_dim, dtype=torch.bfloat16)
        assert module(x, cache=cache).dtype == torch.bfloat16
    layer = module.W_query

    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, inp):
            return gemv.project([self.layer], inp)[0]

    with torch.no_grad():
        traced = torch.jit.trace(Projection(), x)
        torch.testing.assert_close(traced(other), layer(other))  # no constant baked in
        calls = []
        layer.forward = lambda inp: calls.append(1) or nn.Linear.forward(layer, inp)
        module(x, cache=KVCache(1, 2, 8, module.head_dim))
    assert calls == [1]


def test_a_bias_set_as_a_plain_tensor_is_used():
    """A bias deleted and set again as a plain attribute lives outside the layer's parameters, and
    must still count."""
    layer = nn.Linear(8, 4)
    x = torch.randn(1, 1, 8)
    with torch.no_grad():
        bias = layer.bias + 1
        del layer.bias
        layer.bias = bias
        torch.testing.assert_close(gemv.project([layer], x)[0], F.linear(x, layer.weight, bias))


def test_a_forward_patched_on_the_linear_class_is_called(monkeypatch):
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    x = torch.randn(1, 1, 16)
    calls = []
    linear_forward = nn.Linear.forward
    monkeypatch.setattr(
        nn.Linear, "forward", lambda self, inp: calls.append(1) or linear_forward(self, inp)
    )
    with torch.no_grad():
        module(x, cache=KVCache(1, 2, 8, module.head_dim))
    assert len(calls) == 4  # the query, key, value and output projections


def test_a_step_without_a_cache_calls_every_projection_as_a_module(monkeypatch):
    """Outside a cached step (any forward, even of one row without gradients) each projection is
    its layer's call: hooks run and the fused kernel is not asked."""
    module = MultiHeadAttention(16, 16, 8, 0.0, 2).eval()
    monkeypatch.setattr(gemv, "linear", lambda *args: pytest.fail("the fused product ran"))
    seen = []
    for name in ("W_query", "W_key", "W_value", "out_proj"):
        module.get_submodule(name).register_forward_hook(lambda *_, n=name: seen.append(n))
    with torch.no_grad():
        module(torch.randn(1, 1, 16))
    assert seen == ["W_query", "W_key", "W_value", "out_proj"]


def test_without_the_kernel_the_projections_stay_with_nn_linear(monkeypatch):
    monkeypatch.setattr(gemv, "KERNEL", Kernel("decode"))
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    with torch.no_grad():
        assert not gemv.runs_linear(torch.randn(1, 8), [torch.randn(4, 8)], [None])
