"""Inspecting a user's ``score_mod``: whether it adds to the score (and so runs in the C++ kernel,
a tile of its bias at a time), and which tensors it reads that need gradients. Each answer is
found once per function and kept while the function's state is unchanged
([`memo`][attnkit.mods.memo])."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.mods.evaluate import Block, ScoreMod
from attnkit.mods.memo import remembered


def adds_to_score(score_mod: ScoreMod) -> bool:
    """Whether ``score_mod(score, b, h, q_idx, kv_idx)`` is ``score + f(b, h, q_idx, kv_idx)`` (or
    ``score - f``) with ``f`` independent of the score: a relative-position bias, ALiBi, a T5
    bucket table. Such a mod's ``f`` can be evaluated without the scores, a tile at a time, and
    added in the C++ kernel ([`bias`][attnkit.mods.bias]); the sum is the same float32 sum, bit
    for bit.

    Told from the torch operations the mod runs on one score, once while the mod's state is the
    same ([`memo`][attnkit.mods.memo]): the last must be that addition, of the score itself and of a
    tensor computed without it, and none may write into a tensor; then, on a few score values,
    the mod must give exactly ``score + f``. A mod that reads a tensor's value into Python
    (``bool``, ``item``) is not taken, as its operations may differ from block to block; nor is
    ``(score + a) + b``, whose rounding differs from ``score + (a + b)``."""
    return remembered(score_mod, "adds to the score", lambda: _traced_adds(score_mod))


def _traced_adds(score_mod: ScoreMod) -> bool:
    """[`adds_to_score`][attnkit.mods.inspection.adds_to_score], found by running the mod."""
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
    return remembered(
        score_mod, ("tensors", dtype, device), lambda: _captured(score_mod, dtype, device)
    )


def _captured(score_mod: ScoreMod, dtype: torch.dtype, device) -> tuple[Tensor, ...]:
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
