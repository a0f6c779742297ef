"""attnkit.mods: how functions of the user's are compiled for long calls, and what happens where
they cannot be."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnkit import mods


class InductorError(Exception):
    """Stands in for torch._inductor's error type, which attnkit reads by name only."""


def test_without_a_compiler_torch_compile_is_given_up_once_with_one_short_warning(monkeypatch):
    def fails(*args):
        raise InductorError(
            "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: "
            "(None, 'g++')\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace"
        )

    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: asked.append(fn) or fails)
    monkeypatch.setattr(mods, "_NO_COMPILER", [])
    mods._compiled.cache_clear()

    def double(x):
        return 2 * x

    def square(x):
        return x * x

    x = torch.arange(4.0)
    try:
        with pytest.warns(UserWarning) as warned:
            assert torch.equal(mods.compiled_or_eager(double)(x), 2 * x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second function: no second try, no second word
            assert torch.equal(mods.compiled_or_eager(square)(x), x * x)
            assert torch.equal(mods.compiled_or_eager(double)(x), 2 * x)
    finally:
        mods._compiled.cache_clear()
    assert asked == [double]
    (warning,) = warned
    message = str(warning.message)
    assert message.startswith("torch.compile needs a C++ compiler (InductorError: InvalidCxx")
    assert "TORCHDYNAMO_VERBOSE" not in message and message.endswith("attnkit runs uncompiled")
    assert warning.filename == __file__  # it points at the caller's line, not into attnkit
