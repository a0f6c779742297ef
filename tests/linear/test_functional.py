"""attnkit.linear.functional: `gated_delta_rule` as flash-linear-attention's and transformers'
callers use it: every result and gradient against the float64 token loop, each dtype, packed
sequences against each sequence alone (forward and backward, any mix of lengths), a NaN that stays
in its sequence, the choice of form and its reason, and bad input named."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import attnkit
from attnkit.force import forced
from attnkit.linear import gated_delta_rule, kernel, which_gated_delta_rule
from helpers.devices import CUDA

KERNEL_USABLE = kernel.KERNEL.usable()[0]

CHUNKED = [
    pytest.param("chunked", marks=pytest.mark.skipif(not KERNEL_USABLE, reason="no C++ kernel")),
    "chunked:torch",
]
"""The chunked backend's two forms: on its C++ kernel, and in PyTorch (forced)."""


def on(backend: str) -> tuple[str, contextlib.AbstractContextManager]:
    """The backend's name and the context that runs it (``"chunked:torch"``: forced)."""
    if backend == "chunked:torch":
        return "chunked", forced("chunked:torch")
    return backend, contextlib.nullcontext()


def inputs(b=2, t=19, h_k=2, h=4, d_k=8, d_v=6, dtype=torch.float32):
    """Keys of norm near 1, as the models' are: a write ``beta |k|^2`` above 2 would make the
    state grow at every token, and float32's rounding with it."""
    q, k = torch.randn(b, t, h_k, d_k), torch.randn(b, t, h_k, d_k) * d_k**-0.5
    v = torch.randn(b, t, h, d_v)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, h))  # as the models make it: <= 0
    beta = torch.rand(b, t, h)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def f64(xs):
    return [None if x is None else x.detach().double().requires_grad_(x.requires_grad) for x in xs]


def test_it_is_attnkits_and_takes_flash_linear_attentions_keyword():
    q, k, v, g, beta = inputs()
    out, final = attnkit.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert final is None and out.shape == v.shape
    torch.testing.assert_close(out, gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0])
    assert not torch.allclose(out, gated_delta_rule(q, k, v, g, beta)[0])


@pytest.mark.parametrize("l2norm", [False, True], ids=["raw q and k", "use_qk_l2norm"])
def test_float32_results_and_every_gradient_match_the_float64_loop(l2norm):
    q, k, v, g, beta = inputs()
    state = torch.randn(2, 4, 8, 6)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, state)]
    options = {"scale": 0.7, "output_final_state": True, "use_qk_l2norm": l2norm}
    out, final = gated_delta_rule(*leaves[:5], initial_state=leaves[5], **options)
    assert final.dtype == torch.float32
    exact = f64(leaves)
    want, want_final = gated_delta_rule(*exact[:5], initial_state=exact[5], **options)
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(final, want_final.float())
    dout, dfinal = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out, final), leaves, (dout, dfinal))
    wanted = torch.autograd.grad((want, want_final), exact, (dout.double(), dfinal.double()))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, wanted):
        torch.testing.assert_close(a, b.float(), msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_within_twice_the_naive_loops_error(dtype):
    """The naive path in the same precision: the token loop on the rounded inputs, in that dtype
    throughout; attnkit keeps its state and sums in float32."""
    from attnkit.linear.reference import delta_rule_loop

    q, k, v, g, beta = inputs(b=1, t=40, h_k=2, h=2, dtype=dtype)
    q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(dtype) for x in (q, k))
    out, final = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert out.dtype == dtype and final.dtype == torch.float32
    want, _ = gated_delta_rule(*f64([q, k, v, g, beta]))
    scale = 8**-0.5
    naive, _ = delta_rule_loop(q[0] * scale, k[0], v[0], g[0], beta[0], q.new_zeros(2, 8, 6))
    naive_error = (naive.double() - want[0]).abs().max()
    assert (out[0].double() - want[0]).abs().max() <= 2 * naive_error


@pytest.mark.parametrize(
    "lengths",
    [[1, 18], [5, 1, 13], [19]],
    ids=["one token first", "a token between", "one sequence"],
)
def test_packed_sequences_are_each_sequence_alone_forward_and_backward(lengths):
    q, k, v, g, beta = inputs(b=1)
    states = torch.randn(len(lengths), 4, 8, 6)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, states)]
    out, final = gated_delta_rule(
        *leaves[:5], initial_state=leaves[5], cu_seqlens=cu, output_final_state=True
    )
    dout, dfinal = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out, final), leaves, (dout, dfinal))
    parts, finals = [], []
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = [x[:, start:end] for x in leaves[:5]]
        o, f = gated_delta_rule(*one, initial_state=leaves[5][n : n + 1], output_final_state=True)
        parts.append(o)
        finals.append(f)
    alone, alone_final = torch.cat(parts, dim=1), torch.cat(finals)
    torch.testing.assert_close(out, alone)
    torch.testing.assert_close(final, alone_final)
    want = torch.autograd.grad((alone, alone_final), leaves, (dout, dfinal))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", "recurrent", *CHUNKED])
def test_a_nan_in_one_sequence_never_reaches_another(backend):
    q, k, v, g, beta = inputs(b=1, dtype=torch.float64 if backend == "reference" else torch.float32)
    v[0, 7, 1, 2] = math.nan  # in the second of three sequences
    cu = torch.tensor([0, 5, 11, 19])
    backend, context = on(backend)
    with context:
        out, final = gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, backend=backend
        )
    assert bool(out[0, :5].isfinite().all()) and bool(out[0, 11:].isfinite().all())
    assert bool(out[0, 7:11].isnan().any()) and bool(final[1].isnan().any())
    assert bool(final[0].isfinite().all()) and bool(final[2].isfinite().all())


def test_auto_takes_the_loop_for_float64_and_the_chunks_otherwise_and_says_why():
    q, k, v, g, beta = inputs()
    assert which_gated_delta_rule(q, k, v, g, beta).backend == "chunked"
    exact = which_gated_delta_rule(*f64([q, k, v, g, beta]))
    assert exact.backend == "reference" and "float64" in exact.reason
    named = which_gated_delta_rule(q, k, v, g, beta, backend="reference")
    assert (named.backend, named.reason) == ("reference", "asked for by name")
    with forced("chunked:torch"):
        torch_form = which_gated_delta_rule(q, k, v, g, beta)
    assert torch_form.path == "torch" and "forced" in torch_form.reason
    chunked = which_gated_delta_rule(q, k, v, g, beta, backend="chunked")
    if KERNEL_USABLE:
        assert chunked.path == "kernel" and "C++" in chunked.reason
    doubles = which_gated_delta_rule(*f64([q, k, v, g, beta]), backend="chunked")
    assert doubles.path == "torch" and "float64" in doubles.reason
    short = which_gated_delta_rule(*(x[:, :2] for x in (q, k, v, g, beta)))  # a short prompt
    assert short.backend == "recurrent" and "at most 16 tokens" in short.reason
    one_row = [x[:1] for x in (q, k, v, g, beta)]
    short = which_gated_delta_rule(*one_row, cu_seqlens=torch.tensor([0, 9, 19]))
    long = which_gated_delta_rule(*one_row, cu_seqlens=torch.tensor([0, 2, 19]))
    assert (short.backend, long.backend) == ("recurrent", "chunked")


@pytest.mark.parametrize("t", [1, 16, 17], ids=lambda t: f"t={t}")
def test_every_form_gives_the_loops_results_and_gradients(t):
    q, k, v, g, beta = inputs(t=t)
    state = torch.randn(2, 4, 8, 6)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, state)]
    exact = f64(leaves)
    want = gated_delta_rule(*exact[:5], initial_state=exact[5], output_final_state=True)
    dout, dfinal = torch.randn_like(want[0]).float(), torch.randn_like(want[1]).float()
    wanted = torch.autograd.grad(want, exact, (dout.double(), dfinal.double()))
    for backend, context in map(on, ("recurrent", "chunked", "chunked:torch")):
        with context:
            got = gated_delta_rule(
                *leaves[:5], initial_state=leaves[5], output_final_state=True, backend=backend
            )
        torch.testing.assert_close(got[0], want[0].float())
        torch.testing.assert_close(got[1], want[1].float())
        grads = torch.autograd.grad(got, leaves, (dout, dfinal))
        for a, b in zip(grads, wanted):
            torch.testing.assert_close(a, b.float())


def bad_cases():
    q, k, v, g, beta = inputs()
    yield "positive g", (q, k, v, g.abs() + 0.1, beta), {}, ValueError, r"g must be <= 0"
    yield "heads", (q, k, v[:, :, :3], g[..., :3], beta[..., :3]), {}, ValueError, r"multiple"
    yield "k's shape", (q, k[:, :5], v, g, beta), {}, ValueError, r"k must have q's shape"
    yield "v's length", (q, k, v[:, :5], g, beta), {}, ValueError, r"v must be \(b=2, t=19"
    yield "beta's shape", (q, k, v, g, beta[..., :2]), {}, ValueError, r"beta must be \(b=2"
    yield "a dtype", (q, k.double(), v, g, beta), {}, TypeError, r"k must be a floating-point"
    yield "an int g", (q, k, v, g.long(), beta), {}, TypeError, r"g must be a floating-point"
    one = [x[:1] for x in (q, k, v, g, beta)]
    cu = torch.tensor
    yield (
        "a batch with cu_seqlens",
        (q, k, v, g, beta),
        {"cu_seqlens": cu([0, 19])},
        ValueError,
        r"b=2",
    )
    yield (
        "not increasing",
        one,
        {"cu_seqlens": cu([0, 9, 9, 19])},
        ValueError,
        r"strictly increasing",
    )
    yield "not ending at t", one, {"cu_seqlens": cu([0, 9, 18])}, ValueError, r"end at t=19"
    yield "float offsets", one, {"cu_seqlens": cu([0.0, 19.0])}, ValueError, r"integer offsets"
    state = {"initial_state": torch.zeros(2, 4, 8, 5)}
    yield "initial_state", (q, k, v, g, beta), state, ValueError, r"initial_state must be \(N=2"
    yield "backend", (q, k, v, g, beta), {"backend": "fla"}, ValueError, r"backend must be"
    yield "not a tensor", (q, k, [1.0], g, beta), {}, TypeError, r"v must be a torch.Tensor"


@pytest.mark.parametrize(("why", "args", "options", "error", "message"), list(bad_cases()),
                         ids=[c[0] for c in bad_cases()])  # fmt: skip
def test_bad_input_is_named(why, args, options, error, message):
    with pytest.raises(error, match=message):
        gated_delta_rule(*args, **options)


@pytest.mark.parametrize(
    "shape", [(2, 0, 2, 4, 8, 6), (0, 5, 2, 4, 8, 6)], ids=["no token", "no row"]
)
def test_an_empty_call_gives_zeros_and_the_states_as_given(shape):
    b, t, h_k, h, d_k, d_v = shape
    q, k, v = torch.randn(b, t, h_k, d_k), torch.randn(b, t, h_k, d_k), torch.randn(b, t, h, d_v)
    state = torch.randn(b, h, d_k, d_v)
    out, final = gated_delta_rule(q, k, v, initial_state=state, output_final_state=True)
    assert out.shape == (b, t, h, d_v) and not out.any()
    torch.testing.assert_close(final, state)


@pytest.mark.parametrize("backend", ["recurrent", *CHUNKED])
def test_a_decay_of_minus_infinity_wipes_the_memory_in_every_form(backend):
    q, k, v, g, beta = inputs(b=1, t=20)
    g[0, 6] = -math.inf  # the memory is wiped before token 6 writes
    backend, context = on(backend)
    with context:
        out, final = gated_delta_rule(
            q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True, backend=backend
        )
    exact = f64([q, k, v, g, beta])
    want, want_final = gated_delta_rule(*exact, output_final_state=True, use_qk_l2norm=True)
    fresh, fresh_final = gated_delta_rule(
        *(x[:, 6:] for x in exact), output_final_state=True, use_qk_l2norm=True
    )
    torch.testing.assert_close(want[:, 6:], fresh)  # the loop: nothing before token 6 remains
    torch.testing.assert_close(want_final, fresh_final)
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(final, want_final.float())


def test_it_compiles_in_one_graph_and_gives_the_eager_results():
    """Under torch.compile the chunked form runs in PyTorch operations, traced whole."""
    q, k, v, g, beta = inputs(b=1, t=40)

    def call(*xs):
        return gated_delta_rule(*xs, use_qk_l2norm=True, output_final_state=True)

    out, final = torch.compile(call, fullgraph=True)(q, k, v, g, beta)
    want, want_final = call(q, k, v, g, beta)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(final, want_final)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_on_any_device_results_and_gradients_match_the_float64_loop(device):
    """On a GPU the chunked form runs in PyTorch operations (the reason says why); packed
    sequences and every gradient as on the CPU."""
    q, k, v, g, beta = inputs(b=1, t=40)
    states = torch.randn(2, 4, 8, 6)
    cu = torch.tensor([0, 17, 40])
    exact = f64([q, k, v, g, beta, states])
    for x in exact:
        x.requires_grad_()
    leaves = [x.detach().float().to(device).requires_grad_() for x in exact]
    options = {"output_final_state": True, "use_qk_l2norm": True}
    choice = which_gated_delta_rule(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu.to(device))
    assert choice.backend == "chunked"
    if device == "cuda":
        assert choice.path == "torch" and "not CPU tensors" in choice.reason
    out, final = gated_delta_rule(
        *leaves[:5], initial_state=leaves[5], cu_seqlens=cu.to(device), **options
    )
    want, want_final = gated_delta_rule(
        *exact[:5], initial_state=exact[5], cu_seqlens=cu, **options
    )
    torch.testing.assert_close(out.cpu(), want.float())
    torch.testing.assert_close(final.cpu(), want_final.float())
    d_out, d_final = torch.randn_like(want).float(), torch.randn_like(want_final).float()
    got = torch.autograd.grad((out, final), leaves, (d_out.to(device), d_final.to(device)))
    wanted = torch.autograd.grad((want, want_final), exact, (d_out.double(), d_final.double()))
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a.cpu(), b.float())
