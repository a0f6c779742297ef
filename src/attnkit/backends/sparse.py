"""The sparse backend: top-k sparse attention (``attention(..., indices=...)``), each query over
the keys its indices name, in ``O(t * n * d)`` time and memory.

Two forms of one computation: the C++ kernel ([`attnkit.sparse.native`][attnkit.sparse.native]),
which gathers each selected row of K and V once per query and keeps only the output and the
log-sum-exp (its backward recomputes the weights), on CPU tensors in float32, bf16 and fp16
outside ``torch.compile``; and the PyTorch form ([`attnkit.sparse.gather`][attnkit.sparse.gather]),
which gathers a block of queries' rows at a time, everywhere else (CUDA, ``torch.compile``,
``torch.func``, float64). Both are tested against the float64 reference, which makes the selection
a dense mask.

It runs only calls with ``indices``; every dense call goes elsewhere. Learned sinks join through
the lse ([`attnkit.rules.sinks`][attnkit.rules.sinks]); weights, when asked for, are recomputed from
the lse as a dense ``(b, h, t, s)`` tensor, zero off the selection.
"""

from __future__ import annotations

import torch

from attnkit.backends.base import Backend, Route
from attnkit.call import AttentionOutput, Call, forward_ad_active
from attnkit.rules.sinks import join as join_sinks
from attnkit.sparse import gather, native


class SparseBackend(Backend):
    name = "sparse"
    supports = frozenset(
        {"indices", "causal", "window", "key_mask", "shift", "sinks", "return_lse"}
        | {"return_weights"}
    )

    def refuses(self, call: Call) -> str | None:
        if call.indices is None:
            return "a call without indices (it computes top-k sparse attention alone)"
        if call.q.numel() == 0 or call.k.shape[2] == 0:
            return "an empty call: the reference backend gives its empty results"
        if torch.jit.is_tracing():
            return "under torch.jit.trace (its block loop would be frozen into the trace)"
        if forward_ad_active():
            return "forward-mode AD (torch.func.jvp, jacfwd, forward_ad)"
        return None

    def path(self, call: Call) -> Route:
        """``native`` (the C++ kernel) or ``gather`` (PyTorch operations), and the dtype of the
        scores' products: ``"bf16-avx512_bf16"`` where the kernel multiplies bf16 pairs, else
        float32 (float64 for float64 inputs)."""
        if native.refuses(call):
            stats = torch.promote_types(call.q.dtype, torch.float32)
            return Route("gather", "float64" if stats == torch.float64 else "float32")
        return Route("native", "bf16-avx512_bf16" if native.pair_products(call) else "float32")

    def run(self, call: Call) -> AttentionOutput:
        with torch.autocast(call.q.device.type, enabled=False):
            form = gather if native.refuses(call) else native
            out, lse = form.attend(call)
            weights = gather.weights(call, lse) if call.return_weights else None
        keys_alone = AttentionOutput(out, lse, weights)
        if call.sinks is not None:
            return join_sinks(keys_alone, call.sinks, call.return_lse)
        return keys_alone if call.return_lse else keys_alone._replace(lse=None)


BACKEND = SparseBackend()
