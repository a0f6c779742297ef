"""Building attnkit's C++ kernels: one compiler command per kernel and CPU level, a build that
cannot hang, and the record of what a wheel carries.

A kernel is one ``.cpp`` file in ``attnkit/backends`` (with the ``.h`` files beside it), compiled
with the running torch's headers into a Python extension module, once per CPU level
([`LEVELS`][attnkit.kernels.build.LEVELS]: the vector instructions the build may use). Two places hold
builds:

- a wheel made with ``pip wheel . --no-build-isolation`` carries one build per level of
  [`WHEEL_LEVELS`][attnkit.kernels.build.WHEEL_LEVELS] in ``attnkit/_prebuilt`` beside a
  [`MANIFEST`][attnkit.kernels.build.MANIFEST] naming the torch it was built with;
- anywhere else (a checkout, an install without a compiler at hand when it was made), a build for
  this CPU's level lands in the extensions folder (``TORCH_EXTENSIONS_DIR``, else torch's default),
  made by ``attnkit build`` or by the first call that needs it.

[`build`][attnkit.kernels.build.build] makes one build in the extensions folder: in the foreground, with
a line on stderr before and after and, while the compiler runs, a progress line that says which
kernels compile, how many are done and for how long (`attnkit._progress.BUILDS`), under an ``flock`` (a lock that dies with its holder, so a build
killed halfway never blocks the next one), into a temporary file renamed into place when complete
(a folder never holds half a kernel). Ctrl-C stops the compiler and raises ``KeyboardInterrupt``.

This module imports nothing of attnkit at import time (``setup.py`` loads it by path to build a
wheel, and calls only what needs nothing else: `build_wheel_kernels`), and imports torch only when
asked to compile; `build` takes its progress line from ``attnkit._progress`` when it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: builds still land atomically, but two may run side by side
    fcntl = None  # type: ignore[assignment]

SOURCES = Path(__file__).parent
"""Where the kernels' ``.cpp`` and ``.h`` files are."""

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# GCC's default tuning vectorises loops 256 bits wide even where AVX-512 is enabled.
_AVX512 = (
    *_AVX2,
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mprefer-vector-width=512",
)
LEVELS: dict[str, tuple[str, ...]] = {
    "none": (),
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": (*_AVX512, "-mavx512bf16"),
}
"""The compiler flags of a build for each CPU level, lowest first (the levels of
``attnkit.kernels.cpu.LEVELS``; an AMX CPU runs the ``avx512_bf16`` build: the kernels use no AMX)."""

WHEEL_LEVELS = ("avx2", "avx512", "avx512_bf16")
"""The levels a wheel carries: each one whose vector code the kernels use. Below AVX2, a build at
run time or PyTorch operations."""

KERNELS: dict[str, tuple[str, ...]] = {
    "tiled": ("-O3", "-fno-math-errno", "-fno-trapping-math"),
    "decode": ("-O3", "-ffast-math", "-fno-finite-math-only"),
    "linear": ("-O3", "-ffast-math", "-fno-finite-math-only"),
    "sparse": ("-O3", "-ffast-math", "-fno-finite-math-only"),
}
"""Each kernel (``kernels/<name>.cpp``) and its optimisation flags. decode's, linear's and sparse's sums tolerate
reassociation (their tests bound the error); tiled's match the PyTorch loop's order."""

MANIFEST = "manifest.json"
"""The file in a wheel's ``attnkit/_prebuilt`` that names its builds and the torch they need."""

LOCK_TIMEOUT_S = 900.0
"""How long a call waits for a build that another live process is making (a cold build takes a
minute or two on a 2-core machine; this leaves room for a loaded one)."""


class BuildError(RuntimeError):
    """A kernel could not be built; the message names the cause in a few lines."""


def torch_build_id() -> dict[str, object]:
    """What a build depends on beyond its sources: torch's major.minor version and C++ ABI, and
    Python's version (a build for one never loads in another)."""
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return {
        "torch": f"{major}.{minor}",
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def extensions_folder() -> Path:
    """Where builds for this machine live: ``TORCH_EXTENSIONS_DIR``, else the folder torch's own
    extensions use (``~/.cache/torch_extensions/py311_cpu`` and the like)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils import cpp_extension

    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{accelerator}"


def compiler() -> str:
    """The C++ compiler: ``CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def _std_flag() -> str:
    """torch's headers need C++17 up to 2.11 and C++20 from 2.12 (its own extensions follow)."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


def command(kernel: str, level: str, name: str, output: Path) -> list[str]:
    """The one compiler command that builds ``kernel`` for ``level`` into ``output``, an extension
    module whose import name is ``name``: the flags torch's own ``cpp_extension`` gives a CPU
    extension, OpenMP (at::parallel_for runs on it and shares torch's libgomp), the kernel's
    optimisation flags and the level's instruction sets."""
    import torch
    from torch.utils import cpp_extension

    includes = [
        *cpp_extension.include_paths(),
        sysconfig.get_path("include", scheme="posix_prefix"),
    ]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *shlex.split(compiler()),
        str(SOURCES / f"{kernel}.cpp"),
        "-o",
        str(output),
        "-shared",
        "-fPIC",
        _std_flag(),
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *_pybind11_abi(torch),
        *(f"-isystem{path}" for path in includes),
        *KERNELS[kernel],
        *LEVELS[level],
        "-fopenmp",
        *(f"-L{path}" for path in cpp_extension.library_paths()),
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def _pybind11_abi(torch) -> list[str]:
    """The pybind11 ABI of torch's own bindings, where the running torch records it (releases up
    to about 2.11 do, in ``torch._C._PYBIND11_*``; their cpp_extension passes it on): built with
    another, an extension gets pybind11 state apart from torch's."""
    names = ("COMPILER_TYPE", "STDLIB", "BUILD_ABI")
    values = {name: getattr(torch._C, f"_PYBIND11_{name}", None) for name in names}
    return [f'-DPYBIND11_{name}="{value}"' for name, value in values.items() if value is not None]


def build_name(kernel: str, level: str) -> str:
    """The name of a build in the extensions folder: the kernel, its level, and a hash of all it
    depends on (sources, flags, torch and Python), so that a change of any rebuilds. Not the
    compiler: a folder built elsewhere loads wherever the rest agrees."""
    key = hashlib.sha1()
    for path in [SOURCES / f"{kernel}.cpp", *sorted(SOURCES.glob("*.h"))]:
        key.update(path.read_bytes())
    ident = [*KERNELS[kernel], *LEVELS[level], json.dumps(torch_build_id())]
    key.update(" ".join(ident).encode())
    return f"attnkit_{kernel}_{level.replace('_', '')}_{key.hexdigest()[:10]}"


def compile_to(
    kernel: str, level: str, name: str, output: Path, log_path: Path | None = None
) -> float:
    """Run the compiler in the foreground, into a temporary file renamed to ``output`` when
    complete; the seconds it took.

    Raises:
        BuildError: no compiler, or it failed (the message ends with its last lines; the whole
            log, the command first, is written to ``log_path`` where one is given).
        KeyboardInterrupt: Ctrl-C (the compiler is stopped, nothing is left behind).
    """
    _check_compiler()
    argv = command(kernel, level, name, output)
    partial = output.with_name(f"{output.name}.{os.getpid()}.partial")
    argv[argv.index(str(output))] = str(partial)
    started = time.perf_counter()
    try:
        log, status = _run(argv)
        if log_path is not None:
            with contextlib.suppress(OSError):
                log_path.write_text(shlex.join(argv) + "\n" + log)
        if status != 0:
            raise BuildError(f"{argv[0]} exited with status {status}: {_tail(log)}")
        os.replace(partial, output)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()
    return time.perf_counter() - started


def missing_compiler() -> str | None:
    """What is wrong with the C++ compiler (None when it is found)."""
    program = shlex.split(compiler())[0]
    if shutil.which(program) is None:
        return f"no C++ compiler: {program!r} is not on PATH (set CXX to one)"
    return None


def _check_compiler() -> None:
    missing = missing_compiler()
    if missing is not None:
        raise BuildError(missing)


def _run(argv: list[str]) -> tuple[str, int]:
    """Run the compiler and return its output and exit status. When this process is interrupted
    (Ctrl-C, ``kill -INT``) or fails while it waits, the compiler and every process it started
    (cc1plus, as, ld) are stopped before the exception goes on."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        try:
            log, _ = process.communicate()
        except BaseException:
            _stop_tree(process.pid)
            raise
    if process.returncode == -signal.SIGINT:  # Ctrl-C at a terminal reached the compiler first
        raise KeyboardInterrupt
    return log.decode(errors="replace"), process.returncode


def _stop_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (read from /proc; where there is none, ``pid`` alone)."""
    parents: dict[int, list[int]] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_file.read_text().rpartition(")")[2].split()
            parents.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in parents.get(parent, [])]
        tree += frontier
    for member in tree:
        with contextlib.suppress(OSError):
            os.kill(member, signal.SIGKILL)


def _tail(log: str, lines: int = 4) -> str:
    """The compiler's last lines that say something (its errors), joined on one line."""
    said = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in said if "error" in line.lower()]
    return " | ".join((errors or said)[-lines:]) or "no output"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextlib.contextmanager
def _locked(folder: Path, say) -> Iterator[None]:
    """Hold ``folder/lock`` (an ``flock``: released by the kernel when its holder dies, however it
    dies). A lock a dead process left is taken at once, with a notice; one a live process holds is
    waited for, with a message, for at most [`LOCK_TIMEOUT_S`][attnkit.kernels.build.LOCK_TIMEOUT_S]."""
    if fcntl is None:
        yield
        return
    path = folder / "lock"
    with open(path, "a+") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        waiting = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    lock.seek(0)
                    holder = lock.read().strip() or "another process"
                    say(
                        f"waiting for process {holder}, which is building in {folder} "
                        f"(at most {LOCK_TIMEOUT_S:.0f} s)"
                    )
                    waiting = True
                if time.monotonic() > deadline:
                    raise BuildError(
                        f"gave up after {LOCK_TIMEOUT_S:.0f} s waiting for the build in {folder}"
                    ) from None
                time.sleep(0.2)
        lock.seek(0)
        previous = lock.read().strip()
        if previous.isdigit() and int(previous) != os.getpid() and not _alive(int(previous)):
            say(f"cleared the lock of process {previous}, which ended before its build finished")
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            lock.seek(0)
            lock.truncate()
            lock.flush()


@dataclass(frozen=True)
class Built:
    """One build in the extensions folder: where it is and whether this call compiled it."""

    path: Path
    compiled: bool
    seconds: float = 0.0


def build(kernel: str, level: str, *, force: bool = False, estimate: str = "") -> Built:
    """The build of ``kernel`` for ``level`` in the extensions folder: the one there (read-only
    folders included: nothing is written when it exists), else compiled now under the folder's
    lock, with a line on stderr before and after and the progress line between. ``force``
    compiles anew.

    Raises:
        BuildError: it cannot be built (no compiler, a compile error, a folder that cannot be
            written, a build elsewhere that did not finish in time).
        KeyboardInterrupt: Ctrl-C during the build.
    """
    name = build_name(kernel, level)
    folder = extensions_folder() / name
    output = folder / f"{name}.so"
    if output.exists() and not force:
        return Built(output, compiled=False)
    _check_compiler()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BuildError(f"cannot create {folder}: {error.strerror}") from None
    try:
        from attnkit._progress import BUILDS  # see the module's docstring

        with _locked(folder, BUILDS.say):
            if output.exists() and not force:  # built by the process we waited for
                return Built(output, compiled=False)
            _remove_partial_builds_of_dead_processes(folder)
            why = _why_build(kernel, level, folder.parent, force)
            BUILDS.say(
                f"building the C++ kernel {kernel}.cpp for this CPU ({level}): {why}; "
                f"{estimate or 'about a minute'}, once (Ctrl-C stops it), into {folder}"
            )
            BUILDS.start(f"{kernel}.cpp")
            done = None  # the line after: none when the build fails or is stopped
            try:
                seconds = compile_to(kernel, level, name, output, folder / "build.log")
                done = f"built {kernel}.cpp in {seconds:.0f} s"
            finally:
                BUILDS.finish(f"{kernel}.cpp", done)
            return Built(output, compiled=True, seconds=seconds)
    except OSError as error:  # the folder is read-only, full, ...
        raise BuildError(f"cannot build in {folder}: {error.strerror or error}") from None


def _remove_partial_builds_of_dead_processes(folder: Path) -> None:
    """A process killed while it built leaves its compiler's partial output (``*.<pid>.partial``)."""
    for partial in folder.glob("*.partial"):
        pid = partial.name.split(".")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                partial.unlink()


def _why_build(kernel: str, level: str, root: Path, force: bool) -> str:
    if force:
        return "as asked"
    stem = f"attnkit_{kernel}_{level.replace('_', '')}_"
    if any(root.glob(f"{stem}*/{stem}*.so")):
        return "its sources, flags or torch changed since the last build"
    return "none is built here yet"


def read_manifest(folder: Path) -> dict | None:
    """A wheel's record of its builds (None where there is none)."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def build_wheel_kernels(folder: Path, levels: tuple[str, ...] = WHEEL_LEVELS) -> dict:
    """Compile every kernel for each of ``levels`` into ``folder`` (a wheel's
    ``attnkit/_prebuilt``), two at a time, and write the manifest; the manifest."""
    from concurrent.futures import ThreadPoolExecutor

    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(kernel, level) for level in levels for kernel in KERNELS]

    def one(job: tuple[str, str]) -> tuple[str, str, str]:
        kernel, level = job
        name = f"attnkit_{kernel}_{level.replace('_', '')}"
        seconds = compile_to(kernel, level, name, folder / f"{name}.so")
        print(f"attnkit: built {name} in {seconds:.0f} s", flush=True)
        return kernel, level, f"{name}.so"

    manifest: dict = {**torch_build_id(), "kernels": {kernel: {} for kernel in KERNELS}}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for kernel, level, file in pool.map(one, jobs):
            manifest["kernels"][kernel][level] = file
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
