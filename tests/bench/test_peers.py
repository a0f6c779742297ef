"""Every implementation the benchmark times computes the same attention (else its time is moot)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.bench.flex_cases import FLEX_VARIANTS, kernel_fn
from attnkit.bench.peers import (
    KERNEL_IMPLS,
    MODULE_IMPLS,
    VARIANTS,
    Case,
    _kernel_fn,
    _module_fn,
    supported,
)
from helpers.oracle import naive_attention


def expected(case: Case, q, k, v):
    if case.variant in FLEX_VARIANTS:  # the dense formula, in float64
        naive, _ = kernel_fn("naive", case.variant, case.n, case.h, grad=False)
        return naive(*(x.double() for x in (q, k, v))).float()
    options = {"causal": case.causal}
    if case.variant == "alibi":
        options["alibi_slopes"] = attnkit.alibi_slopes(case.h).double()
    if case.variant == "softcap":
        options["softcap"] = 30.0
    if case.variant == "window":
        options["window"] = (255, 0) if case.causal else (128, 127)
    if case.variant == "sinks" and case.impl != "torch-sdpa":  # SDPA: plain, the baseline
        options["sinks"] = torch.linspace(-1.0, 1.0, case.h, dtype=torch.float64)
    out, _, _ = naive_attention(*(x.double() for x in (q, k, v)), **options)
    return out.float()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", [i for i in KERNEL_IMPLS if i != "flex-compiled"])
def test_kernel_peers_agree_with_the_oracle(impl, causal, variant):
    case = Case(impl, 300, "fp32", causal, "fwd", variant, h=2, d=8)
    if supported(case):
        return
    q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
    fn, _ = _kernel_fn(case)
    torch.testing.assert_close(fn(q, k, v), expected(case, q, k, v))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "window", "relbias", "document"])
def test_flex_peer_agrees_with_the_oracle(variant):
    case = Case("flex-compiled", 256, "fp32", True, "fwd", variant, h=2, d=16)
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    fn, _ = _kernel_fn(case)
    torch.testing.assert_close(fn(q, k, v), expected(case, q, k, v))


@pytest.mark.parametrize("variant", FLEX_VARIANTS)
def test_a_trained_table_gets_the_same_gradient_from_every_peer(variant):
    grads = []
    for impl in ("naive", "torch-sdpa", "attnkit-auto"):
        torch.manual_seed(3)  # the same table for every peer
        case = Case(impl, 96, "fp32", True, "fwd+bwd", variant, h=2, d=8)
        fn, trained = _kernel_fn(case)
        q, k, v = (torch.randn(1, 2, 96, 8, requires_grad=True) for _ in range(3))
        fn(q, k, v).sum().backward()
        grads.append([x.grad for x in (q, k, v, *trained)])
    assert len(grads[0]) == (4 if variant == "relbias" else 3)
    for other in grads[1:]:
        for g, w in zip(other, grads[0]):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("causal", [False, True])
def test_module_peers_agree(causal):
    x = torch.randn(2, 9, 16)
    outputs = []
    torch.manual_seed(1)
    for impl in MODULE_IMPLS:
        torch.manual_seed(1)  # the same nn.MultiheadAttention weights for each peer
        fn, _ = _module_fn(Case(impl, 9, "fp32", causal, "fwd", group="module", h=4, d=4))
        outputs.append(fn(x))
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0])


def test_flops_follow_flash_attention_counting():
    case = Case("x", 1024, "fp32", False, "fwd", h=12, d=64)
    assert case.flops == 4 * 12 * 1024 * 1024 * 64
    assert Case("x", 1024, "fp32", True, "fwd", h=12, d=64).flops == case.flops / 2
    assert Case("x", 1024, "fp32", False, "fwd+bwd", h=12, d=64).flops == 3.5 * case.flops
