"""Dropout in the tiled backend (attnkit/rules/dropout.py, tiled_dropout.h): its mask drawn from
a hash of the call's seed, the row and the key, in the C++ kernel and the PyTorch loop alike.

With the seed known, the float64 oracle (tests/helpers/oracle.py) multiplies its weights by the same mask,
so every path is checked exactly as without dropout: fp32 outputs and gradients within torch's
default tolerances, bf16 ones within twice (three times for gradients) the error of the naive
path, on odd sizes, GQA, masks and windows; and the mask itself is checked for what dropout
promises (the fraction kept, no pattern, a new mask each call, the same under the same seed).
"""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.functional import which_backend
from attnkit.rules import dropout as drop
from helpers.devices import forced_path
from helpers.oracle import naive_attention

P = 0.3
CASES = {  # name: (b, h, h_kv, t, s, d), attention's options
    "causal, gqa, head dim 40": ((2, 4, 2, 13, 13, 40), {"causal": True}),
    "t < s, window, padding": ((2, 2, 2, 6, 19, 16), {"window": (4, 0), "key_mask": True}),
    "t = 1, mqa": ((1, 4, 1, 1, 23, 32), {}),
}
PATHS = ["tiled", "tiled:loop", "tiled:half", "tiled:half-loop"]


def make(shape, options, dtype=torch.float32):
    b, h, h_kv, t, s, d = shape
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, h_kv, s, d), torch.randn(b, h_kv, s, d)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    options = dict(options)
    if options.get("key_mask"):
        key_mask = torch.rand(b, s) > 0.3
        key_mask[-1] = False  # a whole row of padding: its queries see nothing
        options["key_mask"] = key_mask
    return (q, k, v), options


def with_mask(q, k, v, options, seed_of_call: int, dtype=torch.float64):
    """The oracle's output in ``dtype``, its weights multiplied by the call's dropout mask."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    weights = naive_attention(q, k, v, **options)[2]
    b, h, t, s = weights.shape
    torch.manual_seed(seed_of_call)
    dropout = drop.Dropout.drawn(P)
    factors = drop.keep_scale(dropout, b, h, t, 0, t, 0, s, "cpu", dtype)
    values = v[:, torch.arange(h) // (h // v.shape[1])]
    return (q, k, v), (weights * factors) @ values


def run(path, q, k, v, options, seed: int):
    torch.manual_seed(seed)
    with forced_path(path) as backend:
        return attention(q, k, v, dropout_p=P, backend=backend, **options)


def error(x, reference):
    return (x.double() - reference).abs().max().item()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CASES)
def test_each_path_draws_the_oracles_mask_forward_and_backward(path, name):
    half = "half" in path
    (q, k, v), options = make(*CASES[name], dtype=torch.bfloat16 if half else torch.float32)
    out = run(path, q, k, v, options, seed=7)
    leaves, want = with_mask(q, k, v, options, seed_of_call=7)
    dout = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))
    truth = torch.autograd.grad(want, leaves, dout)
    if not half:
        torch.testing.assert_close(out, want.float())
        for g, w in zip(got, truth):
            torch.testing.assert_close(g, w.float())
        return
    naive_leaves, naive = with_mask(q, k, v, options, seed_of_call=7, dtype=torch.bfloat16)
    naive_grads = torch.autograd.grad(naive, naive_leaves, dout.to(torch.bfloat16))
    assert error(out, want) <= 2 * error(naive, want) + 1e-6
    for g, n, w in zip(got, naive_grads, truth):
        assert error(g, w) <= 3 * error(n, w) + 1e-6


def test_the_same_seed_repeats_a_call_and_another_draws_another_mask():
    (q, k, v), _ = make((1, 2, 2, 40, 40, 16), {})
    first, again = run("tiled", q, k, v, {}, seed=1), run("tiled", q, k, v, {}, seed=1)
    assert torch.equal(first, again)
    assert not torch.equal(first, run("tiled", q, k, v, {}, seed=2))
    torch.manual_seed(3)  # and calls in a row draw new masks
    assert not torch.equal(*(attention(q, k, v, dropout_p=P, backend="tiled") for _ in range(2)))


def test_the_mask_keeps_one_minus_p_of_the_weights_with_no_pattern():
    dropout = drop.Dropout(P, seed=12345)
    factors = drop.keep_scale(dropout, 2, 8, 256, 0, 256, 0, 256, "cpu", torch.float64)
    kept = factors > 0
    n = kept.numel()
    assert abs(kept.double().mean().item() - (1 - P)) < 5 * (P * (1 - P) / n) ** 0.5
    assert torch.allclose(factors[kept], torch.tensor(1 / (1 - P), dtype=torch.float64))
    centred = kept.double() - kept.double().mean()
    for a, b in [  # neighbours along keys, along queries, across heads: uncorrelated
        (centred[..., 1:], centred[..., :-1]),
        (centred[..., 1:, :], centred[..., :-1, :]),
        (centred[:, 1:], centred[:, :-1]),
    ]:
        correlation = (a * b).mean() / centred.var()
        assert abs(correlation.item()) < 5 / a.numel() ** 0.5
    # the expectation of a row's output is the output without dropout
    ones = torch.ones(1, 1, 1, 4096, dtype=torch.float64)
    mean = (drop.keep_scale(dropout, 1, 1, 1, 0, 1, 0, 4096, "cpu", torch.float64) * ones).mean()
    assert abs(mean.item() - 1.0) < 5 * (P / (1 - P) / 4096) ** 0.5


@pytest.mark.parametrize("block", [(0, 37, 0, 53), (5, 30, 17, 53), (36, 37, 0, 1)])
def test_the_kernels_factors_are_the_loops_bit_for_bit(block):
    """keep_scale in float32 on a CPU comes from the C++ kernel (the weights returned after
    dropout): the same factors as torch's operations on the same hash, in any block."""
    dropout = drop.Dropout(P, seed=2**32 - 5)
    native = drop.keep_scale(dropout, 2, 3, 37, *block, "cpu", torch.float32)
    with forced_path("tiled:loop"):  # torch's operations
        looped = drop.keep_scale(dropout, 2, 3, 37, *block, "cpu", torch.float32)
    assert native.shape == looped.shape == (2, 3, block[1] - block[0], block[3] - block[2])
    assert torch.equal(native, looped) and bool((native == 0).any())
    if drop.KERNEL.at_hand():  # a build is here: the factors above came from it
        args = (dropout, 2, 3, 37, *block, torch.device("cpu"), torch.float32)
        assert drop._native_factors(*args) is not None
    wide = drop.keep_scale(dropout, 2, 3, 37, *block, "cpu", torch.float64)
    assert torch.equal(native.double(), wide.float().double())


def test_the_weights_returned_after_dropout_are_those_the_values_met():
    (q, k, v), _ = make((1, 2, 2, 9, 11, 8), {})
    torch.manual_seed(4)
    out, weights = attention(
        q, k, v, dropout_p=P, return_weights="dropped", backend="tiled", causal=True
    )
    torch.testing.assert_close(out, weights @ v)
    assert bool((weights == 0).any())  # some weights were dropped
    torch.manual_seed(4)
    _, before = attention(q, k, v, dropout_p=P, return_weights=True, backend="tiled", causal=True)
    kept = weights > 0
    torch.testing.assert_close(weights[kept], before[kept] / (1 - P))


def test_auto_takes_the_tiled_kernel_for_dropout_on_a_cpu_without_a_dense_mask():
    q = torch.randn(1, 2, 300, 16)
    key_mask = torch.ones(1, 300, dtype=torch.bool)
    key_mask[0, :7] = False
    choice = which_backend(q, q, q, dropout_p=0.1, causal=True, key_mask=key_mask)
    assert (choice.backend, choice.path) == ("tiled", "native")
    assert which_backend(q, q, q, dropout_p=0.1).backend == "tiled"
    assert which_backend(q, q, q).backend == "sdpa"  # without dropout: SDPA's fused kernel


def test_inside_torch_compile_dropout_goes_to_a_backend_that_draws_it_there():
    q = torch.randn(1, 2, 8, 16)
    choice = torch.compile(
        lambda x: which_backend(x, x, x, dropout_p=0.1, backend="auto").backend, fullgraph=False
    )
    assert choice(q) != "tiled"
