"""attnkit.bench.flex_cases: each case's dense equivalents (the bias and the mask the naive formula
and SDPA get) against the case's own definition, and attnkit's options for it against them."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit.bench.flex_cases import (
    DOCUMENTS,
    FLEX_VARIANTS,
    OWN_MASK,
    attention_options,
    build,
    kernel_fn,
    supported,
)
from attnkit.functional import attention

N, HEADS = 24, 2


def positions():
    return torch.arange(N)[:, None], torch.arange(N)  # (query, key)


def defined(variant):
    """``(bias or None, allowed)`` of ``variant`` from its description, score by score."""
    i, j = positions()
    causal = i >= j
    if variant == "relbias":
        table = build(variant, N, HEADS, grad=False).table
        return table[:, i - j + N - 1], causal
    if variant == "alibi-mod":
        return -attnkit.alibi_slopes(HEADS)[:, None, None] * (i - j).abs(), causal
    if variant == "document":  # 8 packed documents of N / 8 tokens, causal within each
        return None, causal & (i // (N // DOCUMENTS) == j // (N // DOCUMENTS))
    if variant == "prefix-lm":  # the first quarter sees itself both ways
        return None, causal | (j < N // 4)
    raise AssertionError(variant)


@pytest.mark.parametrize("variant", FLEX_VARIANTS)
def test_the_dense_bias_and_mask_are_the_cases_definition(variant):
    mods = build(variant, N, HEADS, grad=False)
    bias, allowed = defined(variant)
    assert torch.equal(mods.allowed(N), allowed)
    got = mods.bias(N, torch.float64)
    if bias is None:
        assert got is None and mods.score_mod is None
    else:
        torch.testing.assert_close(got, bias.double())
    assert mods.causal == (variant not in OWN_MASK)


@pytest.mark.parametrize("variant", ["relbias", "alibi-mod"])
def test_the_score_mod_adds_the_dense_bias(variant):
    mods = build(variant, N, HEADS, grad=False)
    i, j = positions()
    heads = torch.arange(HEADS)[:, None, None]
    got = mods.score_mod(torch.zeros(()), None, heads, i, j)
    torch.testing.assert_close(got, mods.bias(N, torch.float32))


def test_only_the_learned_table_is_trained():
    assert build("relbias", N, HEADS, grad=True).table.requires_grad
    assert not build("relbias", N, HEADS, grad=False).table.requires_grad
    _, trained = kernel_fn("naive", "relbias", N, HEADS, grad=True)
    assert len(trained) == 1 and trained[0].requires_grad
    for variant in ("alibi-mod", "document", "prefix-lm"):
        assert kernel_fn("naive", variant, N, HEADS, grad=True)[1] == []


@pytest.mark.parametrize("variant", FLEX_VARIANTS)
def test_attnkits_options_compute_what_the_dense_formula_computes(variant):
    q, k, v = (torch.randn(1, HEADS, N, 8, dtype=torch.float64) for _ in range(3))
    bias, allowed = defined(variant)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    if bias is not None:
        scores = scores + bias.double()
    want = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v
    options = attention_options(build(variant, N, HEADS, grad=False), N)
    if variant in ("document", "prefix-lm"):  # a mask_mod: in a block mask, causal folded in
        assert "block_mask" in options and "causal" not in options
    torch.testing.assert_close(attention(q, k, v, backend="reference", **options), want)
    naive, _ = kernel_fn("naive", variant, N, HEADS, grad=False)
    torch.testing.assert_close(naive(q, k, v), want)


def test_an_unknown_variant_and_unsupported_peers_are_named():
    with pytest.raises(ValueError, match="unknown variant 'sliding'"):
        build("sliding", N, HEADS, grad=False)
    assert supported("attnkit-builtin", "relbias") == "n/a: no built-in option says the same"
    assert supported("attnkit-builtin", "alibi-mod") is None
    assert supported("attnkit-tiled", "document").startswith("n/a: not measured for user")
    assert supported("naive", "document") is None
