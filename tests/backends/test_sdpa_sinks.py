"""Learned sinks on torch's flash kernels (backends/sdpa_sinks.py): the CPU's flash kernel here,
CUDA's in half precision where a GPU is present, against the float64 oracle."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnkit import attention
from attnkit.backends import sdpa_sinks
from attnkit.functional import which_backend
from helpers.devices import CUDA
from helpers.oracle import assert_within_the_naive_error, naive_attention

# (b, h, h_kv, t, s, d), and causal: the flash kernel masks causally with t == s, or one query
CASES = {
    "mha": ((2, 4, 4, 9, 9, 16), False),
    "mha causal": ((2, 4, 4, 9, 9, 16), True),
    "gqa causal d=40": ((1, 4, 2, 13, 13, 40), True),
    "mqa t!=s d=64": ((2, 3, 1, 11, 6, 64), False),
    "one query causal": ((1, 4, 2, 1, 17, 32), True),
    "mha causal d=128": ((1, 2, 2, 80, 80, 128), True),  # cuDNN's kernel on an H100
}


def leaves(shape, dtype, device, sink_scale=2.0):
    b, h, h_kv, t, s, d = shape
    q, k, v = (
        torch.randn(b, n, m, d, dtype=dtype, device=device)
        for n, m in ((h, t), (h_kv, s), (h_kv, s))
    )
    sinks = torch.randn(h, dtype=dtype, device=device) * sink_scale
    return [x.requires_grad_() for x in (q, k, v, sinks)]


def oracle(xs, causal):
    xs64 = [x.detach().double().requires_grad_() for x in xs]
    return xs64, naive_attention(*xs64[:3], sinks=xs64[3], causal=causal)[0]


def test_auto_runs_sinks_on_sdpa_where_the_flash_kernel_takes_them():
    q, k, v, sinks = leaves((1, 2, 2, 8, 8, 16), torch.float32, "cpu")
    assert which_backend(q, k, v, sinks=sinks, causal=True).backend == "sdpa"
    for options, words in [
        ({"key_mask": torch.ones(1, 8, dtype=torch.bool)}, "a mask other than causal"),
        ({"window": (2, 0)}, "a mask other than causal"),
        ({"return_lse": True}, "does not support return_lse"),
        ({"alibi_slopes": torch.ones(2)}, "sinks with alibi_slopes"),
        ({"dropout_p": 0.1}, "sinks with dropout_p"),
    ]:
        choice = which_backend(q, k, v, sinks=sinks, **options)
        assert choice.backend != "sdpa" and words in choice.reason
        with pytest.raises(ValueError, match=words):
            attention(q, k, v, sinks=sinks, backend="sdpa", **options)
    q, k, v, sinks = leaves((1, 2, 2, 5, 8, 16), torch.float32, "cpu")  # causal with t < s
    with pytest.raises(ValueError, match="a mask other than causal"):
        attention(q, k, v, sinks=sinks, causal=True, backend="sdpa")


def test_calls_torchs_sdpa_would_not_give_a_flash_kernel_go_elsewhere(device):
    """Values wider than the keys (torch's math path), torch's own choice narrowed by
    ``sdpa_kernel``, and on CUDA float32 or a head dim that is not a multiple of 8."""
    words = "would run neither its flash nor its cuDNN kernel"
    cases = [((1, 2, 2, 8, 8, 16), torch.bfloat16, 12, None)]  # d_v = 12
    cases.append(((1, 2, 2, 8, 8, 16), torch.bfloat16, None, SDPBackend.MATH))
    if device.type == "cuda":
        cases += [((1, 2, 2, 8, 8, 16), torch.float32, None, None)]
        cases += [((1, 2, 2, 8, 8, 20), torch.bfloat16, None, None)]
    for shape, dtype, d_v, only in cases:
        q, k, v, sinks = leaves(shape, dtype, device)
        if d_v is not None:
            v = v[..., :d_v]
        with sdpa_kernel([only]) if only is not None else contextlib.nullcontext():
            choice = which_backend(q, k, v, sinks=sinks, causal=True)
            assert choice.backend != "sdpa" and words in choice.reason
            with pytest.raises(ValueError, match=words):
                attention(q, k, v, sinks=sinks, causal=True, backend="sdpa")
            out = attention(q, k, v, sinks=sinks, causal=True)
        want = naive_attention(*(x.double() for x in (q, k, v)), sinks=sinks.double(), causal=True)
        assert (out.double() - want[0]).abs().max() < 0.05


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("kernel", [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION])
def test_each_cuda_kernel_with_an_lse_runs_sinks_within_the_naive_paths_error(device, kernel):
    """torch's flash and cuDNN kernels, each as ``sdpa_kernel`` narrows torch's choice: the same
    output and gradients, within the bf16 bounds, as where torch picks."""
    name = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.CUDNN_ATTENTION: "cudnn"}[kernel]
    ran = []
    for case in ("mha causal d=128", "mha", "gqa causal d=40"):
        shape, causal = CASES[case]
        xs = leaves(shape, torch.bfloat16, device)
        with sdpa_kernel([kernel]):
            if sdpa_sinks.fused_kernel(*xs[:3], causal, shape[-1] ** -0.5) != name:
                continue  # this kernel does not take these shapes on this GPU
            ran.append(case)
            check_half_precision(xs, causal)
    assert ran or kernel == SDPBackend.CUDNN_ATTENTION  # the flash kernel takes both


@pytest.mark.parametrize("narrowed", [None, "avx2"])
def test_on_a_cpu_auto_takes_the_tiled_kernel_for_sinks_from_its_builds_threshold(
    narrowed, monkeypatch
):
    """On a CPU torch's flash kernel and the passes that join the sinks ran slower than the tiled
    C++ kernel and the same passes from 384 x 384 scores on the AVX2 build, 512 x 512 on the
    AVX-512 ones (docs/bench/choices.md), where that kernel runs."""
    from attnkit.backends import tiled
    from attnkit.kernels import cpu as _cpu

    if narrowed is not None:  # the AVX2 kind's threshold on any CPU that has AVX2
        if not _cpu.has("avx2"):
            pytest.skip("this CPU has no AVX2")
        monkeypatch.setenv("ATTNKIT_CPU_FEATURES", narrowed)
    n = 384 if _cpu.build_level() == "avx2" else 512
    assert tiled.sinks_native_from() == n * n  # the threshold the lengths below straddle
    for m, fastest in [(n - 1, "sdpa"), (n, "tiled")]:
        q, k, v, sinks = leaves((1, 1, 1, m, m, 8), torch.float32, "cpu")
        native = which_backend(q, k, v, sinks=sinks, backend="tiled").path == "native"
        choice = which_backend(q, k, v, sinks=sinks, causal=True)
        assert choice.backend == (fastest if native else "sdpa")


@pytest.mark.parametrize(
    ("level", "n"), [("none", 512), ("avx2", 384), ("avx512", 512), ("avx512_bf16", 512)]
)
def test_the_sinks_threshold_is_the_avx512_builds_but_on_the_avx2_one(level, n, monkeypatch):
    """Measured on the AVX2 and AVX-512 kinds; the builds not measured take the AVX-512 one's."""
    from attnkit.backends import tiled
    from attnkit.kernels import cpu as _cpu

    monkeypatch.setattr(_cpu, "build_level", lambda: level)
    assert tiled.sinks_native_from() == n * n


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp32_output_and_every_gradient_match_the_oracle(case):
    shape, causal = case
    xs = leaves(shape, torch.float32, "cpu")
    out = attention(*xs[:3], sinks=xs[3], causal=causal, backend="sdpa")
    xs64, out64 = oracle(xs, causal)
    torch.testing.assert_close(out, out64.float())
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, xs, dout)
    want = torch.autograd.grad(out64, xs64, dout.double())
    for g, g64 in zip(got, want):
        torch.testing.assert_close(g, g64.float())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_half_precision_within_the_naive_paths_error(case, device):
    """bf16 on the CPU's flash kernel, and on CUDA's: within 2x the naive path's error in the
    same precision, gradients within 3x."""
    shape, causal = case
    xs = leaves(shape, torch.bfloat16, device)
    if device.type == "cuda":  # on a CPU the tiled kernel may be faster in bf16
        assert which_backend(*xs[:3], sinks=xs[3], causal=causal).backend == "sdpa"
    check_half_precision(xs, causal)


def check_half_precision(xs, causal):
    out = attention(*xs[:3], sinks=xs[3], causal=causal, backend="sdpa")
    naive_xs = [x.detach().clone().requires_grad_() for x in xs]
    naive_out = naive_attention(*naive_xs[:3], sinks=naive_xs[3], causal=causal)[0]
    xs64, out64 = oracle(xs, causal)
    assert out.dtype == torch.bfloat16
    assert_within_the_naive_error((out, naive_out, out64), (xs, naive_xs, xs64))


def test_gradcheck_and_gradgradcheck_in_float64():
    """Twice differentiable: a backward with create_graph=True differentiates the reference."""
    q, k, v, sinks = leaves((1, 2, 1, 5, 5, 4), torch.float64, "cpu")

    def fn(q, k, v, sinks):
        return attention(q, k, v, sinks=sinks, causal=True, backend="sdpa")

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, sinks))


def test_non_finite_inputs_and_sinks_follow_attnkits_rule(device):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, sinks = (x.detach() for x in leaves((1, 2, 2, 6, 6, 16), dtype, device))
    q[0, 1, 2, 0] = float("-inf")  # a query row that SDPA's kernels would take for a masked one
    k[0, 0, 3, 5] = float("nan")  # a key that rows 3.. of head 0 see, causally
    out = attention(q, k, v, sinks=sinks, causal=True, backend="sdpa")
    expected = torch.zeros(2, 6, dtype=torch.bool, device=device)
    expected[1, 2] = True
    expected[0, 3:] = True
    assert torch.equal(out[0].isnan().all(-1), expected)
    assert not out[0][~expected].isnan().any()
    none = torch.full_like(sinks, float("-inf"))  # a sink of -inf is no sink
    q[0, 1, 2, 0] = 0.0
    k[0, 0, 3, 5] = 0.0
    torch.testing.assert_close(
        attention(q, k, v, sinks=none, backend="sdpa"), attention(q, k, v, backend="sdpa")
    )
    infinite = sinks.clone()
    infinite[1] = float("inf")  # an infinite score: the head's rows are NaN, and their gradients
    grads = {}
    for backend in ("sdpa", "reference"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, infinite)]
        out = attention(*xs[:3], sinks=xs[3], backend=backend)
        assert out[0, 1].isnan().all() and not out[0, 0].isnan().any()
        grads[backend] = torch.autograd.grad(out.sum(), xs)
    for got, want in zip(grads["sdpa"], grads["reference"]):
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()


def test_under_a_transform_sinks_go_to_a_backend_that_takes_them():
    """The path is an autograd function around torch's private ops, which torch.func transforms
    cannot enter: under vmap ``auto`` passes it over and ``backend="sdpa"`` refuses, naming why."""
    q, k, v = (torch.randn(3, 1, 2, 6, 8) for _ in range(3))
    sinks = torch.randn(2)

    def one(q, k, v, backend="auto"):
        return attention(q, k, v, sinks=sinks, causal=True, backend=backend)

    out = torch.func.vmap(one)(q, k, v)
    for i in range(3):
        torch.testing.assert_close(out[i], one(q[i], k[i], v[i], "reference"))
    with pytest.raises(ValueError, match=r"under a torch\.func transform"):
        torch.func.vmap(lambda q, k, v: one(q, k, v, "sdpa"))(q, k, v)


def test_the_sinks_alone_need_no_backward_of_the_kernel(monkeypatch):
    """Where only the sinks want a gradient, it is one reduction: the kernel's backward (costlier
    than its forward) does not run."""
    q, k, v, sinks = leaves((1, 2, 2, 6, 6, 16), torch.float32, "cpu")
    out = attention(q, k, v, sinks=sinks, causal=True, backend="sdpa")
    want = torch.autograd.grad(out.sum(), sinks, retain_graph=True)[0]

    def no_backward(*args, **kwargs):
        raise AssertionError("the kernel's backward ran")

    monkeypatch.setattr(sdpa_sinks, "_backward", no_backward)
    q, k, v = (x.detach() for x in (q, k, v))
    out = attention(q, k, v, sinks=sinks, causal=True, backend="sdpa")
    torch.testing.assert_close(torch.autograd.grad(out.sum(), sinks)[0], want)
