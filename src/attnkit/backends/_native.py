"""attnkit's C++ kernels: each built once with `torch.utils.cpp_extension`, then cached.

A kernel is one ``.cpp`` file next to this module (with the ``.h`` files beside it). The first use builds it (about a minute; ninja and
a C++ compiler are needed), torch caches the build in ``TORCH_EXTENSIONS_DIR`` and later processes
load it in well under a second. Where it cannot be built, or with ``ATTNKIT_NATIVE=0``, the kernel is
unavailable and its backend says why: callers fall back to PyTorch operations, never silently to
something that computes a different thing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from attnkit import _cpu

# The compiler flag of each extension a build may enable, in the order the build's name lists them.
_FLAGS = {
    "avx2": "-mavx2",
    "fma": "-mfma",
    "f16c": "-mf16c",
    "avx512f": "-mavx512f",
    "avx512bw": "-mavx512bw",
    "avx512vl": "-mavx512vl",
    "avx512dq": "-mavx512dq",
    "avx512_bf16": "-mavx512bf16",
}


def _isa_flags() -> tuple[str, list[str]]:
    """The instruction-set flags of a build for this CPU (from `attnkit._cpu.features`; not
    -march=native, which would enable extensions the probe was told to hide), and a tag naming
    every extension they enable, which keeps builds for different CPUs apart: a build is never
    loaded on a CPU that lacks an extension it uses."""
    present = _cpu.features()
    enabled = [name for name in _FLAGS if name in present]
    if not {"avx2", "fma"} <= present:  # the kernels' vector code assumes both or neither
        enabled = []
    tag = "_".join(name.replace("_", "") for name in enabled) or "baseline"
    flags = [_FLAGS[name] for name in enabled]
    if "avx512f" in enabled:  # GCC's default tuning vectorises loops 256 bits wide even then
        flags.append("-mprefer-vector-width=512")
    return tag, flags


@dataclass
class Kernel:
    """One C++ source, built on first use.

    Attributes:
        source: the ``.cpp`` file, beside this module.
        cflags: optimisation flags (the instruction-set flags are added); part of the build's name,
            so that a change of flags rebuilds.
        build_seconds: how long the last `load` took to build or to load the cached build.
    """

    source: str
    cflags: tuple[str, ...]
    build_seconds: float | None = None
    _module: ModuleType | None = field(default=None, repr=False)
    _failure: str | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return Path(__file__).with_name(self.source)

    def name(self) -> str:
        """The build's name: once loaded, the loaded one's; before, the one a build would have now
        (its instruction-set tag, and a hash of the sources and flags)."""
        if self._module is not None:
            return self._module.__name__
        isa, flags = _isa_flags()
        stem = self.path.stem
        headers = sorted(self.path.parent.glob("*.h"))  # what the source may include
        key = b"".join(p.read_bytes() for p in [self.path, *headers])
        key += " ".join([*self.cflags, *flags]).encode()
        return f"attnkit_{stem}_{isa}_{hashlib.sha1(key).hexdigest()[:10]}"

    def load(self) -> ModuleType | None:
        """The compiled module, or None when it cannot be built (the reason: `available`)."""
        if self._module is not None or self._failure is not None:
            return self._module
        if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
            self._failure = "disabled by ATTNKIT_NATIVE=0"
            return None
        started = time.perf_counter()
        try:
            from torch.utils import cpp_extension

            _, flags = _isa_flags()
            name = self.name()
            logging.getLogger("attnkit").info("building the C++ kernel %s (once)", name)
            # -fopenmp: at::parallel_for runs on OpenMP; without it the kernel runs on one thread.
            # The extension then shares the libgomp.so.1 that torch has loaded.
            self._module = cpp_extension.load(
                name,
                [str(self.path)],
                extra_cflags=[*self.cflags, "-fopenmp", *flags],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as error:  # a missing compiler or ninja shows up as many exception types
            self._failure = (
                f"the C++ kernel {self.source} could not be built: {type(error).__name__}: {error}"
            )
            warnings.warn(f"{self._failure}; attnkit uses PyTorch operations instead", stacklevel=3)
        self.build_seconds = time.perf_counter() - started
        return self._module

    def available(self) -> tuple[bool, str | None]:
        """Whether the kernel is usable, building it if need be, and why not."""
        return self.load() is not None, self._failure
