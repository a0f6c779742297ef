"""The reference backend: the equations of [`attnkit.rules.exact`][attnkit.rules.exact],
materialised in float64.

It is the single source of truth inside attnkit: it supports every option and every transform,
and it is also the slowest path, with ``O(t * s)`` memory per head.
"""

from __future__ import annotations

from attnkit.backends.base import Backend, Route, result_bytes
from attnkit.call import AttentionOutput, Call
from attnkit.rules.exact import reference


class ReferenceBackend(Backend):
    """The equations, materialised in float64: every option, every transform."""

    name = "reference"
    supports = frozenset(
        {"causal", "window", "attn_mask", "key_mask", "alibi_slopes", "softcap", "return_lse"}
        | {"return_weights", "score_mod", "block_mask", "shift", "dropout_p", "attn_mask_grad"}
        | {"sinks", "indices"}
    )

    def path(self, call: Call) -> Route:
        return Route("float64", "float64")

    def memory(self, call: Call) -> tuple[int, str]:
        b, h, t, _ = call.q.shape
        scores = 3 * b * h * t * call.k.shape[2] * 8  # scores, weights and their exponentials
        return result_bytes(call) + scores, "the results and float64 scores, weights, exponentials"

    def run(self, call: Call) -> AttentionOutput:
        return reference(call)


BACKEND = ReferenceBackend()
