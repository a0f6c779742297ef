"""Building the C++ kernels (attnkit.kernels.build): the lock, the messages, failures and interruptions.

Most tests here run a stand-in compiler (a shell script that writes its ``-o`` file, fails, or
waits), so that every path of a build is checked in seconds; the tests marked ``build`` (``make
test-build``) compile the real kernels from scratch and make a wheel.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnkit.kernels import build as _build
from attnkit.kernels import cpu as _cpu

WRITES = (
    'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done; echo compiled; echo ok > "$out"'
)
FAILS = """echo "c++ -O3 -shared a very long command line -isystem /a/b/c"
echo "tiled.cpp: In function 'int f()':"
echo "tiled.cpp:12:5: error: 'x' was not declared in this scope"
echo "compilation terminated."
exit 1"""
# a compiler that runs a child in the foreground, as c++ runs cc1plus; both write their pids
WAITS = """pids="$(dirname "$0")/compiler.pids"
echo $$ > "$pids"
sh -c 'echo $$ >> "$1"; exec sleep 30' child "$pids"
"""


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    for _ in range(50):  # a killed process takes a moment to end
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return False
        if state in "ZX":
            return False
        time.sleep(0.1)
    return True


def compiler(folder: Path, body: str) -> str:
    """A stand-in compiler: a shell script running ``body``."""
    path = folder / f"cc-{abs(hash(body))}"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def fresh(tmp_path, monkeypatch) -> Path:
    """An empty extensions folder."""
    folder = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    return folder


def test_a_build_says_what_it_builds_and_is_made_once(fresh, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", compiler(tmp_path, WRITES))
    built = _build.build("decode", "avx2", estimate="about 20 s")
    said = capsys.readouterr().err.splitlines()
    assert built.compiled and built.path.read_text() == "ok\n"
    assert built.path.parent.parent == fresh and built.path.parent.name == built.path.stem
    assert len(said) == 2
    assert said[0].startswith("attnkit: building the C++ kernel decode.cpp for this CPU (avx2)")
    assert "none is built here yet" in said[0] and "about 20 s" in said[0] and "Ctrl-C" in said[0]
    assert said[1].startswith("attnkit: built decode.cpp in ")
    again = _build.build("decode", "avx2")
    assert not again.compiled and again.path == built.path and capsys.readouterr().err == ""
    assert sorted(p.name for p in built.path.parent.iterdir()) == sorted(
        [built.path.name, "build.log", "lock"]
    )
    assert _build.build("decode", "avx2", force=True).compiled
    assert "as asked" in capsys.readouterr().err


# a compiler that takes a while: tiled.cpp 0.4 s, decode.cpp 1.2 s
SLOW = 'case "$*" in *tiled.cpp*) sleep 0.4;; *) sleep 1.2;; esac\n' + WRITES


def test_a_build_says_how_far_it_is_while_the_compiler_runs(fresh, tmp_path, monkeypatch, capsys):
    """Between the line before and the line after, a line every few seconds in a log (a second
    on a terminal): what compiles, how many of the kernels built side by side are done, and the
    time so far. The first build was silent there for 50 s (issue 43)."""
    from attnkit._progress import BUILDS

    monkeypatch.setenv("CXX", compiler(tmp_path, SLOW))
    monkeypatch.setattr(BUILDS, "every", 0.1)
    builds = [threading.Thread(target=_build.build, args=(k, "avx2")) for k in ("tiled", "decode")]
    for build in builds:  # as `attnkit build` does: both kernels side by side
        build.start()
    for build in builds:
        build.join()
    said = capsys.readouterr().err.splitlines()
    assert sum(line.startswith("attnkit: building the C++ kernel") for line in said) == 2
    built = [line for line in said if line.startswith("attnkit: built ")]
    assert [line.split()[2] for line in built] == ["tiled.cpp", "decode.cpp"]
    progress = [line for line in said if line.startswith("attnkit: compiling ")]
    both = r"attnkit: compiling (tiled\.cpp, decode\.cpp|decode\.cpp, tiled\.cpp): 0 of 2 done"
    assert any(re.match(both, line) for line in progress), said
    one_left = said[said.index(built[0]) + 1 : said.index(built[1])]
    assert any(
        re.fullmatch(r"attnkit: compiling decode\.cpp: 1 of 2 done, \d+ s so far", line)
        for line in one_left
    ), said
    assert said[-1] == built[1]  # nothing after the last build


def test_a_change_of_sources_flags_or_torch_is_a_new_build(tmp_path, monkeypatch):
    names = {_build.build_name("tiled", level) for level in _build.LEVELS}
    assert len(names) == len(_build.LEVELS)
    monkeypatch.setenv("CXX", "g++-99")  # the compiler is not part of it
    assert _build.build_name("tiled", "avx2") in names
    other_torch = {**_build.torch_build_id(), "torch": "2.5"}
    monkeypatch.setattr(_build, "torch_build_id", lambda: other_torch)
    assert _build.build_name("tiled", "avx2") not in names
    monkeypatch.undo()
    monkeypatch.setattr(_build, "KERNELS", {**_build.KERNELS, "tiled": ("-O2",)})
    assert _build.build_name("tiled", "avx2") not in names
    monkeypatch.setattr(_build, "SOURCES", tmp_path)
    (tmp_path / "tiled.cpp").write_text("// another kernel")
    assert _build.build_name("tiled", "avx2") not in names


def test_a_failed_build_names_the_compilers_last_lines_not_its_command(
    fresh, tmp_path, monkeypatch
):
    monkeypatch.setenv("CXX", compiler(tmp_path, FAILS))
    with pytest.raises(_build.BuildError) as failure:
        _build.build("tiled", "avx2")
    message = str(failure.value)
    assert "exited with status 1" in message
    assert "tiled.cpp:12:5: error: 'x' was not declared in this scope" in message
    assert "-isystem" not in message and len(message) < 400
    log = next(fresh.glob("*/build.log")).read_text()
    assert "-DTORCH_EXTENSION_NAME=" in log and "compilation terminated." in log  # all of it
    assert not list(fresh.glob("*/*.so*"))  # nothing half-built is left


def test_no_compiler_is_a_build_error_naming_it(fresh, monkeypatch):
    monkeypatch.setenv("CXX", "/nowhere/c++")
    with pytest.raises(
        _build.BuildError, match=r"no C\+\+ compiler: '/nowhere/c\+\+' is not on PATH"
    ):
        _build.build("tiled", "avx2")


def test_a_folder_that_cannot_be_made_is_a_build_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "file" / "below"))
    with pytest.raises(_build.BuildError, match="cannot create"):
        _build.build("tiled", "avx2")


def test_a_lock_left_by_a_dead_process_is_taken_at_once(fresh, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", compiler(tmp_path, WRITES))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    folder = fresh / _build.build_name("tiled", "avx2")
    folder.mkdir(parents=True)
    (folder / "lock").write_text(dead.stdout.strip())
    started = time.monotonic()
    assert _build.build("tiled", "avx2").compiled
    assert time.monotonic() - started < 10
    said = capsys.readouterr().err
    assert f"cleared the lock of process {dead.stdout.strip()}, which ended before" in said
    assert (folder / "lock").read_text() == ""  # released: no process named


def _hold(folder: Path, pid: int):
    """Hold ``folder``'s build lock as a live process ``pid`` would."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / "lock", "a+")  # noqa: SIM115 (held across the test)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.truncate(0)
    lock.write(str(pid))
    lock.flush()
    return lock


def test_a_live_build_elsewhere_is_waited_for_then_used(fresh, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", compiler(tmp_path, "exit 1"))  # never run: the other build lands
    name = _build.build_name("tiled", "avx2")
    lock = _hold(fresh / name, os.getppid())

    def finish():
        time.sleep(0.5)
        (fresh / name / f"{name}.so").write_text("theirs")
        lock.close()  # releases the flock

    threading.Thread(target=finish).start()
    built = _build.build("tiled", "avx2")
    assert not built.compiled and built.path.read_text() == "theirs"
    said = capsys.readouterr().err
    assert f"waiting for process {os.getppid()}, which is building in {fresh / name}" in said


def test_waiting_for_a_live_build_has_a_limit(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", compiler(tmp_path, WRITES))
    monkeypatch.setattr(_build, "LOCK_TIMEOUT_S", 0.5)
    lock = _hold(fresh / _build.build_name("tiled", "avx2"), os.getppid())
    try:
        with pytest.raises(_build.BuildError, match=r"gave up after 0 s waiting for the build"):
            _build.build("tiled", "avx2")
    finally:
        lock.close()


INTERRUPTED = """
import os, signal, sys
from attnkit.kernels import build as _build
# Ctrl-C as at a terminal, whatever this suite's process inherited or set (ignored or blocked
# there, it would be so here and in the compiler too)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.stderr.write(f"pid {os.getpid()}\\n")
_build.build("tiled", "avx2")
"""


@pytest.mark.parametrize("whom", ["the process group", "python alone"])
def test_ctrl_c_during_a_build_raises_keyboardinterrupt(whom, fresh, tmp_path):
    """Ctrl-C at a terminal reaches the whole process group; ``kill -INT`` only Python. Either way
    the program stops with KeyboardInterrupt, the compiler ends, and nothing is left half-built."""
    env = {**os.environ, "CXX": compiler(tmp_path, WAITS), "TORCH_EXTENSIONS_DIR": str(fresh)}
    process = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines = [process.stderr.readline(), process.stderr.readline()]
    assert "attnkit: building the C++ kernel tiled.cpp" in lines[1], lines
    pids = tmp_path / "compiler.pids"
    deadline = time.monotonic() + 30
    while len(pids.read_text().split() if pids.exists() else []) < 2:  # both have started
        assert time.monotonic() < deadline, "the stand-in compiler did not start"
        time.sleep(0.05)
    if whom == "the process group":
        os.killpg(process.pid, signal.SIGINT)
    else:
        os.kill(process.pid, signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=20) != 0
    assert "KeyboardInterrupt" in rest
    assert not list(fresh.glob("*/*.so*"))
    compiler_and_child = pids.read_text().split()
    assert len(compiler_and_child) == 2
    assert not any(running(int(pid)) for pid in compiler_and_child)  # both were stopped


def test_the_command_is_torchs_for_a_cpu_extension_plus_the_levels_flags():
    argv = _build.command("decode", "avx512_bf16", "attnkit_x", Path("/tmp/x.so"))
    assert argv[:4] == [*argv[:1], str(_build.SOURCES / "decode.cpp"), "-o", "/tmp/x.so"]
    for flag in ("-shared", "-fPIC", "-DTORCH_EXTENSION_NAME=attnkit_x", "-fopenmp", "-ltorch"):
        assert flag in argv
    assert set(_build.LEVELS["avx512_bf16"]) <= set(argv)
    assert set(_build.KERNELS["decode"]) <= set(argv)
    assert _cpu.LEVELS["avx512_bf16"] >= _cpu.LEVELS["avx2"]  # levels accumulate
