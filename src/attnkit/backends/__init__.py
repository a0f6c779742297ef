"""The backend registry: a name -> :class:`Backend` (a function and the options it supports).

======================  =========  ====  =====  =====
option                  reference  sdpa  tiled  notes
======================  =========  ====  =====  =====
causal, window          yes        yes   yes    sdpa: a bool mask unless causal with t == s;
                                                tiled: skips the blocks they empty
attn_mask, key_mask     yes        yes   yes
attn_mask_grad          yes        yes   no     a float attn_mask that requires grad
alibi_slopes            yes        yes   yes    sdpa: a float mask of shape (h, t, s)
softcap                 yes        no    yes
dropout_p               yes        yes   no
return_lse              yes        no    yes    tiled: no gradient through it
return_weights          yes        no    yes    tiled: recomputed from the lse, no gradient
memory                  O(t s)     O(t s) with a mask    O((t + s) d)
======================  =========  ====  =====  =====

``"auto"`` takes the first backend of :data:`AUTO_ORDER` that supports every option in use. A backend
named explicitly that cannot do what was asked raises, naming the option; nothing falls back silently.
"""

from __future__ import annotations

from attnkit.backends import reference, sdpa, tiled
from attnkit.backends.base import AttentionOutput, Backend, BackendFn, Request

_MASKS = frozenset({"causal", "window", "attn_mask", "key_mask", "alibi_slopes"})
_EXTRAS = frozenset({"softcap", "return_lse", "return_weights"})

BACKENDS: dict[str, Backend] = {
    "reference": Backend(
        "reference", reference.reference, _MASKS | _EXTRAS | {"dropout_p", "attn_mask_grad"}
    ),
    "sdpa": Backend("sdpa", sdpa.sdpa, _MASKS | {"dropout_p", "attn_mask_grad"}),
    "tiled": Backend("tiled", tiled.tiled, _MASKS | _EXTRAS),
}

# Fastest first: SDPA's fused kernel when it can do the request, then the O(N)-memory tiled kernel.
AUTO_ORDER: tuple[str, ...] = ("sdpa", "tiled", "reference")


def resolve_backend(name: str, request: Request) -> Backend:
    """The backend that will run ``request``: ``name`` itself, or the first capable one for "auto".

    Raises:
        ValueError: ``name`` is unknown, or the named backend cannot do an option in use.
    """
    if name == "auto":
        for candidate in AUTO_ORDER:
            if request.options <= BACKENDS[candidate].supports:
                return BACKENDS[candidate]
        raise ValueError(f"no backend supports {sorted(request.options)}")  # pragma: no cover
    if name not in BACKENDS:
        choices = ", ".join(repr(n) for n in ("auto", *BACKENDS))
        raise ValueError(f"unknown backend {name!r}; choose one of {choices}")
    backend = BACKENDS[name]
    missing = request.options - backend.supports
    if missing:
        able = [n for n, b in BACKENDS.items() if request.options <= b.supports]
        raise ValueError(
            f"backend {name!r} does not support {', '.join(sorted(missing))}; "
            f"use backend='auto' or one of {able}"
        )
    return backend


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "AttentionOutput",
    "Backend",
    "BackendFn",
    "Request",
    "resolve_backend",
]
