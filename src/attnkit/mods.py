"""User-written score and mask functions, as torch's FlexAttention defines them.

- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: changes a score (after ``scale``, ``softcap``
  and ALiBi); returning ``-inf`` masks the key.
- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where query ``q_idx`` may see key ``kv_idx``.

torch evaluates them one score at a time under ``vmap``. attnkit evaluates them once per block, on
index tensors that broadcast against the block: ``b`` ``(B, 1, 1, 1)``, ``h`` ``(1, H, 1, 1)``,
``q_idx`` ``(1, 1, bq, 1)`` and ``kv_idx`` ``(1, 1, 1, bk)``, all int64. A function written with
elementwise tensor operations and indexing (``bias[h, q_idx - kv_idx]``,
``doc[q_idx] == doc[kv_idx]``, ``torch.where``) gives the same values either way, in one pass over
the block. A function that broadcasting does not fit (one that raises on the block's shapes, or
returns anything but a 4-D tensor that broadcasts to the block, as a reduction over a dim would) is
evaluated under nested ``torch.vmap`` instead, one score at a time as torch does, more slowly.

Errors name the function and the block: a function that raises, a ``mask_mod`` whose result is not
bool, a ``score_mod`` that changes the block's shape or dtype.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import types
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import noop_mask

from attnkit import _warn

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class Block(NamedTuple):
    """The broadcast indices of one block: batches ``b``, heads ``h``, rows ``q``, keys ``kv``."""

    b: Tensor
    h: Tensor
    q: Tensor
    kv: Tensor

    @staticmethod
    def of(batches: range, heads: range, rows: range, keys: range, device=None) -> Block:
        def index(r: range, dim: int) -> Tensor:
            shape = [1, 1, 1, 1]
            shape[dim] = len(r)
            return torch.arange(r.start, r.stop, device=device).view(shape)

        return Block(index(batches, 0), index(heads, 1), index(rows, 2), index(keys, 3))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.b.numel(), self.h.numel(), self.q.numel(), self.kv.numel())

    def where(self) -> str:
        q, kv = self.q.view(-1), self.kv.view(-1)
        return (
            f"the block of queries {int(q[0])}..{int(q[-1])} and keys {int(kv[0])}..{int(kv[-1])}"
        )


def name_of(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def mask(mask_mod: MaskMod, at: Block, *, compiled: bool = False) -> Tensor:
    """``mask_mod`` over a block: a bool tensor broadcastable to ``at.shape``. ``compiled``:
    through [`compile_block`][attnkit.mods.compile_block]."""
    if mask_mod is noop_mask:  # torch's "no mask", a 0-d True
        return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=at.q.device)
    try:
        allowed = (compile_block(mask_mod) if compiled else mask_mod)(*at)
        _elementwise(allowed, at.shape)
    except Exception as error:
        allowed = _by_vmap("mask_mod", mask_mod, at, None, error)
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
        raise TypeError(
            f"mask_mod {name_of(mask_mod)} returned {got} for {at.where()}; it must return a "
            "bool tensor (True = may attend)"
        )
    return allowed


def score(
    score_mod: ScoreMod,
    scores: Tensor,
    at: Block,
    *,
    compiled: bool = False,
    also: torch.dtype | None = None,
) -> Tensor:
    """``score_mod`` over a block of ``scores`` of shape ``at.shape``: the modified scores, of the
    same shape and dtype. ``compiled``: through [`compile_block`][attnkit.mods.compile_block].
    ``also``: a dtype accepted too and cast to the scores' (the reference backend computes in
    float64 the scores a mod's float32 tensors expect)."""
    try:
        out = (compile_block(score_mod) if compiled else score_mod)(scores, *at)
        _elementwise(out, scores.shape)
        if out.shape != scores.shape:  # a function of fewer dims: a block of its own, writable
            out = out.expand(scores.shape).contiguous()
    except Exception as error:
        out = _by_vmap("score_mod", score_mod, at, scores, error)
    if out.shape != scores.shape:
        raise ValueError(
            f"score_mod {name_of(score_mod)} changed the shape of {at.where()} from "
            f"{tuple(scores.shape)} to {tuple(out.shape)}"
        )
    if out.dtype == also:
        out = out.to(scores.dtype)
    if out.dtype != scores.dtype:
        raise TypeError(
            f"score_mod {name_of(score_mod)} returned {out.dtype} for {at.where()}, not the "
            f"scores' {scores.dtype}"
        )
    return out


def adds_to_score(score_mod: ScoreMod) -> bool:
    """Whether ``score_mod(score, b, h, q_idx, kv_idx)`` is ``score + f(b, h, q_idx, kv_idx)`` (or
    ``score - f``) with ``f`` independent of the score: a relative-position bias, ALiBi, a T5
    bucket table. Such a mod's ``f`` can be evaluated without the scores, a tile at a time, and
    added in the C++ kernel ([`bias`][attnkit.mods.bias]); the sum is the same float32 sum, bit
    for bit.

    Told from the torch operations the mod runs on one score, at each call (a mod's Python state
    may change between calls): the last must be that addition, of the score itself and of a
    tensor computed without it, and none may write into a tensor; then, on a few score values,
    the mod must give exactly ``score + f``. A mod that reads a tensor's value into Python
    (``bool``, ``item``) is not taken, as its operations may differ from block to block; nor is
    ``(score + a) + b``, whose rounding differs from ``score + (a + b)``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    at = Block.of(range(1), range(1), range(1), range(1))  # indices every call has
    score = torch.zeros((1, 1, 1, 1))
    from_score = {id(score)}  # the tensors computed from the score
    made_by: dict[int, tuple] = {}  # id of a result -> (operation, its arguments)
    alive = [score]  # no id is reused while the trace runs
    refused = False  # an operation that writes into a tensor, or reads one into Python

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal refused
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            refused |= func in _TO_PYTHON or func._schema.is_mutable
            inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, Tensor)]
            outputs = [x for x in tree_leaves(out) if isinstance(x, Tensor)]
            alive.extend(outputs)
            for x in outputs:
                made_by[id(x)] = (func, args, kwargs)
                if any(id(y) in from_score for y in inputs):
                    from_score.add(id(x))
            return out

    try:
        with torch.no_grad():
            with Trace():
                out = score_mod(score, *at)
            f = score_mod(torch.zeros((1, 1, 1, 1)), *at)
            probes = [torch.full((1, 1, 1, 1), x) for x in _PROBES]
            agree = all(torch.equal(score_mod(p.clone(), *at), p + f) for p in probes)
    except Exception:  # the general path will say what is wrong
        return False
    if refused or not agree or not isinstance(out, Tensor) or out.shape != score.shape:
        return False
    if out.dtype != score.dtype or id(out) not in made_by:
        return False
    func, args, kwargs = made_by[id(out)]
    if func not in _ADDITIONS or kwargs.get("alpha", 1) != 1 or len(args) != 2:
        return False
    first, second = args
    if func is torch.ops.aten.add.Tensor and second is score:
        first, second = second, first
    return first is score and not (isinstance(second, Tensor) and id(second) in from_score)


_ADDITIONS = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)
_TO_PYTHON = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
_PROBES = (1.5, -3.25, 7e5)  # scores on which the mod must give score + f exactly


def bias(score_mod: ScoreMod, at: Block, *, compiled: bool = False) -> Tensor:
    """The ``f`` of a mod that [adds to the score][attnkit.mods.adds_to_score] over a block:
    ``score_mod(0, b, h, q_idx, kv_idx)``, float32, of a shape that broadcasts to ``at.shape``.
    ``compiled``: through ``torch.compile`` ([`compiled_or_eager`][attnkit.mods.compiled_or_eager]),
    which makes it one pass that writes the block."""
    zero = torch.zeros((1, 1, 1, 1), device=at.q.device)
    try:
        f = (compiled_or_eager(score_mod) if compiled else score_mod)(zero, *at)
        _elementwise(f, at.shape)
    except Exception:  # one score at a time, or the general path's error naming mod and block
        f = score(score_mod, zero.expand(at.shape), at)
    return f


def bias_grads(
    score_mod: ScoreMod,
    at: Block,
    dbias: Tensor,
    tensors: tuple[Tensor, ...],
    *,
    compiled: bool = False,
) -> tuple[Tensor | None, ...]:
    """The gradients of ``tensors`` (those the mod reads) from ``dbias``, the loss's gradient with
    respect to the mod's [`bias`][attnkit.mods.bias] over the block ``at``; None for one that
    ``f`` does not read."""
    with torch.enable_grad():
        f = bias(score_mod, at, compiled=compiled)
    if not f.requires_grad:
        return (None,) * len(tensors)
    return torch.autograd.grad(f, tensors, dbias.sum_to_size(f.shape), allow_unused=True)


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
    if (
        torch.compiler.is_compiling()
        or os.environ.get("ATTNKIT_COMPILE", "1") == "0"
        or code is None
    ):
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
            result, _WORTH_COMPILING[code] = _gathers_a_block(fn, args)
            return result
        return compiled(*args) if _WORTH_COMPILING[code] else fn(*args)

    return run


def compiled_or_eager(fn: Callable, *, dynamic: bool | None = None) -> Callable:
    """``fn`` compiled by ``torch.compile`` (inductor) on its first call, for the blocks of long
    calls; ``fn`` itself inside ``torch.compile`` already or with ``ATTNKIT_COMPILE=0``. By
    default, the first block's shape is compiled as static and the next other shape as dynamic,
    so the blocks of every length share code instead of reaching dynamo's recompile limit. If
    compiling fails (no C++ compiler, an operation inductor cannot lower), ``fn`` runs uncompiled
    from then on, after one warning that names it and the error."""
    if torch.compiler.is_compiling() or os.environ.get("ATTNKIT_COMPILE", "1") == "0":
        return fn
    return _compiled(fn, dynamic)


_NO_COMPILER: list[str] = []  # inductor's error, once it found no C++ compiler in this process


@functools.lru_cache(maxsize=32)
def _compiled(fn: Callable, dynamic: bool | None) -> Callable:
    compiled = None  # made on first use: torch.compile's first call imports dynamo (a second)
    failed = False

    def run(*args):
        nonlocal compiled, failed
        if failed or _NO_COMPILER:
            return fn(*args)
        try:
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


def _elementwise(result: Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless ``result`` is what an elementwise function of the block's four broadcast
    indices gives: a 4-D tensor that broadcasts to the block. Anything else (a reduction over a
    dim, say) means something else one score at a time, so it runs under ``vmap``."""
    if not isinstance(result, Tensor) or result.dim() != 4:
        raise TypeError("not a 4-D tensor")
    torch.broadcast_shapes(result.shape, shape)


def _by_vmap(kind: str, mod: Callable, at: Block, scores: Tensor | None, first: Exception):
    """``mod`` of one score at a time, mapped over the block's four index dims with ``torch.vmap``
    (innermost keys, outermost batches), as torch's FlexAttention evaluates mods."""
    lead = () if scores is None else (0,)
    fn = mod
    for dim in reversed(range(4)):
        fn = torch.vmap(fn, in_dims=(*lead, *(0 if i == dim else None for i in range(4))))
    indices = [x.reshape(-1) for x in at]
    try:
        out = fn(*indices) if scores is None else fn(scores, *indices)
    except Exception as error:
        kind_of = (
            type(error) if type(error) in (TypeError, ValueError, IndexError) else RuntimeError
        )
        raise kind_of(f"{kind} {name_of(mod)} failed on {at.where()}: {error}") from first
    return out


def tensors_to_train(score_mod: ScoreMod | None, q: Tensor) -> tuple[Tensor, ...]:
    """The tensors ``score_mod`` reads that need gradients in a call on ``q`` (none without a mod
    or without grad mode)."""
    if score_mod is None or not torch.is_grad_enabled():
        return ()
    return captured_tensors(score_mod, torch.promote_types(q.dtype, torch.float32), q.device)


def captured_tensors(score_mod: ScoreMod, dtype: torch.dtype, device) -> tuple[Tensor, ...]:
    """The tensors that require grad which ``score_mod`` reads: those it passes to a torch function
    when it runs on one score (a closure's, a default's, a global's, an attribute of the object or
    module it is bound to, ...), and those its closure, defaults and bound module hold. Gradients
    reach them through attnkit's kernels, as torch's FlexAttention lets them reach the tensors a
    mod captures."""
    found = {id(x): x for x in _held_tensors(score_mod)}
    for x in _read_tensors(score_mod, dtype, device):
        found.setdefault(id(x), x)
    return tuple(found.values())


def _read_tensors(score_mod: ScoreMod, dtype: torch.dtype, device) -> list[Tensor]:
    """The tensors requiring grad that ``score_mod`` passes to torch functions on one score,
    leaving out those it makes itself (nothing if it raises there: then only what it holds)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    read: dict[int, Tensor] = {}
    made: set[int] = set()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for x in tree_leaves((args, kwargs or {})):
                if isinstance(x, Tensor) and x.requires_grad and id(x) not in made:
                    read.setdefault(id(x), x)
            out = func(*args, **(kwargs or {}))
            made.update(id(x) for x in tree_leaves(out) if isinstance(x, Tensor))
            return out

    at = Block.of(range(1), range(1), range(1), range(1), device)
    score = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)
    try:
        with torch.enable_grad(), Record():
            score_mod(score, *at)
    except Exception:
        return []
    return list(read.values())


def _held_tensors(fn: Callable) -> list[Tensor]:
    """The tensors requiring grad in ``fn``'s closure, defaults, named globals, bound object
    (not a module: a model's every parameter), or a ``functools.partial``'s arguments,
    recursively."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            return  # a model's every parameter is too many: _read_tensors finds those it reads
        elif isinstance(obj, functools.partial):
            for x in (obj.func, *obj.args, *obj.keywords.values()):
                visit(x, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, depth + 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, depth + 1)
            for x in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
                visit(x, depth + 1)
            for name in obj.__code__.co_names:
                if name in obj.__globals__:
                    value = obj.__globals__[name]
                    if isinstance(value, (Tensor, torch.nn.Module, types.FunctionType)):
                        visit(value, depth + 1)
        elif not isinstance(obj, (type, str, bytes, int, float, bool)) and obj is not None:
            visit(getattr(obj, "__dict__", {}), depth + 1)  # an object's attributes

    visit(fn, 0)
    return list(found.values())


def at_positions(given: dict, q_offset: int, kv_offset: int) -> dict:
    """``given``'s ``score_mod`` and ``mask_mod`` seeing ``q_idx + q_offset`` and
    ``kv_idx + kv_offset``: the positions in the sequence of a chunk's queries and of the keys a
    KV cache holds. Other entries pass through."""
    score_mod, mask_mod = given.get("score_mod"), given.get("mask_mod")
    if (q_offset == 0 and kv_offset == 0) or (score_mod is None and mask_mod is None):
        return given
    shifted = dict(given)
    # 0-d tensors, not ints: torch.compile takes them as inputs rather than compiling anew for
    # each offset (a cache's every position, a ring's every pair of chunks)
    q_offset, kv_offset = torch.tensor(q_offset), torch.tensor(kv_offset)
    if score_mod is not None:

        def score_at(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx + q_offset, kv_idx + kv_offset)

        score_at.__qualname__ = name_of(score_mod)
        score_at.__wrapped__ = score_mod
        shifted["score_mod"] = score_at
    if mask_mod is not None:

        def mask_at(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + q_offset, kv_idx + kv_offset)

        mask_at.__qualname__ = name_of(mask_mod)
        mask_at.__wrapped__ = mask_mod
        shifted["mask_mod"] = mask_at
    return shifted
