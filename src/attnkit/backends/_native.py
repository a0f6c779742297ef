"""attnkit's C++ kernels: each built once with :mod:`torch.utils.cpp_extension`, then cached.

A kernel is one ``.cpp`` file next to this module. The first use builds it (about a minute; ninja and
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

import torch


def _isa_flags() -> tuple[str, list[str]]:
    """Instruction-set flags for the CPU torch runs on (not -march=native: a cached build must not
    reach a CPU that lacks its instructions), and a tag that keeps builds for each set apart."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    flags = {
        "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
        "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    }.get(capability, [])
    return capability.lower().replace(" ", "_"), flags


@dataclass
class Kernel:
    """One C++ source, built on first use.

    Attributes:
        source: the ``.cpp`` file, beside this module.
        cflags: optimisation flags (the instruction-set flags are added); part of the build's name,
            so that a change of flags rebuilds.
        build_seconds: how long the last :meth:`load` took to build or to load the cached build.
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
        isa, flags = _isa_flags()
        stem = self.path.stem
        key = self.path.read_bytes() + " ".join([*self.cflags, *flags]).encode()
        return f"attnkit_{stem}_{isa}_{hashlib.sha1(key).hexdigest()[:10]}"

    def load(self) -> ModuleType | None:
        """The compiled module, or None when it cannot be built (the reason: :meth:`available`)."""
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
