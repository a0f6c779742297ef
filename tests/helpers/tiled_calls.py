"""The tiled kernel's backward called as the tests write it: the forward's options and the
backward's tensors, gathered into the ``TiledBackwardOptions`` the kernel takes."""

from __future__ import annotations

FORWARD_FIELDS = (
    "bias",
    "allowed",
    "key_mask",
    "alibi",
    "softcap",
    "window_left",
    "window_right",
    "shift",
    "block_q",
    "block_k",
    "route",
    "tile_rows",
    "tile_keys",
    "mod_bias",
    "dropout_p",
    "dropout_seed",
)


def backward(kernel, dout, q, k, v, lse, delta, dq, dk, dv, q_scale, options, alibi_grad=False):
    """``kernel.backward`` with the forward's ``options`` extended by the backward's fields."""
    extended = kernel.TiledBackwardOptions()
    for name in FORWARD_FIELDS:
        setattr(extended, name, getattr(options, name))
    extended.dout, extended.lse, extended.delta = dout, lse, delta
    extended.dq, extended.dk, extended.dv = dq, dk, dv
    extended.q_scale, extended.alibi_grad = q_scale, alibi_grad
    return kernel.backward(q, k, v, extended)
