"""The CPU-feature probe (attnkit.kernels.cpu): what it reports, how ATTNKIT_CPU_FEATURES narrows it, and
the C++ builds that follow from it. Nothing here assumes the CPU the tests run on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit.kernels import build as _build
from attnkit.kernels import cpu as _cpu
from attnkit.kernels import loader as _native


def test_the_probe_reports_known_extensions_only():
    assert _cpu.features() <= _cpu.KNOWN
    if "avx512f" in _cpu.features():  # every AVX-512 CPU has AVX2 too
        assert "avx2" in _cpu.features()


@pytest.mark.parametrize("spec", ["avx2", "avx512", "avx512_bf16", "none", "avx2,amx"])
def test_narrowing_never_adds_an_extension(spec, monkeypatch):
    monkeypatch.setenv(_cpu.ENV, spec)
    assert _cpu.features() == _cpu.detected() & _cpu.parse(spec)


def test_levels_expand_and_accumulate():
    assert _cpu.parse("avx2") == {"avx2", "fma", "f16c"}
    assert _cpu.parse("avx512") == _cpu.parse("avx2") | {
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
    }
    assert _cpu.parse("avx512_bf16") == _cpu.parse("avx512") | {"avx512_bf16"}
    assert _cpu.parse("avx2, amx_tile") == _cpu.parse("avx2") | {"amx_tile"}
    assert _cpu.parse("none") == frozenset()


def test_an_unknown_feature_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(_cpu.ENV, "avx2,avx1024")
    with pytest.raises(
        ValueError, match=r"ATTNKIT_CPU_FEATURES='avx2,avx1024': unknown .*'avx1024'"
    ):
        _cpu.features()


def test_avx2_hides_the_half_precision_units(monkeypatch):
    monkeypatch.setenv(_cpu.ENV, "avx2")
    assert not _cpu.fast_half_products(torch.bfloat16)
    assert not _cpu.fast_half_products(torch.float16)
    assert not _cpu.fast_half_products(torch.float32)
    assert _cpu.describe().startswith("-avx2" if "avx2" not in _cpu.features() else "avx2 -avx512f")
    assert "(ATTNKIT_CPU_FEATURES=avx2)" in _cpu.describe()


def test_bf16_products_are_fast_exactly_with_avx512_bf16_or_amx(monkeypatch, every_extension):
    for spec, fast in (("avx512_bf16", True), ("amx_bf16", True), ("avx512", False), ("", True)):
        monkeypatch.setenv(_cpu.ENV, spec)  # "": not narrowed
        assert _cpu.fast_half_products(torch.bfloat16) == fast
    monkeypatch.setenv(_cpu.ENV, "avx512_bf16")
    assert not _cpu.fast_half_products(torch.float16)  # fp16 needs AMX-FP16
    monkeypatch.setenv(_cpu.ENV, "amx")
    assert _cpu.fast_half_products(torch.float16)
    assert _cpu.parse("amx") >= _cpu.parse("avx512_bf16")  # every AMX CPU has AVX512-BF16


@pytest.mark.parametrize(
    "spec, level",
    [
        ("none", "none"),
        ("avx2", "avx2"),
        ("avx512", "avx512"),
        ("avx512_bf16", "avx512_bf16"),
        ("amx", "avx512_bf16"),  # the kernels use no AMX: an AMX CPU runs the avx512_bf16 build
        ("avx2,avx512f", "avx2"),  # a level needs all of its extensions
    ],
)
def test_a_build_is_for_the_highest_level_the_cpu_has(spec, level, monkeypatch, every_extension):
    """A build for one CPU is never loaded on another that lacks an extension it uses: its level is
    in its name, and its flags enable that level's extensions and nothing else."""
    monkeypatch.setenv(_cpu.ENV, spec)
    assert _cpu.build_level() == level
    assert _native.Kernel("tiled").name().startswith(f"attnkit_tiled_{level.replace('_', '')}_")
    flags = _build.command("tiled", level, "x", Path("x.so"))
    isa = {flag for flag in flags if flag.startswith("-mavx") or flag in ("-mfma", "-mf16c")}
    assert isa == {
        flag for flag in _build.LEVELS[level] if flag.startswith("-m") and "=" not in flag
    }
    assert ("-mprefer-vector-width=512" in flags) == ("avx512" in level)
    for extension in ("avx2", "avx512f", "avx512_bf16"):
        if extension not in _cpu.LEVELS[level]:
            assert f"-m{extension.replace('_', '')}" not in flags


def test_builds_for_different_cpus_have_different_names(monkeypatch, every_extension):
    kernel = _native.Kernel("tiled")
    names = set()
    for spec in ("none", "avx2", "avx512", "avx512_bf16"):
        monkeypatch.setenv(_cpu.ENV, spec)
        names.add(kernel.name())
    assert len(names) == 4


def test_the_probe_narrows_what_this_cpu_has(monkeypatch):
    """On the real CPU: the build's extensions are among those the CPU has."""
    assert _cpu.LEVELS[_cpu.build_level()] <= _cpu.features()
    monkeypatch.setenv(_cpu.ENV, "")
    assert _cpu.features() == _cpu.detected()  # blank: not narrowed


AS_AVX2 = """
import json, torch
from attnkit import attention
from attnkit.kernels import cpu as _cpu
from attnkit.backends import decode
from attnkit.tiled import native as tiled_native
from attnkit.tiled import plans as tiled_plans
from attnkit.force import forced
from attnkit.functional import which_backend
from helpers.oracle import naive_attention

torch.manual_seed(0)
q, k, v = (torch.randn(1, 4, 37, 40) for _ in range(3))
report = {"features": sorted(_cpu.features())}
errors = {}
for dtype in (torch.float32, torch.bfloat16):
    x = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
    choice = which_backend(*x, backend="tiled", causal=True)
    report[str(dtype)] = [choice.path, choice.products]
    out = attention(*x, backend="tiled", causal=True)
    x64 = [t.detach().double().requires_grad_() for t in x]
    out64, _, _ = naive_attention(*x64, causal=True)
    grads = torch.autograd.grad(out.float().sum(), x)
    grads64 = torch.autograd.grad(out64.sum(), x64)
    errors[str(dtype)] = max(
        (a.double() - b).abs().max().item() for a, b in zip((out, *grads), (out64, *grads64))
    )
report["half"] = tiled_plans.pair_products(tiled_plans.KERNEL)  # bf16 blocks: none here
x = [t.bfloat16() for t in (q, k, v)]
with forced("tiled:portable"):  # the kernel's portable route for them
    report["forced"] = which_backend(*x, backend="tiled").products
    out64, _, _ = naive_attention(*(t.double() for t in x))
    errors["forced"] = (attention(*x, backend="tiled").double() - out64).abs().max().item()
step = attention(q[:, :, :1], k, v, backend="decode")
step64, _, _ = naive_attention(q[:, :, :1].double(), k.double(), v.double())
errors["decode"] = (step.double() - step64).abs().max().item()
report["builds"] = [tiled_plans.KERNEL.name(), decode.KERNEL.name()]
report["errors"] = errors
print(json.dumps(report))
"""


@pytest.mark.skipif("avx2" not in _cpu.features(), reason="this CPU has no AVX2 to narrow to")
def test_the_suite_can_run_this_cpu_as_an_avx2_one():
    """ATTNKIT_CPU_FEATURES=avx2 in a fresh process: kernels built for AVX2 alone (a second build on
    a CPU with AVX-512), bf16 multiplied in float32, and every path still exact."""
    env = {**os.environ, _cpu.ENV: "avx2"}
    tests = Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-c", AS_AVX2], env=env, cwd=tests, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report["features"]) <= {"avx2", "fma", "f16c"}
    assert report["torch.float32"] == ["native", "float32"]
    assert report["torch.bfloat16"] == ["native", "float32"]  # no bf16 units on an AVX2 CPU
    assert report["half"] is None  # the AVX2 build has no vdpbf16ps: bf16 blocks go to the loop
    assert report["forced"] == "bf16-portable"
    assert all("avx512" not in name for name in report["builds"])
    errors = report["errors"]
    assert errors["torch.float32"] < 1e-5 and errors["decode"] < 1e-5
    assert errors["torch.bfloat16"] < 0.1 and errors["forced"] < 0.05
