"""attnkit.mods: how functions of the user's are compiled for long calls, and what happens where
they cannot be."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from attnkit import functional as F
from attnkit import mods
from attnkit.block_mask import create_block_mask
from attnkit.mods import compiling
from helpers.zoo import (
    SLOPES,
    TABLE,
    ZOO,
    H,
    causal,
    inputs,
    oracle,
    relative_bias,
    torch_block_mask,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


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
    from attnkit.force import forced

    torch._dynamo.reset()  # a first compile: dynamo keeps its graphs per code object, process-wide
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


@pytest.mark.slow
def test_a_mod_that_gathers_a_block_runs_compiled_from_long_calls(monkeypatch):
    from attnkit import mods

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)  # as if the call were long
    table = TABLE.clone().requires_grad_()
    q, k, v = (x.requires_grad_() for x in inputs(1, H, 29, 29))
    block_mask = create_block_mask(causal, 1, H, 29, 29, "cpu", 8)  # per head: the loop's

    def gathers(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 28]

    def computes(score, b, h, q_idx, kv_idx):
        return score - SLOPES[h] * (q_idx - kv_idx).abs()

    torch._dynamo.utils.counters.clear()
    out = F.attention(q, k, v, score_mod=gathers, block_mask=block_mask, backend="tiled")
    grads = torch.autograd.grad(out.sum(), (q, table))
    assert compiling.worth_compiling(gathers) is True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it was compiled
    want = F.attention(q, k, v, score_mod=gathers, block_mask=block_mask, backend="reference")
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, table))):
        torch.testing.assert_close(g, w)
    F.attention(q, k, v, score_mod=computes, block_mask=block_mask, backend="tiled")  # the loop
    assert compiling.worth_compiling(computes) is False  # arithmetic runs faster eager


@pytest.mark.parametrize("path", ["kernel", "loop"])
def test_a_mod_that_cannot_be_compiled_runs_uncompiled_with_a_warning(monkeypatch, path):
    """The C++ kernel compiles the mod's bias; the loop (here given a block mask that masks
    nothing) compiles the mod and its softmax step."""
    from torch.nn.attention.flex_attention import noop_mask

    from attnkit import mods

    def fails(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fails)
    compiling.forget()

    def gathers_too(score, b, h, q_idx, kv_idx):
        return score + TABLE[h, q_idx - kv_idx + 28]

    q, k, v = inputs(1, H, 29, 29)
    options = {"score_mod": gathers_too, "backend": "tiled"}
    if path == "loop":
        options["block_mask"] = create_block_mask(noop_mask, 1, H, 29, 29, "cpu", 8)
    assert F.which_backend(q, k, v, **options).path == {"kernel": "native", "loop": "loop"}[path]
    try:
        with pytest.warns(UserWarning) as warned:  # the loop compiles the mod from its 2nd call
            out = F.attention(q, k, v, **options)
            F.attention(q, k, v, **options)
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            again = F.attention(q, k, v, **options)
    finally:
        compiling.forget()
    said = sorted(str(w.message).split(" (")[0].split(".")[-1] for w in warned)
    if path == "kernel":
        assert said == ["gathers_too could not be compiled"]
    else:
        assert said == [
            "gathers_too could not be compiled",
            "online_softmax_ could not be compiled",
        ]
    assert all("(RuntimeError: no C++ compiler)" in str(w.message) for w in warned)
    torch.testing.assert_close(out, oracle(q, k, v, relative_bias(TABLE))[0].float())
    assert later == []  # once failed, a function runs uncompiled without a word
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "dtype"),
    [("relative bias, document", torch.float32), ("empty rows", torch.float64)],
)
def test_long_calls_run_the_softmax_steps_compiled_with_the_same_results(monkeypatch, case, dtype):
    """From ``COMPILE_FROM`` scores, the loop's softmax steps run compiled; they give what the
    uncompiled steps and the float64 oracle give, forward and backward, with GQA, a NaN value at
    a hidden key (0 * NaN must stay out) and rows a mask empties."""
    from attnkit import mods

    score_mod, mask_mod = ZOO[case]
    table = TABLE.to(dtype).requires_grad_()
    if score_mod is not None:
        score_mod = relative_bias(table)
    q, k, v = inputs(1, 2, 29, 29, dtype=dtype)
    v[0, 0, 20, 3] = math.nan  # key 20: in the third document, hidden from the first two
    block_mask = torch_block_mask(mask_mod, 29, 29, 8)

    def run():
        q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
        out = F.attention(q_, k_, v_, score_mod=score_mod, block_mask=block_mask, backend="tiled")
        finite = ~out.isnan()  # rows that see key 20 are NaN, as the materialised formula says
        loss = out.where(finite, 0.0).sum()
        wrt = (q_, k_, v_, table) if score_mod is not None else (q_, k_, v_)
        return out, torch.autograd.grad(loss, wrt)

    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, **kwargs: compiled.append(fn.__name__) or real_compile(fn, **kwargs),
    )
    compiling.forget()
    uncompiled = run()
    assert compiled == []  # a short call
    monkeypatch.setattr(mods, "COMPILE_FROM", 0)
    try:
        got = run()
    finally:
        compiling.forget()
    assert {"online_softmax_", "softmax_backward_"} <= set(compiled)
    want, _ = oracle(q, k, v.nan_to_num(0.0), score_mod, mask_mod)
    key_20 = torch.zeros_like(v)
    key_20[:, :, 20] = 1.0
    sees_key_20 = oracle(q, k, key_20, score_mod, mask_mod)[0][..., :1] > 0  # its weight
    assert sees_key_20.any() and not sees_key_20.all()
    nan_expected = torch.zeros_like(want, dtype=torch.bool)  # key/value head 0: query heads 0, 1
    nan_expected[:, :2, :, 3] = sees_key_20[:, :2, :, 0]
    assert torch.equal(got[0].isnan(), nan_expected)
    torch.testing.assert_close(got[0].nan_to_num(0.0), want.to(dtype).masked_fill(nan_expected, 0))
    torch.testing.assert_close(got[0], uncompiled[0], equal_nan=True)
    for g, u in zip(got[1], uncompiled[1]):  # NaN only where dP meets the NaN value
        assert not g.isnan().all()
        torch.testing.assert_close(g, u, equal_nan=True)


@pytest.mark.slow
def test_compiled_block_functions_take_every_length_without_recompiling_each(monkeypatch, caplog):
    """Blocks of every size (the last block of each length, a diagonal's) share compiled code
    after a few compilations, rather than running uncompiled once dynamo's recompile limit is
    reached."""
    from attnkit import mods

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)
    compiling.forget()

    def gathers_again(score, b, h, q_idx, kv_idx):
        return score + TABLE[h, q_idx - kv_idx + 28]

    try:
        for n in range(9, 30, 2):
            q, k, v = inputs(1, H, n, n)
            out = F.attention(q, k, v, score_mod=gathers_again, causal=True, backend="tiled")
            want = oracle(q, k, v, relative_bias(TABLE), causal)[0]
            torch.testing.assert_close(out, want.float())
    finally:
        compiling.forget()
    assert "recompile_limit" not in caplog.text
