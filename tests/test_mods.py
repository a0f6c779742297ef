"""attnkit.mods: how functions of the user's are compiled for long calls, and what happens where
they cannot be."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnkit import mods
from attnkit.mods import compiling


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
    compiling.forget()

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
        compiling.forget()
    assert asked == [double]
    (warning,) = warned
    message = str(warning.message)
    assert message.startswith("torch.compile needs a C++ compiler (InductorError: InvalidCxx")
    assert "TORCHDYNAMO_VERBOSE" not in message and message.endswith("attnkit runs uncompiled")
    assert warning.filename == __file__  # it points at the caller's line, not into attnkit


def test_threads_making_a_mods_first_call_together_compile_it_once_and_agree(monkeypatch):
    """One thread compiles while the others wait, and every call, the first included, runs the
    compiled code: the results are equal bit for bit (eager and compiled code round apart)."""
    import threading

    from attnkit import functional as F
    from attnkit.backends.force import forced

    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: compiled.append(fn) or real_compile(fn, **kw)
    )
    monkeypatch.setattr(mods, "COMPILE_FROM", 0)  # compile even these small calls
    compiling.forget()
    table = torch.randn(2, 64)

    def relative(score, b, h, q_idx, kv_idx):
        return score * 0.5 + table[h, q_idx - kv_idx + 31]  # gathers: worth compiling

    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    start, results = threading.Barrier(4), [None] * 4

    def call(i):
        start.wait()
        results[i] = F.attention(q, k, v, score_mod=relative, backend="tiled")

    try:
        with forced("tiled:loop"):
            threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            later = F.attention(q, k, v, score_mod=relative, backend="tiled")
    finally:
        compiling.forget()
    assert compiled.count(relative) == 1
    assert all(torch.equal(r, later) for r in results)
