"""The backend registry: the backends by name, and ``auto``, which asks them in order.

| option | reference | sdpa | flex | tiled | decode | sparse | notes |
|---|---|---|---|---|---|---|---|
| causal, window | yes | yes | yes | yes | no | yes | sdpa: a bool mask unless causal with t == s; flex, tiled: skip the blocks they empty |
| indices | yes | no | no | no | no | yes | sparse: the C++ kernel gathers the selected keys on a CPU, PyTorch's gather elsewhere; reference: a dense mask |
| attn_mask, key_mask | yes | yes | yes | yes | key_mask | key_mask | flex: indexed per score in its mask_mod |
| attn_mask_grad | yes | yes | no | no | no | no | a float attn_mask that requires grad |
| alibi_slopes | yes | yes | yes | yes | no | no | sdpa: a float mask of shape (h, t, s); flex: in its score_mod |
| softcap | yes | no | yes | yes | no | no | |
| score_mod, block_mask | yes | no | yes | yes | no | no | flex: torch's own FlexAttention; a block mask alone passes through |
| sinks | yes | fused | yes | yes | yes | yes | sdpa: the flash or cuDNN kernel torch picks, no mask but causal with t == s or one query; flex, tiled: joined to the kernel's output through its lse; decode: in the kernel's merge |
| dropout_p | yes | yes | no | no | no | no | |
| return_lse | yes | no | yes | yes | no | yes | with gradients |
| return_weights | yes | no | no | yes | no | yes | tiled, sparse: recomputed from the lse (sparse: dense, zero off the selection) |
| double backward | yes | yes | yes | yes | no | yes | sdpa, flex, tiled: through the reference's recomputation (O(t s) memory for it); sparse: through its PyTorch form |
| vmap | yes | yes | no | yes | no | yes | sparse: its PyTorch form |
| func.grad, jacrev | yes | yes | no | no | no | yes | sdpa: one level of gradients; sparse: its PyTorch form |
| forward-mode AD | yes | no | no | no | no | no | jvp, jacfwd |
| torch.jit.trace | yes | yes | no | no | no | no | tiled's block loop would be frozen |
| torch.compile | yes | yes | yes | loop | no | gather | dynamo cannot trace C++; flex: masks as -inf scores while traced |
| devices | any | any | CUDA | any | CPU | any | flex: torch's FlexAttention has a backward on CUDA only |
| memory | O(t s) | O(t s) with a mask | O((t + s) d) | O((t + s) d) | O(h d) | O(t n d) | flex: plus its block tables |

Each backend ([`Backend`][attnkit.backends.base.Backend]) says which options it supports, why it
cannot run a call, where it is faster than a backend ``auto`` would take before it, and which path
inside it runs. ``"auto"`` walks [`AUTO_ORDER`][attnkit.backends.AUTO_ORDER], fastest first: it
takes the first backend that supports every option in use and does not refuse the call, then lets
a later one take over where that one's own speed rule says it is faster here (the tiled kernel over
SDPA, for instance, where SDPA would materialise a dense positional mask:
[`attnkit.backends.tiled`][attnkit.backends.tiled]; on CUDA, torch's compiled FlexAttention of
``attnkit.backends.torch_flex``). Choosing never builds, loads or writes
anything: a C++ kernel is built or loaded at the first call that runs it.

A backend named explicitly that cannot do what was asked raises, naming the option; nothing falls
back silently. [`choose_backend`][attnkit.backends.choose_backend] (public as
[`attnkit.functional.which_backend`][attnkit.functional.which_backend]) says which backend and
path run and why.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, NamedTuple

import torch

from attnkit.backends import decode, reference, sdpa, sparse, tiled, torch_flex
from attnkit.backends.base import Backend, Route
from attnkit.call import AttentionOutput, Call
from attnkit.kernels import loader
from attnkit.masks import zero_padding
from attnkit.rules.nonfinite import inputs_finite

BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        reference.BACKEND,
        sdpa.BACKEND,
        torch_flex.BACKEND,
        tiled.BACKEND,
        decode.BACKEND,
        sparse.BACKEND,
    )
}
"""The backends by name; ``backend=`` takes one of these names or ``"auto"``."""

AUTO_ORDER: tuple[str, ...] = ("decode", "sdpa", "flex", "tiled", "sparse", "reference")
"""Fastest first: the one-pass decode kernel for a few queries over a cache, SDPA's fused kernel
when it can do the call, torch's compiled FlexAttention on CUDA, then the O(N)-memory tiled
kernel; top-k sparse attention (a call with ``indices``, which no dense backend takes) on the
sparse backend."""


class BackendChoice(NamedTuple):
    """What [`attnkit.functional.which_backend`][attnkit.functional.which_backend] reports.

    Attributes:
        backend: the name of the backend that runs, a key of [`BACKENDS`][attnkit.backends.BACKENDS].
        path: the code inside it: ``"native"`` (its C++ kernel) or ``"loop"`` (its PyTorch loop)
            for ``tiled``; ``"native"`` for ``decode``; ``"torch"`` for ``sdpa`` (torch's own
            kernel); ``"compiled"`` for ``flex`` (torch's FlexAttention through
            ``torch.compile``); ``"float64"`` for ``reference``.
        reason: why, in a sentence, and what runs where a backend runs torch's code (``flex``).
        products: the dtype of the block products (for tiled's C++ kernel with bf16 products,
            also how: ``"bf16-avx512_bf16"``); None for sdpa and flex, whose kernels torch
            chooses, and for tiled under ``torch.compile``, whose compiled loop inductor chooses.
    """

    backend: str
    path: str
    reason: str
    products: str | None = None


def _why_not(backend: Backend, call: Call) -> str | None:
    """Why ``backend`` cannot run ``call`` (None if it can)."""
    if not call.options <= backend.supports:
        return f"does not support {', '.join(sorted(call.options - backend.supports))}"
    reason = backend.refuses(call)
    return None if reason is None else f"cannot run {reason}"


_WITH_SPEED_RULES = tuple(
    b
    for b in (BACKENDS[name] for name in AUTO_ORDER)
    if type(b).faster_than is not Backend.faster_than
)
"""The backends with a speed rule of their own, in ``auto``'s order."""


_NO_PLAN = object()  # not yet worked out


class _Chosen(NamedTuple):
    backend: Backend
    plan: Any  # its plan of the call, worked out while choosing (None: not yet, or none needed)
    reason: str = ""


def _auto(call: Call, explain: bool = False) -> _Chosen:
    """The backend ``auto`` takes for ``call``, its plan, and with ``explain`` why (else ``""``: a
    call that only runs spends no time on sentences)."""
    chosen, passed, reason = None, [], ""
    used = call.options
    for name in AUTO_ORDER:
        backend = BACKENDS[name]
        if used <= backend.supports and backend.refuses(call) is None:
            chosen = backend
            if explain:
                reason = f"the first backend of {', '.join(AUTO_ORDER)} that runs this call"
            break
        if explain:
            passed.append(f"{name} {_why_not(backend, call)}")
    if chosen is None:  # pragma: no cover - the reference backend runs every call
        raise AssertionError("no backend runs this call")
    later, plan = AUTO_ORDER.index(chosen.name), _NO_PLAN
    for backend in _WITH_SPEED_RULES:  # a later backend takes over where its rule says so
        if AUTO_ORDER.index(backend.name) <= later:
            continue
        if not backend.may_be_faster(call):
            continue
        mine = backend.plan(call)
        faster = backend.faster_than(chosen, call, mine)
        if faster is not None and used <= backend.supports and backend.refuses(call) is None:
            if explain:
                reason = f"faster than {chosen.name} here: {faster}"
            chosen, plan = backend, mine
    if passed:
        reason += "; passed over: " + "; ".join(passed)
    return _Chosen(chosen, chosen.plan(call) if plan is _NO_PLAN else plan, reason)


def _named(name: str, call: Call) -> Backend:
    """The backend called ``name``, if it can run ``call``."""
    if name not in BACKENDS:
        choices = ", ".join(repr(n) for n in ("auto", *BACKENDS))
        raise ValueError(f"unknown backend {name!r}; choose one of {choices}")
    backend = BACKENDS[name]
    missing = call.options - backend.supports
    if missing:
        able = [n for n, b in BACKENDS.items() if call.options <= b.supports]
        raise ValueError(
            f"backend {name!r} does not support {', '.join(sorted(missing))}; "
            f"use backend='auto' or one of {able}"
        )
    reason = backend.refuses(call)
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot run {reason}; use backend='auto'")
    return backend


def choose_backend(name: str, call: Call) -> BackendChoice:
    """The backend that will run ``call``, with its path and why: ``name`` itself, or for
    ``"auto"`` the fastest capable one. Builds, loads and writes nothing.

    Raises:
        ValueError: ``name`` is unknown, or the named backend cannot do an option in use.
    """
    if name == "auto":
        backend, plan, reason = _auto(call, explain=True)
    else:
        backend, plan, reason = _named(name, call), None, "named by the caller"
    runs = getattr(backend, "runs", None)  # a backend that hands the call to torch says to what
    if runs is not None:
        reason += f"; {runs} runs it"
    plan = backend.plan(call) if plan is None else plan
    path, products = backend.path(call) if plan is None else backend.path(call, plan)
    return BackendChoice(backend.name, path, reason, products)


@functools.cache
def memory_of(device: torch.device) -> int:
    """The memory of the machine (or GPU) that holds ``device``'s tensors, in bytes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


SMALL_CALL = 2**22
"""Scores (b * h * t * s) below which no backend's memory is checked: every estimate is a small
multiple of them, far below any machine's memory."""


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def _check_memory(backend: Backend, call: Call) -> None:
    """Refuse, before any work, a call whose results or intermediates alone exceed the memory
    (asked from ``SMALL_CALL`` scores on)."""
    b, h, t, _ = call.q.shape
    need, what = backend.memory(call)
    limit = memory_of(call.q.device)
    if need > limit:
        raise ValueError(
            f"backend {backend.name!r} would need {_size(need)} for {what} of this call "
            f"(b={b}, h={h}, t={t}, s={call.k.shape[2]}), more than the {_size(limit)} of memory "
            "here; ask for fewer results (no weights: return_weights=False, or need_weights=False "
            "in a MultiheadAttention's forward), or use shorter sequences"
        )


def run(name: str, call: Call) -> AttentionOutput:
    """``call`` on the backend ``name`` (or ``"auto"``'s choice). A kernel chosen because it could
    be built, whose build then fails, is not taken again: ``auto`` chooses anew, a named backend
    raises ``ValueError`` saying why."""
    if name == "auto":
        backend, plan, _ = _auto(call)
    else:
        backend = _named(name, call)
        plan = backend.plan(call)
    b, h, t, _ = call.q.shape
    if b * h * t * call.k.shape[2] >= SMALL_CALL:
        _check_memory(backend, call)
    try:
        return _run_on(backend, plan, call)
    except loader.KernelUnavailableError as error:
        if name != "auto":
            raise ValueError(f"{error}; use backend='auto'") from None
    backend, plan, _ = _auto(call)
    return _run_on(backend, plan, call)


def _run_on(backend: Backend, plan: Any, call: Call) -> AttentionOutput:
    """``backend.run``, with the padded keys and values zeroed first where it reads them, and the
    NaN rule's look at q and k made where it keeps the rule by one: the one place for each (ring
    attention zeroes its pieces as they travel; the tiled and decode kernels look at no input)."""
    key_mask = call.masks.key_mask
    if key_mask is not None and backend.reads_padding:
        call = call._replace(k=zero_padding(call.k, key_mask), v=zero_padding(call.v, key_mask))
    mask = call.masks.attn_mask
    biased = call.alibi_slopes is not None or (mask is not None and mask.dtype != torch.bool)
    if backend.looks_at_values and not biased:  # the NaN rule's one look (a bias: the exact path)
        call = call.looked(inputs_finite(call.q, keys=call.k, nonfinite_keys=call.nonfinite_keys))
    return backend.run(call) if plan is None else backend.run(call, plan)


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "AttentionOutput",
    "Backend",
    "BackendChoice",
    "Call",
    "Route",
    "choose_backend",
    "run",
]


def __getattr__(name: str) -> Any:
    """``Path``, the former name of [`Route`][attnkit.backends.base.Route] (beside
    ``pathlib.Path`` it misled), with a deprecation warning."""
    if name == "Path":
        warnings.warn(
            "attnkit.backends.Path is deprecated; use attnkit.backends.Route",
            DeprecationWarning,
            stacklevel=2,
        )
        return Route
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
