"""Compiling a user's functions for the blocks of long calls, where that pays: once, under a lock,
with one short warning where it cannot be done."""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit import _warn
from attnkit._tracing import traced


def name_of(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


COMPILE_FROM = 1024 * 1024
"""The fewest scores (``t * s``) from which a call evaluates its mods compiled, where
[`compile_block`][attnkit.mods.compile_block] can: below it, compiling costs more than it saves."""

_WORTH_COMPILING: dict = {}  # code object -> whether it gathers a block


def compile_block(fn: Callable) -> Callable:
    """``fn`` for the blocks of a long call: compiled by ``torch.compile`` (inductor) where that
    pays, else ``fn`` itself.

    Why: a mod that indexes a table with the block's indices (``bias[h, q_idx - kv_idx]``) runs
    through torch's general advanced indexing in eager mode, several nanoseconds per score and
    more for its gradient; compiled, the gather, the add and their backward become one loop, several
    times faster (docs/bench/choices.md). Other mods (ALiBi's arithmetic, a document mask's
    lookups of a row and a column) ran slower compiled than eager, so the first call of a function
    watches which operations it runs, and only one that gathers a block-sized tensor is compiled.
    Not inside ``torch.compile`` already, nor with ``ATTNKIT_COMPILE=0``; a function whose
    compilation fails runs uncompiled from then on, with a warning. torch caches the compiled
    code per code object: a new closure of the same function over other tensors reuses it, one
    over other Python numbers compiles again.
    """
    code = getattr(fn, "__code__", None)
    if traced() or os.environ.get("ATTNKIT_COMPILE", "1") == "0" or code is None:
        return fn
    return _block_function(fn)


@functools.lru_cache(maxsize=16)
def _block_function(fn: Callable) -> Callable:
    """What [`compile_block`][attnkit.mods.compile_block] returns for ``fn``, made once per
    function rather than once per block."""
    code = getattr(inspect.unwrap(fn), "__code__", fn.__code__)  # a wrapper's decision: its mod's
    compiled = compiled_or_eager(fn)

    def run(*args):
        if code not in _WORTH_COMPILING:
            with _LOCK:  # one thread watches the first call; the others wait for its decision
                if code not in _WORTH_COMPILING:
                    result, _WORTH_COMPILING[code] = _gathers_a_block(fn, args)
                    if not _WORTH_COMPILING[code]:
                        return result
        return compiled(*args) if _WORTH_COMPILING[code] else fn(*args)

    return run


def compiled_or_eager(fn: Callable, *, dynamic: bool | None = True) -> Callable:
    """``fn`` compiled by ``torch.compile`` (inductor) on its first call, for the blocks of long
    calls; ``fn`` itself inside ``torch.compile`` already or with ``ATTNKIT_COMPILE=0``. By
    default with dynamic shapes from the first call: the blocks of every length share one code,
    so a block gives the same result in every call (a static graph for the first shape, then a
    dynamic one, would round a first call's blocks apart from later calls'), and one thread at
    a time runs it (the first compiles, the others then run the same code). If
    compiling fails (no C++ compiler, an operation inductor cannot lower), ``fn`` runs uncompiled
    from then on, after one warning that names it and the error."""
    if traced() or os.environ.get("ATTNKIT_COMPILE", "1") == "0":
        return fn
    return _compiled(fn, dynamic)


_NO_COMPILER: list[str] = []  # inductor's error, once it found no C++ compiler in this process

# Threads that call one function compiled together: one compiles while the others wait, then all
# run the same code (and get the same results); re-entrant, as a mod may call attention itself.
_LOCK = threading.RLock()


@functools.lru_cache(maxsize=32)
def _compiled(fn: Callable, dynamic: bool | None) -> Callable:
    compiled = None  # made on first use: torch.compile's first call imports dynamo (a second)
    failed = False

    def run(*args):
        nonlocal compiled, failed
        if failed or _NO_COMPILER:
            return fn(*args)
        try:
            with _LOCK:  # dynamo compiles and recompiles one call at a time
                compiled = compiled or torch.compile(fn, dynamic=dynamic)
                return compiled(*args)
        except Exception as error:  # the fallback: eager, which raises the function's own errors
            failed = True
            result = fn(*args)
            cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            if "InvalidCxxCompiler" in cause:  # no function compiles here: say so once
                _NO_COMPILER.append(cause)
                _warn.warn(f"torch.compile needs a C++ compiler ({cause}); attnkit runs uncompiled")
            else:
                _warn.warn(f"{name_of(fn)} could not be compiled ({cause}); it runs uncompiled")
            return result

    return run


_GATHERS = {"aten::index", "aten::gather", "aten::index_select", "aten::take"}


def _gathers_a_block(fn: Callable, args: tuple) -> tuple[Tensor, bool]:
    """``fn(*args)``, and whether it gathered a tensor of at least half the block's size."""
    from torch.utils._python_dispatch import TorchDispatchMode

    size = math.prod(torch.broadcast_shapes(*(x.shape for x in args))) // 2  # half the block

    class Watch(TorchDispatchMode):
        gathered = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._schema.name in _GATHERS and isinstance(out, Tensor):
                Watch.gathered |= out.numel() >= size
            return out

    with Watch():
        result = fn(*args)
    return result, Watch.gathered


def worth_compiling(fn: Callable) -> bool | None:
    """What the first call of [`compile_block`][attnkit.mods.compile_block]'s ``fn`` decided:
    whether it gathers a block (and so runs compiled); None before its first call."""
    return _WORTH_COMPILING.get(getattr(inspect.unwrap(fn), "__code__", None))


def forget() -> None:
    """Forget every compiled function and every decision made here: the next calls compile and
    decide anew (after a change of what a function reads, and between tests)."""
    with _LOCK:
        _block_function.cache_clear()
        _compiled.cache_clear()
        _WORTH_COMPILING.clear()
        _NO_COMPILER.clear()
