"""What has been found out about a user's function, kept per function while its state stays the
same, so that a mod is inspected once rather than at every call.

Whether a ``score_mod`` adds to the score, and which tensors it reads that need gradients, are
found by running it ([`inspection`][attnkit.mods.inspection]): several runs on one score, some
hundreds of microseconds, which a decoding step or a small training step would pay at each call.
The answer depends on the function's code and on what it holds: the values of the numbers and
strings in its closure, defaults and bound object, which tensors it holds (by identity, dtype,
shape and device, not by their values, which an optimizer changes at every step) and the same
of the functions it holds; the attributes it names of a module it imports (``config.scale``);
the children of a ``torch.nn.Module`` it is bound to and the numbers and strings of an object's
class. The state is read a few levels deep (four), as far as a mod's own state usually goes. That state is read at each call (a few microseconds); while it is
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
    owner = fn
    if isinstance(fn, types.MethodType):  # a new object at each lookup: kept by its instance
        owner, question = fn.__self__, (fn.__func__, question)
    try:
        state = state_of(fn)
        kept = _KEPT.get(owner)
    except (TypeError, ValueError):  # not weakly referable, a state that cannot be hashed or read
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
        names = obj.__code__.co_names
        named = tuple(
            (name, _global(obj.__globals__[name], names, deeper))
            for name in names
            if name in obj.__globals__
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
    if isinstance(obj, torch.nn.Module):  # its parameters, buffers, plain attributes, children
        own = dict((*obj.named_parameters(recurse=False), *obj.named_buffers(recurse=False)))
        plain = {k: v for k, v in vars(obj).items() if isinstance(v, (*_SCALARS, Tensor))}
        children = dict(obj.named_children())
        return ("module", id(obj), deeper(own), deeper(plain), deeper(children), obj.training)
    attributes = getattr(obj, "__dict__", None)
    own = None if attributes is None else deeper(attributes)
    return ("object", id(obj), type(obj), own, _class_state(type(obj)))


def _global(value: object, names: tuple[str, ...], deeper: Callable) -> Hashable:
    """A global a function names; for an imported module, the values of the names the function
    also uses that are attributes of it (``config.scale``), numbers, strings or tensors."""
    if not isinstance(value, types.ModuleType):
        return deeper(value)
    plain = []
    for name in names:
        attribute = getattr(value, name, None)
        if isinstance(attribute, (*_SCALARS, Tensor)):
            plain.append((name, deeper(attribute)))
    return ("module", value.__name__, tuple(plain))


def _class_state(cls: type) -> Hashable:
    """The numbers and strings a class holds (class attributes an instance's method may read)."""
    return tuple(
        (k, v) for k, v in vars(cls).items() if isinstance(v, _SCALARS) and not k.startswith("__")
    )
