"""Top-k sparse attention held to the float64 oracle (`helpers.oracle`), for the tests of each
of its paths."""

from __future__ import annotations

import torch

from attnkit import attention
from attnkit.functional import which_backend
from helpers.oracle import naive_attention, selection_of


def check_sparse(q, k, v, indices, path, *, oracle_keys=None, **options):
    """Top-k sparse attention on the sparse backend's ``path`` against the oracle in float64, the
    selection a dense mask (`selection_of`): output, lse and gradients; the oracle takes
    ``oracle_keys`` for k where given."""
    assert which_backend(q, k, v, indices=indices, **options).path == path
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    exact = [x.double().requires_grad_() for x in (q, k if oracle_keys is None else oracle_keys, v)]
    out, lse = attention(*leaves, indices=indices, return_lse=True, **options)
    mask = selection_of(indices, q.shape[1], k.shape[2])
    want, want_lse, _ = naive_attention(*exact, attn_mask=mask, **options)
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(lse, want_lse.float())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    wanted = torch.autograd.grad(want, exact, dout.double())
    for got, expected in zip(grads, wanted):
        torch.testing.assert_close(got, expected.float())
