"""Gradients through everything attention returns (output, lse, weights) to everything that needs one
(q, k, v, ALiBi slopes, float masks), and second derivatives, on every backend: against the float64
oracle, with gradcheck and gradgradcheck."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit import MultiHeadAttention, attention
from attnkit.backends import sdpa as sdpa_backend
from attnkit.functional import which_backend
from helpers.devices import CUDA
from helpers.oracle import naive_attention

# The backends that return lse and weights, on each of their paths
FULL_PATHS = ["reference", "tiled", "tiled:loop"]
GENERAL_PATHS = [*FULL_PATHS, "sdpa"]
OPTIONS = {
    "plain": {},
    "causal gqa": {"causal": True},
    "window": {"window": (2, 1)},
    "key_mask": {"key_mask": torch.tensor([[True, False, True, True, True, False, True]])},
    "bool mask": {"attn_mask": torch.rand(5, 7) > 0.3},
    "float mask": {"attn_mask": torch.randn(1, 4, 5, 7)},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.05])},
    "softcap": {"softcap": 2.0, "scale": 0.7},
}


CPU, GPU = torch.device("cpu"), torch.device("cuda")


def on_devices(cases, cuda):
    """``(*case, device)`` parameters: every case on the CPU, those in ``cuda`` on CUDA too (on
    CUDA the tiled backend always runs its loop: "tiled" and "tiled:loop" are one path there)."""
    return [
        *(pytest.param(*case, CPU, id="-".join([*case, "cpu"])) for case in cases),
        *(pytest.param(*c, GPU, id="-".join([*c, "cuda"]), marks=CUDA.marks) for c in cuda),
    ]


def inputs(dtype=torch.float64, b=1, h=4, h_kv=2, t=5, s=7, d=6, slopes=None, device="cpu"):
    tensors = [
        torch.randn(b, h, t, d, dtype=dtype, device=device),
        torch.randn(b, h_kv, s, d, dtype=dtype, device=device),
        torch.randn(b, h_kv, s, d, dtype=dtype, device=device),
    ]
    if slopes is not None:
        tensors.append(slopes.to(dtype=dtype, device=device))
    return [x.requires_grad_() for x in tensors]


def on(device, options):
    """``options`` with their tensors on ``device``."""
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in options.items()}


def with_masks(options, dtype):
    """The options, a float mask in ``dtype``; every query keeps at least one key (an empty row's
    lse is -inf, whose finite differences are NaN)."""
    options = dict(options)
    if "attn_mask" in options and options["attn_mask"].dtype == torch.bool:
        options["attn_mask"] = options["attn_mask"].clone()
        options["attn_mask"][:, -1] = True
    elif "attn_mask" in options:
        options["attn_mask"] = options["attn_mask"].to(dtype)
    options.pop("alibi_slopes", None)
    return options


@pytest.mark.parametrize(
    ("backend", "device"),
    on_devices([(p,) for p in FULL_PATHS], [("reference",), ("tiled",)]),
    indirect=["backend"],
)
@pytest.mark.parametrize("name", OPTIONS)
def test_output_lse_and_weights_carry_exact_gradients_to_q_k_v_and_slopes(backend, device, name):
    options = on(device, OPTIONS[name])
    q, k, v, *slopes = inputs(torch.float32, slopes=options.get("alibi_slopes"), device=device)
    extra = {"alibi_slopes": slopes[0]} if slopes else {}
    opts = with_masks(options, torch.float32)
    out, lse, weights = attention(
        q, k, v, **opts, **extra, return_lse=True, return_weights=True, backend=backend
    )
    leaves64 = [x.detach().double().requires_grad_() for x in (q, k, v, *slopes)]
    extra64 = {"alibi_slopes": leaves64[3]} if slopes else {}
    out64, lse64, weights64 = naive_attention(
        *leaves64[:3], **with_masks(options, torch.float64), **extra64
    )
    targets = [torch.randn_like(out64), torch.randn_like(lse64), torch.randn_like(weights64)]

    def loss(out, lse, weights):  # a loss on each returned tensor; on the weights, a supervision
        return (
            (out * targets[0]).sum()
            + (lse * targets[1]).sum()
            + ((weights - targets[2]) ** 2).sum()
        )

    got = torch.autograd.grad(loss(out, lse, weights), [q, k, v, *slopes])
    expected = torch.autograd.grad(loss(out64, lse64, weights64), leaves64)
    for g, g64 in zip(got, expected):
        torch.testing.assert_close(g, g64.float(), rtol=1e-4, atol=1e-4)


def test_a_loss_on_the_weights_alone_has_gradients(device):
    q, k, v = inputs(torch.float32, device=device)
    _, weights = attention(q, k, v, causal=True, return_weights=True)
    (weights**2).sum().backward()  # raised "does not require grad" when the weights were detached
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k))


def test_module_weights_are_differentiable_as_torchs_are(device):
    """need_weights=True with gradients: attnkit's weights and torch's, from the same parameters,
    give the same gradient for a loss on both outputs."""
    torch_mha = nn.MultiheadAttention(32, 4, batch_first=True).to(device)
    ours = MultiHeadAttention.from_torch(torch_mha)
    x = torch.randn(2, 9, 32, device=device)
    target = torch.softmax(torch.randn(2, 9, 9, device=device), dim=-1)

    def query_weight_grad(module, out, weights):
        loss = out.sum() + 100 * ((weights - target) ** 2).sum()
        return torch.autograd.grad(
            loss, module.in_proj_weight if module is torch_mha else module.W_query.weight
        )

    (expected,) = query_weight_grad(torch_mha, *torch_mha(x, x, x, need_weights=True))
    (got,) = query_weight_grad(ours, *ours(x, need_weights=True))
    torch.testing.assert_close(got, expected[:32], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("backend", "device"),
    on_devices([(p,) for p in GENERAL_PATHS], [("reference",), ("tiled",), ("sdpa",)]),
    indirect=["backend"],
)
def test_learnable_alibi_slopes_get_their_gradient(backend, device):
    slopes = torch.tensor([0.3, 0.1])
    q, k, v, slopes = inputs(torch.float32, h=2, h_kv=1, t=9, s=12, slopes=slopes, device=device)
    out = attention(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
    (got,) = torch.autograd.grad((out * out).sum(), slopes)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, slopes)]
    out64, _, _ = naive_attention(*leaves[:3], causal=True, alibi_slopes=leaves[3])
    (expected,) = torch.autograd.grad((out64 * out64).sum(), leaves[3])
    torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-4)


def test_auto_gives_learnable_slopes_their_gradient_where_it_picks_the_tiled_kernel(device):
    """At 256 x 256 scores the C++ kernel beats SDPA's dense ALiBi mask, so auto picks it on a
    CPU (the issue's report: at t = s = 3000, slopes.grad stayed None); on CUDA, whatever auto
    picks gives them their gradient too."""
    q, k, v, slopes = inputs(
        torch.float32,
        h=2,
        h_kv=2,
        t=256,
        s=256,
        d=8,
        slopes=torch.tensor([0.1, 0.01]),
        device=device,
    )
    choice = which_backend(q, k, v, causal=True, alibi_slopes=slopes)
    out = attention(q, k, v, causal=True, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is not None and torch.isfinite(slopes.grad).all()
    reference = attention(q, k, v, causal=True, alibi_slopes=slopes, backend="reference")
    (expected,) = torch.autograd.grad(reference.sum(), slopes)
    torch.testing.assert_close(slopes.grad, expected, rtol=1e-4, atol=1e-3)
    if device.type == "cpu":
        assert choice.backend == "tiled", choice


def test_a_float_mask_that_needs_a_gradient_gets_it_and_tiled_refuses_it(device):
    q, k, v = inputs(torch.float32, device=device)
    bias = torch.randn(1, 4, 5, 7, requires_grad=True, device=device)
    assert which_backend(q, k, v, attn_mask=bias).backend != "tiled"
    out = attention(q, k, v, attn_mask=bias, causal=True)
    (got,) = torch.autograd.grad(out.sum(), bias)
    bias64 = bias.detach().double().requires_grad_()
    out64, _, _ = naive_attention(
        *(x.detach().double() for x in (q, k, v)), attn_mask=bias64, causal=True
    )
    (expected,) = torch.autograd.grad(out64.sum(), bias64)
    torch.testing.assert_close(got, expected.float())
    with pytest.raises(ValueError, match="backend 'tiled' does not support attn_mask_grad"):
        attention(q, k, v, attn_mask=bias, backend="tiled")


@pytest.mark.parametrize(
    ("backend", "name", "device"),
    on_devices(
        [(p, n) for n in OPTIONS for p in GENERAL_PATHS],
        [(p, n) for n in ("causal gqa", "alibi") for p in ("reference", "sdpa", "tiled")],
    ),
    indirect=["backend"],
)
def test_gradcheck_and_gradgradcheck_in_float64(backend, name, device):
    """First and second derivatives of every returned tensor on every backend, numerically
    checked (in float64 the tiled backend runs its loop; its create_graph backward, the reference's
    recomputation, is the same on both paths). Slow: on CUDA two of the options."""
    options = on(device, OPTIONS[name])
    leaves = inputs(
        torch.float64, t=3, s=7, d=3, h=4, h_kv=2, slopes=options.get("alibi_slopes"), device=device
    )
    opts = with_masks(options, torch.float64)
    if "attn_mask" in opts:
        opts["attn_mask"] = opts["attn_mask"][..., :3, :]
    full = backend != "sdpa"
    if backend == "sdpa" and "softcap" in opts:  # the refusal, naming the option
        with pytest.raises(ValueError, match="backend 'sdpa' does not support softcap"):
            attention(*leaves[:3], **opts, backend=backend)
        return

    def f(q, k, v, *slopes):
        extra = {"alibi_slopes": slopes[0]} if slopes else {}
        return attention(
            q, k, v, **opts, **extra, return_lse=full, return_weights=full, backend=backend
        )

    assert torch.autograd.gradcheck(f, leaves)
    assert torch.autograd.gradgradcheck(f, leaves)


@pytest.mark.parametrize("backend", ["tiled", "sdpa"], indirect=True)
def test_second_derivatives_in_float32_through_the_fused_kernels(backend, device):
    """A gradient penalty through the C++ kernel and SDPA's fused kernels (neither has a double
    backward of its own): d/dq of |d loss / dk|^2 against the oracle's."""
    q, k, v = inputs(torch.float32, t=6, s=9, device=device)

    def penalty(q, k, v, backend=None):
        if backend is None:
            out, _, _ = naive_attention(q, k, v, causal=True)
        else:
            out = attention(q, k, v, causal=True, backend=backend)
        (dk,) = torch.autograd.grad((out * out).sum(), k, create_graph=True)
        return (dk * dk).sum()

    got = torch.autograd.grad(penalty(q, k, v, backend), (q, k, v))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad(penalty(*leaves), leaves)
    for g, g64 in zip(got, expected):
        torch.testing.assert_close(g, g64.float(), rtol=1e-4, atol=1e-4)


def test_sdpa_refuses_a_second_derivative_through_a_fused_kernels_dropout(monkeypatch):
    """On a CPU, SDPA runs dropout with composite operations, which have a double backward; a fused
    kernel's dropout (a GPU's) cannot be recomputed, and says so instead of a wrong answer."""
    q, k, v = inputs(torch.float32)
    out = attention(q, k, v, dropout_p=0.3, backend="sdpa")
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert dq.requires_grad  # composite dropout: twice differentiable natively
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused_dropout(*args, dropout_p=0.0, **kwargs):
        """torch's fused CPU kernel, which has no dropout, stands in for a GPU's, which has."""
        return torch_sdpa(*args, dropout_p=0.0, **kwargs)

    monkeypatch.setattr(sdpa_backend, "_TORCH_SDPA", fused_dropout)  # the function it calls
    out = attention(q, k, v, dropout_p=0.3, backend="sdpa")
    with pytest.raises(
        ValueError, match="backend 'sdpa' cannot differentiate twice through dropout"
    ):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_the_decode_backend_refuses_gradients():
    q, k, v = inputs(torch.float32, t=1)
    with pytest.raises(ValueError, match="backend 'decode' cannot run inputs that require grad"):
        attention(q, k, v, backend="decode")
