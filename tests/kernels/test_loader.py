"""The kernels as the backends load them (attnkit.kernels.loader): a wheel's prebuilt builds, the
extensions folder, read-only folders, failed builds, and builds killed halfway.

The tests marked ``build`` (``make test-build``) compile from scratch or make a wheel: a few
minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from attnkit.kernels import build as _build
from attnkit.kernels import cpu as _cpu
from attnkit.kernels import loader as _native

ROOT = Path(__file__).parents[2]

FIRST_CALLS = """
import json, sys, torch
import attnkit
from attnkit.backends import decode
from attnkit.tiled import native as tiled_native
from attnkit.tiled import plans as tiled_plans
from attnkit.functional import attention, which_backend

q = torch.randn(1, 4, 40, 32, dtype=torch.bfloat16)
kv = torch.randn(1, 2, 40, 32, dtype=torch.bfloat16)
windowed = which_backend(q, kv, kv, backend="tiled", window=(7, 0))
attention(q, kv, kv, backend="tiled", window=(7, 0))
step = which_backend(q[:, :, :1].float(), kv.float(), kv.float())
attention(q[:, :, :1].float(), kv.float(), kv.float())
print(json.dumps({
    "windowed": windowed.path,
    "step": [step.backend, step.path],
    "origins": [tiled_plans.KERNEL.origin, decode.KERNEL.origin],
    "attnkit": attnkit.__file__,
}))
"""


def run_first_calls(env: dict, cwd: Path | None = None) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-c", FIRST_CALLS], env=env, capture_output=True, text=True, cwd=cwd
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder below ``folder`` with its size and modification time."""
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in [folder, *folder.rglob("*")]
    }


@pytest.fixture
def manifest(tmp_path, monkeypatch):
    """A stand-in wheel folder: a manifest for this torch naming a build of each kernel at every
    level (empty files: these tests choose builds, they load none)."""
    folder = tmp_path / "_prebuilt"
    folder.mkdir()
    kernels = {
        kernel: {level: f"attnkit_{kernel}_{level.replace('_', '')}.so" for level in levels}
        for kernel in _build.KERNELS
        for levels in [_build.WHEEL_LEVELS]
    }
    record = {**_build.torch_build_id(), "kernels": kernels}
    (folder / _build.MANIFEST).write_text(json.dumps(record))
    monkeypatch.setattr(_native, "PREBUILT", folder)
    _native._warned_versions.clear()
    yield record
    _native._warned_versions.clear()


@pytest.mark.parametrize(
    "spec, level",
    [
        ("amx", "avx512_bf16"),
        ("avx512_bf16", "avx512_bf16"),
        ("avx512", "avx512"),
        ("avx2", "avx2"),
        ("avx2,avx512f", "avx2"),
        ("none", None),  # below AVX2 a wheel has nothing: a build at run time, or PyTorch
    ],
)
def test_a_wheel_loads_the_highest_level_the_cpu_has(spec, level, manifest, monkeypatch):
    """Narrowed to each level (on the real CPU, which may have less: never a level it lacks)."""
    monkeypatch.setenv(_cpu.ENV, spec)
    chosen = _native.Kernel("tiled").prebuilt()
    if level is None or not _cpu.LEVELS[level] <= _cpu.features():
        level = next(
            (lv for lv in reversed(_build.WHEEL_LEVELS) if _cpu.LEVELS[lv] <= _cpu.features()),
            None,
        )
    if level is None:
        assert chosen is None
    else:
        assert chosen == _native.PREBUILT / f"attnkit_tiled_{level.replace('_', '')}.so"
        assert _native.Kernel("tiled").level() == level
        assert _cpu.LEVELS[level] <= _cpu.features()


def test_a_wheel_missing_a_level_takes_the_next_one_down(manifest, monkeypatch, every_extension):
    del manifest["kernels"]["decode"]["avx512_bf16"]
    (_native.PREBUILT / _build.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv(_cpu.ENV, "amx")
    assert _native.Kernel("decode").prebuilt().name == "attnkit_decode_avx512.so"
    assert _native.Kernel("tiled").prebuilt().name == "attnkit_tiled_avx512bf16.so"


@pytest.mark.parametrize("differs", ["torch", "cxx11_abi"])
def test_a_wheel_for_another_torch_is_ignored_with_one_warning(differs, manifest):
    theirs = {"torch": "2.5", "cxx11_abi": not manifest["cxx11_abi"]}[differs]
    manifest[differs] = theirs
    (_native.PREBUILT / _build.MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(UserWarning) as warned:
        assert _native.Kernel("tiled").prebuilt() is None
        assert _native.Kernel("decode").prebuilt() is None
    assert len(warned) == 1
    message = str(warned[0].message)
    mine = _build.torch_build_id()
    assert f"built for torch {manifest['torch']}" in message
    assert f"this is torch {mine['torch']}" in message
    assert "they are ignored" in message and "attnkit build" in message
    assert Path(warned[0].filename).name == Path(__file__).name  # the warning points here


def test_a_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'decode.cpp:3:1: error: expected declaration'\nexit 1\n")
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(failing))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    kernel = _native.Kernel("decode")
    with pytest.warns(UserWarning) as warned:
        assert kernel.load() is None
    assert len(warned) == 1
    message = str(warned[0].message)
    assert message.startswith("the C++ kernel decode.cpp is unavailable: ")
    assert "decode.cpp:3:1: error: expected declaration" in message
    assert message.endswith("attnkit uses PyTorch operations instead")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.load() is None and kernel.available() == (False, kernel._failure)
        with pytest.raises(_native.KernelUnavailableError, match="the step is unavailable: the C"):
            kernel.require("the step")


def test_a_kernel_is_at_hand_only_where_loading_it_builds_nothing(tmp_path, monkeypatch):
    """at_hand: a build in the extensions folder, or the kernel loaded; not a compiler alone
    (a helper that asks it never starts a build), nor after a failed build."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(_native, "PREBUILT", tmp_path / "no-wheel")
    kernel = _native.Kernel("tiled")
    assert kernel.usable()[0] == (_build.compiler() is not None) and not kernel.at_hand()
    assert kernel.load_at_hand() is None
    assert not (tmp_path / "empty").exists()  # asking built and wrote nothing
    monkeypatch.undo()  # the usual extensions folder and wheel
    assert _native.Kernel("tiled").at_hand() == (
        _native.Kernel("tiled").prebuilt() is not None or _native.Kernel("tiled").cached().exists()
    )
    loaded = _native.KERNELS["tiled"]
    assert loaded.at_hand() == (loaded.load() is not None)
    assert loaded.load_at_hand() is loaded.load()
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    assert not _native.Kernel("tiled").at_hand()


def _this_cpus_builds() -> list[Path]:
    """This CPU's build folders in the usual extensions folder (built here if need be)."""
    folders = []
    for name in _build.KERNELS:
        built = _build.build(name, _cpu.build_level(), estimate=_native.ESTIMATE)
        folders.append(built.path.parent)
    return folders


def test_a_read_only_folder_with_the_builds_is_loaded_as_it_is(tmp_path):
    readonly = tmp_path / "extensions"
    readonly.mkdir()
    for folder in _this_cpus_builds():
        (readonly / folder.name).mkdir()
        shutil.copy2(folder / f"{folder.name}.so", readonly / folder.name)
    for path in [*readonly.rglob("*"), readonly]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before = snapshot(readonly)
    try:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(readonly), "CXX": "/nowhere/c++"}
        report, said = run_first_calls(env)
    finally:
        for path in [readonly, *readonly.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert report["windowed"] == "native" and report["step"] == ["decode", "native"]
    assert report["origins"] == ["cached", "cached"]
    assert "attnkit:" not in said and "Warning" not in said
    assert snapshot(readonly) == before  # no lock, no log, nothing written (root could have)


KILLED = """
import torch
from attnkit.functional import attention
q = torch.randn(1, 2, 1, 16)
attention(q, q, q)  # a one-query call: the decode kernel
"""


@pytest.mark.build
def test_a_build_killed_midway_never_blocks_the_next_first_call(tmp_path):
    """SIGKILL (a CI timeout, docker stop) during a first call's build, then a new first call:
    it takes the dead build's lock at once, says so, builds and runs the kernel."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    env.pop("CXX", None)
    first = subprocess.Popen(
        [sys.executable, "-c", KILLED],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = first.stderr.readline()
    assert "attnkit: building the C++ kernel decode.cpp" in line, line
    time.sleep(3)  # well into the compile
    os.killpg(first.pid, signal.SIGKILL)  # Python and the compiler, as a supervisor kills a job
    assert first.wait(timeout=30) == -signal.SIGKILL
    (lock,) = (tmp_path / "extensions").glob("attnkit_decode_*/lock")
    assert lock.read_text() == str(first.pid)  # the dead process is still named in the lock
    started = time.monotonic()
    report, said = run_first_calls(env)
    assert report["step"] == ["decode", "native"] and report["origins"][1] == "built"
    assert f"cleared the lock of process {first.pid}, which ended before its build finished" in said
    assert "attnkit: built decode.cpp in" in said
    assert time.monotonic() - started < _build.LOCK_TIMEOUT_S / 4  # built, not waited out


@pytest.mark.build
def test_a_wheel_for_this_cpu_runs_its_kernels_without_a_compiler(tmp_path):
    """``pip wheel . --no-build-isolation`` for this CPU's level, installed in a fresh venv and run
    with no compiler on PATH and CXX pointing nowhere: the first calls run the C++ kernels and
    nothing is built."""
    level = _cpu.build_level()
    if level not in _build.WHEEL_LEVELS:
        pytest.skip(f"this CPU's level is {level!r}: a wheel carries builds from AVX2 up")
    source = source_copy(tmp_path)
    dist = tmp_path / "dist"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-w",
            str(dist),
        ],
        env={**os.environ, "ATTNKIT_WHEEL_LEVELS": level},
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.startswith("attnkit-") and f"-{python_tag}-{python_tag}-linux_" in wheel.name

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (packages,) = venv.glob("lib/python*/site-packages")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            str(wheel),
        ],
        check=True,
    )
    # torch and numpy from this environment, after the venv's own packages (attnkit: the wheel's)
    (packages / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    extensions = tmp_path / "extensions"
    env = {
        "PATH": str(venv / "bin"),
        "HOME": str(tmp_path),
        "CXX": "/nowhere/c++",
        "TORCH_EXTENSIONS_DIR": str(extensions),
    }
    if _cpu.ENV in os.environ:  # a run as another kind of CPU: the wheel was built for that
        env[_cpu.ENV] = os.environ[_cpu.ENV]
    python = venv / "bin" / "python"
    result = subprocess.run(
        [str(python), "-c", FIRST_CALLS], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["attnkit"].startswith(str(packages))
    assert report["windowed"] == "native" and report["step"] == ["decode", "native"]
    assert report["origins"] == ["prebuilt", "prebuilt"]
    assert "attnkit:" not in result.stderr and "Warning" not in result.stderr
    assert not extensions.exists()  # no build, no lock

    below = subprocess.run(
        [str(python), "-c", FIRST_CALLS],
        env={**env, _cpu.ENV: "none"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert below.returncode == 0, below.stderr[-3000:]
    report = json.loads(below.stdout.strip().splitlines()[-1])
    assert report["windowed"] == "loop" and report["step"][0] == "sdpa"  # PyTorch, and why:
    assert "no C++ compiler: '/nowhere/c++' is not on PATH" in below.stderr


def source_copy(tmp_path: Path) -> Path:
    """The project's sources in a folder of their own: pip builds in the tree it is given."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return source


def test_a_wheel_for_an_unknown_cpu_level_is_refused_naming_it(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source_copy(tmp_path)),
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
        ],
        env={**os.environ, "ATTNKIT_WHEEL_LEVELS": "avx2,avx9"},
        capture_output=True,
        text=True,
    )
    assert built.returncode != 0
    said = built.stdout + built.stderr
    assert "ATTNKIT_WHEEL_LEVELS: unknown levels ['avx9']" in said
    assert "known: ['none', 'avx2', 'avx512', 'avx512_bf16']" in said
    assert not list(tmp_path.glob("dist/*.whl"))  # no wheel without its kernels


def test_whether_a_kernel_is_at_hand_is_read_once_per_setting(tmp_path, monkeypatch):
    """A helper asks at_hand on every call: the extensions folder is looked at (its sources
    hashed) once per setting, and again when the setting changes."""
    monkeypatch.setattr(_native, "PREBUILT", tmp_path / "no-wheel")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a"))
    kernel = _native.Kernel("tiled")
    looks = []
    cached = kernel.cached
    monkeypatch.setattr(kernel, "cached", lambda: looks.append(1) or cached())
    assert not any(kernel.at_hand() for _ in range(3)) and len(looks) == 1
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "b"))
    assert not kernel.at_hand() and len(looks) == 2
