"""Queries placed off bottom-right alignment (``Masks.shift``): a chunk of queries over a chunk of
keys, both cut from longer sequences, as ring attention computes them. Causal masks, windows and
ALiBi follow the global positions."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import functional as F
from attnkit.backends import BACKENDS, choose_backend

PATHS = ["reference", "tiled", "tiled:loop"]
OPTIONS = {  # name: (causal, window, ALiBi)
    "causal": (True, None, False),
    "window": (False, (3, 2), False),
    "causal window, ALiBi": (True, (4, 0), True),
    "ALiBi": (False, None, True),
}
CHUNKS = {  # name: (T, S, q0, q1, k0, k1)
    "before the diagonal": (23, 23, 11, 19, 2, 9),
    "across it": (23, 23, 6, 17, 9, 20),
    "after it (masked when causal)": (23, 23, 0, 6, 12, 21),
    "t < s, bottom-right": (13, 29, 4, 11, 10, 27),
    "t > s": (29, 13, 20, 29, 0, 13),
}


def chunk(q, k, v, chunk_of, causal, window, slopes, backend):
    """attention of queries q0..q1 over keys k0..k1 of global lengths T, S, as ring attention
    asks it: ``(out, lse)``."""
    T, S, q0, _, k0, _ = chunk_of
    t, s = q.shape[2], k.shape[2]
    shift = (q0 + S - T) - k0 - (s - t)  # p(i) = q0 + i + S - T against key k0 + j
    call = F.checked_call(
        q, k, v, causal=causal, window=window, alibi_slopes=slopes, return_lse=True, shift=shift
    )
    out, lse, _ = BACKENDS[backend].run(call)
    return out, lse


def oracle(q, k, v, chunk_of, causal, window, slopes):
    """float64, materialised, with the global positions written out."""
    T, S, q0, q1, k0, k1 = chunk_of
    q_pos = torch.arange(q0, q1)[:, None] + S - T
    k_pos = torch.arange(k0, k1)
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if slopes is not None:
        scores = scores - slopes.double()[:, None, None] * (q_pos - k_pos).abs()
    allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        left, right = window
        allowed &= (k_pos >= q_pos - left) & (k_pos <= q_pos + right)
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(lse.isinf(), 0.0)[..., None])
    return weights @ v.double(), lse


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("chunk_of", CHUNKS)
def test_a_chunk_sees_the_keys_its_global_positions_allow(forcing, path, options, chunk_of):
    backend = forcing(path)
    causal, window, alibi = OPTIONS[options]
    chunk_of = CHUNKS[chunk_of]
    _, _, q0, q1, k0, k1 = chunk_of
    q = torch.randn(1, 4, q1 - q0, 8)
    k, v = torch.randn(1, 2, k1 - k0, 8), torch.randn(1, 2, k1 - k0, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    out, lse = chunk(q, k, v, chunk_of, causal, window, slopes, backend)
    want_out, want_lse = oracle(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), chunk_of, causal, window, slopes
    )
    torch.testing.assert_close(out, want_out.float())
    torch.testing.assert_close(lse, want_lse.float())


@pytest.mark.parametrize("path", PATHS)
def test_gradients_follow_the_global_positions(forcing, path):
    backend = forcing(path)
    chunk_of = CHUNKS["across it"]
    q = torch.randn(1, 4, 11, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 4, 11, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    got = chunk(q, k, v, chunk_of, True, (4, 0), slopes, backend)
    want = oracle(q, k, v, chunk_of, True, (4, 0), slopes)

    def loss(out_lse):
        return out_lse[0].sum() + out_lse[1].masked_fill(out_lse[1].isinf(), 0).sum()

    for g, w in zip(
        torch.autograd.grad(loss(got), (q, k, v)), torch.autograd.grad(loss(want), (q, k, v))
    ):
        torch.testing.assert_close(g, w)


def test_backends_without_shift_refuse_it():
    q = k = v = torch.randn(1, 2, 5, 8)
    call = F.checked_call(q, k, v, causal=True, return_lse=True, shift=3)
    assert choose_backend("auto", call).backend == "tiled"
    with pytest.raises(ValueError, match="shift"):
        choose_backend("sdpa", call)
