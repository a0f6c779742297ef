"""The backend registry: a name -> :class:`Backend` (a function and the options it supports).

======================  =========  ====  =====
option                  reference  sdpa  notes
======================  =========  ====  =====
causal, window          yes        yes   sdpa: a bool mask unless causal with t == s
attn_mask, key_mask     yes        yes
alibi_slopes            yes        yes   sdpa: a float mask of shape (h, t, s)
softcap                 yes        no
dropout_p               yes        yes
return_lse              yes        no
return_weights          yes        no
======================  =========  ====  =====

``"auto"`` takes the first backend of :data:`AUTO_ORDER` that supports every option in use. A backend
named explicitly that cannot do what was asked raises, naming the option; nothing falls back silently.
"""

from __future__ import annotations

from attnkit.backends.base import AttentionOutput, Backend, BackendFn, Request
from attnkit.backends.reference import reference
from attnkit.backends.sdpa import sdpa

_MASKS = frozenset({"causal", "window", "attn_mask", "key_mask", "alibi_slopes", "dropout_p"})

BACKENDS: dict[str, Backend] = {
    "reference": Backend(
        "reference",
        reference,
        _MASKS | {"softcap", "return_lse", "return_weights"},
    ),
    "sdpa": Backend("sdpa", sdpa, _MASKS),
}

# Fastest first.
AUTO_ORDER: tuple[str, ...] = ("sdpa", "reference")


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
