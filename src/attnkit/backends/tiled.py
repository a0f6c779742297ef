"""The tiled backend: FlashAttention-2's online softmax, block by block.

Two implementations of one algorithm: the PyTorch loop of [`attnkit.tiled.loop`][attnkit.tiled.loop], the
readable shape of it, and ``tiled.cpp`` ([`attnkit.tiled.native`][attnkit.tiled.native]), which runs where the
block products are float32 on a CPU: there a dozen tensor operations per block, each a pass over
the block in memory, become a few passes over a row that is in cache. Both are tested against the
float64 oracle, option by option. [`attnkit.tiled.autograd`][attnkit.tiled.autograd] holds what they
share: the autograd function, its ``vmap`` rule and the weights. This module is the backend as the
registry sees it: what it refuses, where it is faster than SDPA, which path runs.

The forward walks over blocks of ``block_q`` queries; for each it streams blocks of ``block_k`` keys,
keeping a running max ``m``, a running sum ``l`` and an unnormalised output ``acc``, and stores only
the output and the log-sum-exp ``lse = m + log(l)``. The backward recomputes each block's
probabilities from ``lse`` (Dao, 2023, Algorithm 2), so no ``(t, s)`` tensor is ever kept: the
peak extra memory is ``O((t + s) * d + block_q * block_k)`` per head.

Blocks that the causal mask or a window empties are never computed: each query block visits only the
key range its positions can see, and blocks lying wholly inside the window skip the positional mask.

Grouped-query attention costs nothing extra: the ``g = h / h_kv`` query heads that share a key/value
head are stacked into one ``(g * block_q)``-row block, so each key block is multiplied once.

Dropout draws its mask block by block from a hash of the call's seed, the row and the key
([`attnkit.rules.dropout`][attnkit.rules.dropout]), and the backward draws it again.

Gradients reach every input and every output: the lse (its gradient enters the backward as
``D_i - dlse_i``), the weights (recomputed from the lse, differentiably when they need a gradient)
and learnable ALiBi slopes. A backward run with ``create_graph=True`` (a gradient penalty) instead
differentiates the reference backend's materialised recomputation, so second derivatives are exact,
at the reference's ``O(t * s)`` memory for that call.

Precision: softmax statistics and accumulators are float32 (float64 for float64 inputs). The matrix
products run in the input dtype where the hardware has fast half-precision products (CUDA; on a CPU,
bf16 with AVX512-BF16 or AMX and fp16 with AMX-FP16, as `attnkit.kernels.cpu` reports); elsewhere
half-precision blocks are multiplied in float32, which is both faster and more accurate there (bf16
GEMM without hardware support is hundreds of times slower than fp32). Where its build has AVX512-BF16,
the C++ kernel multiplies bf16 blocks itself with float32 sums, so scores are never rounded to bf16;
other half-precision products run in the loop.

Shapes: ``b`` batch, ``h`` query heads, ``h_kv`` key/value heads, ``g = h / h_kv``, ``t`` queries,
``s`` keys, ``d`` head dim, ``bq``/``bk`` block sizes.
"""

from __future__ import annotations

import torch

from attnkit._tracing import traced
from attnkit.backends import sdpa
from attnkit.backends.base import Backend, Route
from attnkit.call import AttentionOutput, Call, forward_ad_active, gradient_levels, wants_grad
from attnkit.kernels import cpu
from attnkit.rules.sinks import join as join_sinks
from attnkit.tiled import autograd
from attnkit.tiled.plans import TiledRoute, route_of

DENSE_MASK_LIMIT = 2**24
"""The largest mask SDPA is given to materialise (elements; 64 MiB of float32) before "auto"
prefers the tiled kernel, which needs none."""

NATIVE_MIN_SCORES = 256 * 256
"""The fewest scores (t * s) from which the tiled C++ kernel overtakes SDPA given ALiBi's dense
float mask; measured on AVX2 and AVX-512 CPUs (docs/bench/choices.md). (A window, causal with
t != s and padding go to the tiled backend at any size on a CPU: no dense mask is built.)"""

SINKS_NATIVE_FROM = {"avx2": 384 * 384, "avx512": 512 * 512}
"""The fewest scores t * s from which the tiled C++ kernel with sinks overtakes SDPA's path for
them (torch's CPU flash kernel, through its lse), in float32, causal, per build of the kernel
(`attnkit.kernels.cpu.build_level`): measured on the AVX2 and AVX-512 kinds (docs/bench/choices.md). The
other builds take the AVX-512 one's."""


def sinks_native_from() -> int:
    """[`SINKS_NATIVE_FROM`][attnkit.backends.tiled.SINKS_NATIVE_FROM] for this CPU's build."""
    return SINKS_NATIVE_FROM.get(cpu.build_level(), SINKS_NATIVE_FROM["avx512"])


_OPTIONS_RULED = frozenset({"dropout_p", "window", "alibi_slopes", "sinks"})
"""The options that `TiledBackend.faster_than`'s rules ask about besides half precision and a
causal mask (`_may_be_faster`)."""

HALF_NATIVE_FROM = {"inference": (128, 512 * 512), "training": (64, 128 * 128)}
"""The fewest query rows t and scores t * s from which the tiled C++ kernel's bf16 products
(AVX512-BF16) overtake SDPA's bf16 kernel, without and with gradients (below that, packing K and V
costs more than the few rows gain). Without AVX512-BF16 the kernel multiplies bf16 in float32, and
with AMX SDPA's bf16 kernel multiplies on AMX, faster than this kernel: the rule applies to neither
(docs/bench/choices.md)."""


def _may_be_faster(call: Call) -> bool:
    """Whether one of `TiledBackend.faster_than`'s rules may apply (a quick look, on every call
    ``auto`` takes to SDPA): half precision, an option of `_OPTIONS_RULED`, or a causal mask that
    SDPA would need dense (``t != s``, or with padding). A float32 or float64 call with none of
    them stays with SDPA."""
    options = call.options
    if call.q.dtype in (torch.bfloat16, torch.float16) or options & _OPTIONS_RULED:
        return True
    causal = "causal" in options
    return causal and (call.q.shape[2] != call.k.shape[2] or "key_mask" in options)


class TiledBackend(Backend):
    name = "tiled"
    supports = frozenset(
        {"causal", "window", "attn_mask", "key_mask", "alibi_slopes", "softcap", "return_lse"}
        | {"return_weights", "score_mod", "block_mask", "shift", "sinks", "dropout_p"}
    )

    def refuses(self, call: Call) -> str | None:
        if call.q.numel() == 0 or call.k.shape[2] == 0:
            return "an empty call (no batch, head, query or key): the reference backend gives its empty results"
        if call.dropout_p and traced():
            return "dropout inside torch.compile (its seed is drawn in Python, once a call)"
        if torch.jit.is_tracing():
            return "under torch.jit.trace (its block loop would be frozen into the trace at these lengths)"
        if forward_ad_active():
            return "forward-mode AD (torch.func.jvp, jacfwd, forward_ad): the tiled kernel has no jvp rule"
        if (call.score_mod or call.block_mask) is not None and (
            torch._C._are_functorch_transforms_active()
        ):
            return "score_mod or block_mask under a torch.func transform (the reference backend runs it)"
        if torch._C._are_functorch_transforms_active() and gradient_levels(
            call.q, call.k, call.v, call.alibi_slopes
        ):
            return (
                "under torch.func.grad, vjp or jacrev: its recomputing backward does not compose "
                "with them (the reference backend does, and auto takes it or SDPA)"
            )
        return None

    may_be_faster = staticmethod(_may_be_faster)

    def plan(self, call: Call) -> TiledRoute:
        """The route of ``call`` ([`route_of`][attnkit.tiled.plans.route_of]): its kernel or
        loop, products and sizes, worked out once while choosing; nothing is built or loaded."""
        return route_of(call)

    def faster_than(self, other: Backend, call: Call, plan: TiledRoute | None = None) -> str | None:
        """Where SDPA would waste work or memory and this backend would not (measured with
        ``attnkit bench``, docs/bench/choices.md)."""
        if other.name != "sdpa" or not _may_be_faster(call):
            return None
        route = route_of(call) if plan is None else plan  # (None: asked directly, not by auto)
        native = route.kernel is not None
        q, k, v = call.q, call.k, call.v
        half = q.dtype in (torch.bfloat16, torch.float16)
        _, h, t, _ = q.shape
        s = k.shape[-2]
        grad = half and wants_grad(q, k, v)  # the rules below that ask apply to half precision
        if grad and route.products != q.dtype:  # half-precision blocks multiplied in float32
            return (
                f"SDPA's {q.dtype} backward is slow on a CPU without fast half-precision products"
            )
        rows, scores = HALF_NATIVE_FROM["training" if grad else "inference"]
        if (
            half
            and q.device.type == "cpu"
            and t >= rows
            and t * s >= scores
            and not cpu.has("amx_bf16")
            and route.pairs == "avx512_bf16"  # the C++ kernel, with vdpbf16ps
        ):
            return "its bf16 block products (AVX512-BF16) with float32 sums run faster than SDPA's"
        dropout = call.dropout_p and q.device.type == "cpu" and t * s >= NATIVE_MIN_SCORES
        if dropout and native:
            return (  # SDPA's CPU kernels have none: its math path takes the call
                "SDPA's CPU kernels have no dropout: torch's math path would materialise the "
                "scores, the weights and the dropout mask"
            )
        sinks = call.sinks is not None and q.device.type == "cpu" and t * s >= sinks_native_from()
        if sinks and native:
            return (  # SDPA's path adds passes around torch's CPU flash kernel, as this one does
                "with sinks, torch's CPU flash kernel and the passes that join them run slower "
                "than the C++ kernel and the same passes"
            )
        window = call.masks.window
        limited = window is not None and window != (-1, 0)  # a window, not just causal
        if limited:
            left, right = window
            visible = (left if left >= 0 else s) + (right if right >= 0 else s) + 1
            if 4 * visible <= s:  # SDPA computes every score, the tiled kernel about visible / s
                return f"the window shows each query at most {visible} of {s} keys"
        padded = call.masks.key_mask is not None and window is not None  # with the positions
        causal_offset = window == (-1, 0) and 1 < t != s and sdpa.lower_right(call) is None
        if q.device.type == "cpu" and (padded or limited or causal_offset):
            return (  # at any size: the masks a model describes never become t x s tensors
                "SDPA would need a dense mask of the positions or the padding, this backend none"
            )
        dense = limited or call.alibi_slopes is not None or causal_offset
        if not (dense or padded):
            return None
        b = q.shape[0] if padded else 1
        mask_elements = b * t * s * (h if call.alibi_slopes is not None else 1)
        if mask_elements > DENSE_MASK_LIMIT:
            return f"SDPA would need a dense mask of {mask_elements} elements"
        if t * s >= NATIVE_MIN_SCORES and native:
            return "the C++ kernel applies the positional mask that SDPA would read from memory"
        return None

    def path(self, call: Call, plan: TiledRoute | None = None) -> Route:
        """``native`` or ``loop``, and the block products: in the C++ kernel ``"float32"``,
        ``"bf16-avx512_bf16"`` or ``"bf16-portable"``; in the loop, the dtype torch multiplies in;
        None under ``torch.compile``, whose compiled loop inductor chooses."""
        if traced():
            return Route("loop")
        route = route_of(call) if plan is None else plan
        return Route(route.path, route.products_name)

    def run(self, call: Call, plan: TiledRoute | None = None) -> AttentionOutput:
        if call.sinks is None:
            return autograd.run(call, plan)
        keys_alone = autograd.run(call._replace(sinks=None, return_lse=True), plan)
        return join_sinks(keys_alone, call.sinks, call.return_lse)


BACKEND = TiledBackend()
