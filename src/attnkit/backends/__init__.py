"""The backend registry: a name -> [`Backend`][attnkit.backends.base.Backend] (a function and the options it supports).

| option | reference | sdpa | tiled | decode | notes |
|---|---|---|---|---|---|
| causal, window | yes | yes | yes | no | sdpa: a bool mask unless causal with t == s; tiled: skips the blocks they empty |
| attn_mask, key_mask | yes | yes | yes | key_mask | |
| attn_mask_grad | yes | yes | no | no | a float attn_mask that requires grad |
| alibi_slopes | yes | yes | yes | no | sdpa: a float mask of shape (h, t, s) |
| softcap | yes | no | yes | no | |
| dropout_p | yes | yes | no | no | |
| return_lse | yes | no | yes | no | with gradients |
| return_weights | yes | no | yes | no | tiled: recomputed from the lse |
| double backward | yes | yes | yes | no | sdpa, tiled: through the reference's recomputation (O(t s) memory for it) |
| vmap | yes | yes | yes | no | |
| func.grad, jacrev | yes | yes | no | no | sdpa: one level of gradients |
| forward-mode AD | yes | no | no | no | jvp, jacfwd |
| torch.jit.trace | yes | yes | no | no | tiled's block loop would be frozen |
| torch.compile | yes | yes | loop | no | dynamo cannot trace C++ |
| memory | O(t s) | O(t s) with a mask | O((t + s) d) | O(h d) | |

The tiled backend runs its C++ kernel (``tiled.cpp``) on a CPU where the block products are float32,
or bf16 on a CPU with AVX512-BF16, and its PyTorch loop elsewhere; both support the same options.

The decode backend ([`attnkit.backends.decode`][attnkit.backends.decode]) is for decoding: CPU tensors without gradients,
at most 16 query rows per key/value head. A causal mask is no option there: with one query it
masks nothing ([`attnkit.masks.merge_window`][attnkit.masks.merge_window] drops it).

``"auto"`` takes the first backend of [`AUTO_ORDER`][attnkit.backends.AUTO_ORDER] that supports every option in use and does
not refuse the tensors (a backend's ``refuses`` says why it cannot run them: device, dtype, sizes,
gradients, a transform, tracing), with these exceptions measured with ``attnkit bench``: the tiled
kernel where SDPA would compute every score of a sliding window that shows each query at most a
quarter of the keys, where it would need a dense ALiBi/window mask of more than
[`DENSE_MASK_LIMIT`][attnkit.backends.DENSE_MASK_LIMIT] elements or of any size from [`NATIVE_MIN_SCORES`][attnkit.backends.NATIVE_MIN_SCORES] scores when the tiled
backend's C++ kernel runs (it applies those masks while the scores are in cache, SDPA reads a
materialised mask), for half-precision inputs that need gradients on a CPU without fast
half-precision products (SDPA's backward there ran 4x slower than the tiled kernel's at N=4096),
and for bf16 inputs from the sizes of [`HALF_NATIVE_FROM`][attnkit.backends.HALF_NATIVE_FROM] on a CPU with AVX512-BF16 and no AMX,
where the C++ kernel multiplies bf16 blocks itself (0.5-0.7x SDPA's time from 1024 x 1024 on Zen 5).

Which thresholds hold where: [`DENSE_MASK_LIMIT`][attnkit.backends.DENSE_MASK_LIMIT] is memory, the same on every CPU; the window
rule (a quarter of the keys) counts the scores SDPA computes for nothing; [`NATIVE_MIN_SCORES`][attnkit.backends.NATIVE_MIN_SCORES]
(float32, a dense positional mask) was measured on Zen 3 (AVX2) and again on Zen 5 (AVX-512); the
two half-precision rules are chosen from the CPU's features (`attnkit._cpu`).
[`choose_backend`][attnkit.backends.choose_backend] (public as [`attnkit.functional.which_backend`][attnkit.functional.which_backend]) also says which path
runs and why. A backend named explicitly that cannot do what was asked raises, naming the option;
nothing falls back silently.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import _cpu
from attnkit.backends import decode, reference, sdpa, tiled
from attnkit.backends.base import AttentionOutput, Backend, BackendFn, Request, wants_grad

_MASKS = frozenset({"causal", "window", "attn_mask", "key_mask", "alibi_slopes"})
_EXTRAS = frozenset({"softcap", "return_lse", "return_weights"})
_MODS = frozenset({"score_mod", "block_mask"})
_SHIFT = frozenset({"shift"})  # queries placed off bottom-right (ring attention's chunks)

BACKENDS: dict[str, Backend] = {
    "reference": Backend(
        "reference",
        reference.reference,
        _MASKS | _EXTRAS | _MODS | _SHIFT | {"dropout_p", "attn_mask_grad"},
    ),
    "sdpa": Backend("sdpa", sdpa.sdpa, _MASKS | {"dropout_p", "attn_mask_grad"}, sdpa.refuses),
    "tiled": Backend("tiled", tiled.tiled, _MASKS | _EXTRAS | _MODS | _SHIFT, tiled.refuses),
    "decode": Backend("decode", decode.decode, frozenset({"key_mask"}), decode.refuses),
}
"""The backends by name, each with the options it supports; ``backend=`` takes one of these names
or ``"auto"``."""

AUTO_ORDER: tuple[str, ...] = ("decode", "sdpa", "tiled", "reference")
"""Fastest first: the one-pass decode kernel for a few queries over a cache, SDPA's fused kernel
when it can do the request, then the O(N)-memory tiled kernel."""

DENSE_MASK_LIMIT = 2**24
"""The largest mask SDPA is given to materialise (elements; 64 MiB of float32) before "auto"
prefers the tiled kernel, which needs none."""


NATIVE_MIN_SCORES = 256 * 256
"""The fewest scores (t * s) from which the tiled C++ kernel overtakes SDPA given a dense
positional mask (ALiBi, a window, causal with t != s). b=1, h=12, d=64, fp32, forward /
forward+backward, tiled vs SDPA. Zen 3 (AVX2): at 64 x 64 0.6-1.5x (Python's set-up shows), at
256 x 256 0.2-1.0x, at 1024 x 1024 0.14-0.8x, at 4096 x 4096 0.09-0.7x (ALiBi causal best,
causal with t = s / 2 least). Zen 5 (AVX-512), ALiBi causal and a window of t / 2: at 64 x 64
0.69-1.10x, at 128 x 128 0.42-1.14x, at 256 x 256 0.33-0.99x, at 1024 x 1024 0.13-0.49x. The
same on both kinds."""


HALF_NATIVE_FROM = {"inference": (128, 512 * 512), "training": (64, 128 * 128)}
"""The fewest query rows t and scores t * s from which the tiled C++ kernel's bf16 products
(AVX512-BF16) overtake SDPA's bf16 kernel, without and with gradients. Zen 5, b=1 h=12 d=64,
tiled vs SDPA, forward / forward+backward: t = s = 128 1.5-2.0x / 0.75-0.86x, 256 0.97-1.08x /
0.74-0.76x, 512 0.71-0.84x / 0.65-0.69x, 1024 0.60-0.69x / 0.66x; s = 8192 and t = 32 1.55x /
1.44x, t = 64 1.04x / 0.85x, t = 128 0.73x / 0.55x (below that, packing K and V costs more than
the few rows gain). Chosen from the CPU's features: without AVX512-BF16 the kernel multiplies
bf16 in float32 and this rule does not apply; with AMX, SDPA's bf16 kernel multiplies on AMX and
runs 2.1-4.0x faster than this kernel (an Intel Xeon of the Sapphire Rapids class, N=4096, forward
and forward+backward), so it does not apply there either."""


def _tiled_beats_sdpa(request: Request, q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why SDPA would waste work or memory where the tiled kernel would not (None if it would not)."""
    _, h, t, _ = q.shape
    s = k.shape[-2]
    half = q.dtype in (torch.bfloat16, torch.float16)
    if half and wants_grad(q, k, v) and not tiled._fast_half_matmul(q.dtype, q.device):
        return f"SDPA's {q.dtype} backward is slow on a CPU without fast half-precision products"
    rows, scores = HALF_NATIVE_FROM["training" if wants_grad(q, k, v) else "inference"]
    if (
        q.device.type == "cpu"
        and t >= rows
        and t * s >= scores
        and not _cpu.has("amx_bf16")
        and tiled.products(q, request) == "bf16-avx512_bf16"  # the C++ kernel runs, with vdpbf16ps
    ):
        return "its bf16 block products (AVX512-BF16) with float32 sums run faster than SDPA's"
    window = request.masks.window
    limited = window is not None and window != (-1, 0)  # a window, not just causal
    if limited:
        left, right = window
        visible = (left if left >= 0 else s) + (right if right >= 0 else s) + 1
        if 4 * visible <= s:  # SDPA computes every score, the tiled kernel about visible / s
            return f"the window shows each query at most {visible} of {s} keys"
    dense = limited or request.alibi_slopes is not None or (window == (-1, 0) and t != s)
    if not dense:
        return None
    mask_elements = t * s * (h if request.alibi_slopes is not None else 1)
    if mask_elements > DENSE_MASK_LIMIT:
        return f"SDPA would need a dense mask of {mask_elements} elements"
    if t * s >= NATIVE_MIN_SCORES and tiled.runs_native(q, request):
        return "the C++ kernel applies the positional mask that SDPA would read from memory"
    return None


def _why_not(backend: Backend, options: frozenset[str], request: Request, q, k, v) -> str | None:
    """Why ``auto`` passes over ``backend`` for this call (None if it can run it)."""
    missing = options - backend.supports
    if missing:
        return f"does not support {', '.join(sorted(missing))}"
    if backend.refuses is not None:
        reason = backend.refuses(request, q, k, v)
        if reason is not None:
            return f"cannot run {reason}"
    if backend.name == "decode":
        usable, reason = decode.available()  # the first call builds the kernel
        if not usable:
            return f"is unavailable: {reason}"
    return None


class BackendChoice(NamedTuple):
    """What [`attnkit.functional.which_backend`][attnkit.functional.which_backend] reports.

    Attributes:
        backend: the name of the backend that runs, a key of [`BACKENDS`][attnkit.backends.BACKENDS].
        path: the code inside it: ``"native"`` (its C++ kernel) or ``"loop"`` (its PyTorch loop)
            for ``tiled``; ``"native"`` for ``decode``; ``"torch"`` for ``sdpa`` (torch's own
            kernel); ``"float64"`` for ``reference``.
        reason: why, in a sentence.
        products: the dtype of the block products (for tiled's C++ kernel with bf16 products,
            also how: ``"bf16-avx512_bf16"``); None for sdpa, whose kernel torch chooses, and for
            tiled under ``torch.compile``, whose compiled loop inductor chooses.
    """

    backend: str
    path: str
    reason: str
    products: str | None = None


def _path(backend: Backend, request: Request, q: Tensor) -> tuple[str, str | None]:
    """The path inside ``backend`` that runs on ``q`` and its block products."""
    if backend.name == "tiled":
        if torch.compiler.is_compiling():
            return "loop", None
        native = tiled.runs_native(q, request)
        return ("native" if native else "loop"), tiled.products(q, request)
    return {
        "decode": ("native", "float32"),
        "sdpa": ("torch", None),
        "reference": ("float64", "float64"),
    }[backend.name]


def choose_backend(name: str, request: Request, q: Tensor, k: Tensor, v: Tensor) -> BackendChoice:
    """The backend that will run ``request`` on ``q``, ``k``, ``v``, with its path and why: ``name``
    itself, or for "auto" the fastest capable one.

    Raises:
        ValueError: ``name`` is unknown, or the named backend cannot do an option in use.
    """
    if name == "auto":
        options = request.options  # a property: computed once here
        passed = []
        for candidate in AUTO_ORDER:
            backend = BACKENDS[candidate]
            why_not = _why_not(backend, options, request, q, k, v)
            if why_not is not None:
                passed.append(f"{candidate} {why_not}")
                continue
            reason = f"the first backend of {', '.join(AUTO_ORDER)} that runs this call"
            if candidate == "sdpa" and options <= BACKENDS["tiled"].supports:
                faster = _tiled_beats_sdpa(request, q, k, v)
                if (
                    faster is not None
                    and _why_not(BACKENDS["tiled"], options, request, q, k, v) is None
                ):
                    backend, reason = BACKENDS["tiled"], f"faster than sdpa here: {faster}"
            if passed:
                reason += "; passed over: " + "; ".join(passed)
            path, products = _path(backend, request, q)
            return BackendChoice(backend.name, path, reason, products)
        raise AssertionError("the reference backend runs every request")  # pragma: no cover
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
    reason = backend.refuses(request, q, k, v) if backend.refuses is not None else None
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot run {reason}; use backend='auto'")
    if name == "decode":
        usable, reason = decode.available()
        if not usable:
            raise ValueError(f"backend 'decode' is unavailable: {reason}; use backend='auto'")
    path, products = _path(backend, request, q)
    return BackendChoice(name, path, "named by the caller", products)


def resolve_backend(name: str, request: Request, q: Tensor, k: Tensor, v: Tensor) -> Backend:
    """The backend that will run ``request`` (see [`choose_backend`][attnkit.backends.choose_backend])."""
    return BACKENDS[choose_backend(name, request, q, k, v).backend]


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "DENSE_MASK_LIMIT",
    "HALF_NATIVE_FROM",
    "AttentionOutput",
    "Backend",
    "BackendChoice",
    "BackendFn",
    "Request",
    "choose_backend",
    "resolve_backend",
]
