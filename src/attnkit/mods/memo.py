"""What has been found out about a user's function, kept per function while its state stays the
same, so that a mod is inspected once rather than at every call.

Whether a ``score_mod`` adds to the score, and which tensors it reads that need gradients, are
found by running it ([`inspection`][attnkit.mods.inspection]): several runs on one score, some
hundreds of microseconds, which a decoding step or a small training step would pay at each call.
The answer depends on the function's code and on what it holds: the values of the numbers and
strings in its closure, defaults and bound object, which tensors it holds (by identity, dtype,
shape and device, not by their values, which an optimizer changes at every step) and the same
of the functions it holds. That state is read at each call (a few microseconds); while it is
unchanged, the answer kept is the answer. A function shifted to other positions
([`at_positions`][attnkit.mods.at_positions]) is asked as the function it wraps: adding an offset to
the indices changes neither answer.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""For each function: ``{question: (its state, the answer)}``."""

_DEPTH = 4  # how deep the state is read into what a function holds
_SCALARS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def remembered(fn: Callable, question: Hashable, answer: Callable[[], Any]) -> Any:
    """``answer()``, computed once for ``fn`` and ``question`` while ``fn``'s state is unchanged
    (computed every time for a function whose state cannot be read or kept)."""
    fn = unwrapped(fn)
    owner = fn.__func__ if isinstance(fn, types.MethodType) else fn
    try:
        state = state_of(fn)
        kept = _KEPT.get(owner)
    except TypeError:  # not weakly referable, or a state that cannot be hashed
        return answer()
    if kept is not None and question in kept and kept[question][0] == state:
        return kept[question][1]
    result = answer()
    _KEPT.setdefault(owner, {})[question] = (state, result)
    return result


def unwrapped(fn: Callable) -> Callable:
    """The function a shifted mod wraps ([`at_positions`][attnkit.mods.at_positions]), else ``fn``."""
    while getattr(fn, "__attnkit_shifted__", False):
        fn = fn.__wrapped__
    return fn


def state_of(obj: object, depth: int = 0) -> Hashable:
    """What ``obj``'s answers may depend on, as a hashable value (see the module's docstring)."""
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, Tensor):
        return ("tensor", id(obj), obj.dtype, tuple(obj.shape), obj.device, obj.requires_grad)
    if depth > _DEPTH:
        return ("object", id(obj))
    deeper = functools.partial(state_of, depth=depth + 1)
    if isinstance(obj, types.FunctionType):
        cells = tuple(deeper(cell.cell_contents) for cell in obj.__closure__ or ())
        defaults = tuple(map(deeper, obj.__defaults__ or ()))
        named = tuple(
            (name, deeper(obj.__globals__[name]))
            for name in obj.__code__.co_names
            if name in obj.__globals__ and not isinstance(obj.__globals__[name], types.ModuleType)
        )
        kwdefaults = tuple(sorted((k, deeper(v)) for k, v in (obj.__kwdefaults__ or {}).items()))
        return ("function", obj.__code__, cells, defaults, kwdefaults, named)
    if isinstance(obj, types.MethodType):
        return ("method", deeper(obj.__func__), deeper(obj.__self__))
    if isinstance(obj, functools.partial):
        keywords = tuple(sorted((k, deeper(v)) for k, v in obj.keywords.items()))
        return ("partial", deeper(obj.func), tuple(map(deeper, obj.args)), keywords)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(map(deeper, obj)))
    if isinstance(obj, dict):
        return ("dict", tuple((k, deeper(v)) for k, v in obj.items()))
    if isinstance(obj, (type, types.BuiltinFunctionType, types.ModuleType)):
        return ("object", id(obj))
    if isinstance(obj, torch.nn.Module):  # its own parameters and buffers, and plain attributes
        own = dict((*obj.named_parameters(recurse=False), *obj.named_buffers(recurse=False)))
        plain = {k: v for k, v in vars(obj).items() if isinstance(v, (*_SCALARS, Tensor))}
        return ("module", id(obj), deeper(own), deeper(plain), obj.training)
    attributes = getattr(obj, "__dict__", None)
    return ("object", id(obj), type(obj), None if attributes is None else deeper(attributes))
