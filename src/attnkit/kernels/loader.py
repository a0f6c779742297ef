"""attnkit's C++ kernels, as the backends use them: found, built if need be, loaded once.

A kernel (``tiled`` or ``decode``) is built for this CPU's level (`attnkit.kernels.cpu.build_level`:
the vector instructions it has, narrowed by ``ATTNKIT_CPU_FEATURES``). Its first use in a process
loads, in this order:

1. the build a wheel carries for the highest level this CPU runs (``attnkit/_prebuilt``), where
   the wheel was built for this torch's major.minor version and C++ ABI (otherwise it is ignored,
   with one warning naming both versions);
2. the build in the extensions folder (``TORCH_EXTENSIONS_DIR``, else torch's default), which
   ``attnkit build`` makes ahead of time;
3. else a build made now, in the foreground (`attnkit.kernels.build.build`: a line on stderr before and
   after, Ctrl-C stops it).

Where no build can be had (no compiler, a compile error; or ``ATTNKIT_NATIVE=0``), one short
warning names the cause, the kernel is unavailable for the rest of the process and its backend
says why: callers run PyTorch operations instead, never something that computes a different thing.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from attnkit import _warn
from attnkit.kernels import build, cpu

PREBUILT = Path(__file__).parent.parent / "_prebuilt"
"""Where a wheel carries its builds (absent in a checkout)."""

ESTIMATE = "about half a minute on 2 cores"
"""What a build's first line says it will take (each kernel compiles in 20-30 s on the project's
2-core machines; see docs/guides/backends.md)."""


class KernelUnavailableError(RuntimeError):
    """A kernel that was expected to run could not be built or loaded when the call ran."""


_warned_versions: list[str] = []  # the prebuilt kernels' version warning, given once a process


@dataclass
class Kernel:
    """One C++ kernel (``backends/<kernel>.cpp``), loaded on first use.

    Attributes:
        kernel: its name, a key of `attnkit.kernels.build.KERNELS`.
        build_seconds: how long this process spent compiling it (None if it compiled nothing).
        origin: where the loaded build came from: ``"prebuilt"`` (in the wheel), ``"cached"``
            (the extensions folder) or ``"built"`` (compiled by this process); None before.
    """

    kernel: str
    build_seconds: float | None = None
    origin: str | None = None
    _module: ModuleType | None = field(default=None, repr=False)
    _failure: str | None = field(default=None, repr=False)
    _loading: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _found: dict = field(default_factory=dict, repr=False)  # usable(), by setting
    _at_hand: dict = field(default_factory=dict, repr=False)  # at_hand(), by setting

    @property
    def source(self) -> str:
        return f"{self.kernel}.cpp"

    def name(self) -> str:
        """The build's name: once loaded, the loaded one's; before, the one that would load now."""
        if self._module is not None:
            return self._module.__name__
        prebuilt = self.prebuilt()
        return prebuilt.stem if prebuilt is not None else self.cached().parent.name

    def level(self) -> str:
        """The CPU level of the build that loads (or would load) here."""
        prebuilt = self.prebuilt()
        if prebuilt is not None:
            return _level_of(prebuilt.stem)
        return cpu.build_level()

    def usable(self) -> tuple[bool, str | None]:
        """Whether the kernel can run here, and why not, without building, loading or writing
        anything: it is loaded, or a build is at hand (in the wheel or the extensions folder), or
        one can be made (a C++ compiler is found), and none has failed in this process. Read once
        per setting (CPU level, extensions folder, compiler, ``ATTNKIT_NATIVE``) and kept."""
        if self._module is not None:
            return True, None
        if self._failure is not None:
            return False, self._failure
        setting = _setting()
        if setting not in self._found:
            self._found[setting] = self._find()
        return self._found[setting]

    def _find(self) -> tuple[bool, str | None]:
        if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
            return False, "disabled by ATTNKIT_NATIVE=0"
        if self.prebuilt() is not None or self.cached().exists():
            return True, None
        missing = build.missing_compiler()
        if missing is not None:  # known to fail: said once, as a failed build is
            self._failure = f"the C++ kernel {self.source} is unavailable: {missing}"
            _warn.warn(f"{self._failure}; attnkit uses PyTorch operations instead")
            return False, self._failure
        return True, None

    def at_hand(self) -> bool:
        """Whether [`load`][attnkit.kernels.loader.Kernel.load] would load the kernel without
        compiling it: it is loaded, or a build is in the wheel or the extensions folder. For a
        helper that only speeds up work the PyTorch operations can do, and must not start a build.
        Read once per setting, as `usable` is (a helper may ask on every call)."""
        if self._module is not None:
            return True
        if self._failure is not None or os.environ.get("ATTNKIT_NATIVE", "1") == "0":
            return False
        setting = _setting()
        if setting not in self._at_hand:
            self._at_hand[setting] = self.prebuilt() is not None or self.cached().exists()
        return self._at_hand[setting]

    def load_at_hand(self) -> ModuleType | None:
        """The compiled module where [`at_hand`][attnkit.kernels.loader.Kernel.at_hand] says a
        build needs no compiling (loaded now if need be), else None: for a helper that only speeds
        up work the PyTorch operations can do, and asks on every call."""
        if self._module is not None:
            return self._module
        return self.load() if self.at_hand() else None

    def has_avx512_bf16(self) -> bool:
        """Whether its build multiplies bf16 with AVX512-BF16: that of the ``avx512_bf16`` level
        (the loaded module says so itself)."""
        if self._module is not None:
            return bool(self._module.has_avx512_bf16())
        return self.level() == "avx512_bf16"

    def prebuilt(self) -> Path | None:
        """The wheel's build for the highest level this CPU runs, if the wheel carries one made
        for this torch (else None, with one warning per process when the torch differs)."""
        manifest = build.read_manifest(PREBUILT)
        if manifest is None:
            return None
        mine = build.torch_build_id()
        theirs = {key: manifest.get(key) for key in mine}
        if theirs != mine:
            if not _warned_versions:
                _warned_versions.append(str(theirs))
                _warn.warn(
                    f"attnkit's prebuilt kernels were built for {_describe(theirs)}, this is "
                    f"{_describe(mine)}: they are ignored, and kernels are built for this torch "
                    "on first use (`attnkit build` builds them now)"
                )
            return None
        builds = manifest.get("kernels", {}).get(self.kernel, {})
        levels = list(build.LEVELS)
        for level in reversed(levels[: levels.index(cpu.build_level()) + 1]):
            if level in builds:
                return PREBUILT / builds[level]
        return None

    def cached(self) -> Path:
        """Where this CPU's build lives in the extensions folder (it may not exist yet)."""
        name = build.build_name(self.kernel, cpu.build_level())
        return build.extensions_folder() / name / f"{name}.so"

    def load(self) -> ModuleType | None:
        """The compiled module, or None when it cannot be had (the reason: `available`). Builds
        it in the foreground when no build exists; Ctrl-C raises ``KeyboardInterrupt``."""
        if self._module is not None or self._failure is not None:
            return self._module
        with self._loading:  # threads making their first calls together load it once
            if self._module is None and self._failure is None:
                self._load()
        return self._module

    def _load(self) -> None:
        if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
            self._failure = "disabled by ATTNKIT_NATIVE=0"
            return
        try:
            path, origin = self.prebuilt(), "prebuilt"
            if path is None:
                built = build.build(self.kernel, cpu.build_level(), estimate=ESTIMATE)
                path, origin = built.path, "built" if built.compiled else "cached"
                self.build_seconds = built.seconds if built.compiled else None
            self._module, self.origin = _import(path), origin
        except (build.BuildError, ImportError, OSError) as error:
            self._failure = f"the C++ kernel {self.source} is unavailable: {error}"
            _warn.warn(f"{self._failure}; attnkit uses PyTorch operations instead")

    def require(self, what: str) -> ModuleType:
        """The compiled module, as `load` gives it.

        Raises:
            KernelUnavailableError: it cannot be had; the message names ``what`` needed it, and
                why not.
        """
        module = self.load()
        if module is None:
            raise KernelUnavailableError(f"{what} is unavailable: {self.usable()[1]}")
        return module

    def available(self) -> tuple[bool, str | None]:
        """Whether the kernel is usable, building it if need be, and why not."""
        return self.load() is not None, self._failure


def _setting() -> tuple[str | None, ...]:
    """What decides whether a kernel can be had, besides this process's own attempts: the CPU
    level, the extensions folder, the compiler and ``ATTNKIT_NATIVE``."""
    return (
        cpu.build_level(),
        os.environ.get("TORCH_EXTENSIONS_DIR"),
        build.compiler(),
        os.environ.get("ATTNKIT_NATIVE", "1"),
    )


def _import(path: Path) -> ModuleType:
    """Load the extension module at ``path``; its import name is the file's stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _level_of(stem: str) -> str:
    """The level in a build's name (``attnkit_tiled_avx512bf16`` -> ``avx512_bf16``)."""
    tag = stem.split("_")[2]
    return next(level for level in build.LEVELS if level.replace("_", "") == tag)


def _describe(build_id: dict) -> str:
    abi = "the C++11 ABI" if build_id.get("cxx11_abi") else "the pre-C++11 ABI"
    return f"torch {build_id.get('torch')} ({abi}, Python {build_id.get('python')})"


KERNELS = {name: Kernel(name) for name in build.KERNELS}
"""The kernels of this process, by name (the modules that run them hold theirs: ``attnkit.tiled.plans.KERNEL``)."""


@dataclass(frozen=True)
class Report:
    """What `build_all` did for one kernel.

    Attributes:
        kernel: its name.
        level: the CPU level of the build.
        origin: ``"prebuilt"`` (in the wheel), ``"cached"`` (already in the extensions folder),
            ``"built"`` (compiled now), ``"missing"`` (not built, with ``check``) or ``"failed"``.
        path: the build's file (where it would be, when missing or failed).
        seconds: the time compiling took (0 when nothing was compiled).
        error: why it failed, or None.
    """

    kernel: str
    level: str
    origin: str
    path: Path
    seconds: float = 0.0
    error: str | None = None


def build_all(*, force: bool = False, check: bool = False) -> list[Report]:
    """Make every kernel ready for this CPU ahead of use, two builds at a time, and load them into
    this process: a usable prebuilt build is kept, a build in the extensions folder too unless
    ``force``; ``check`` builds nothing and reports what is there. Ctrl-C raises
    ``KeyboardInterrupt``."""
    from concurrent.futures import ThreadPoolExecutor

    level = cpu.build_level()

    def one(kernel: Kernel) -> Report:
        prebuilt = kernel.prebuilt()
        if prebuilt is not None and not force:
            return Report(kernel.kernel, _level_of(prebuilt.stem), "prebuilt", prebuilt)
        cached = kernel.cached()
        if check:
            return Report(kernel.kernel, level, "cached" if cached.exists() else "missing", cached)
        try:
            built = build.build(kernel.kernel, level, force=force, estimate=ESTIMATE)
            module = _import(built.path)
        except (build.BuildError, ImportError, OSError) as error:
            return Report(kernel.kernel, level, "failed", cached, error=str(error))
        origin = "built" if built.compiled else "cached"
        if prebuilt is None:  # what this process loads from now on
            with kernel._loading:
                kernel._module, kernel._failure, kernel.origin = module, None, origin
        return Report(kernel.kernel, level, origin, built.path, built.seconds)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(one, KERNELS.values()))
