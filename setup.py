"""A wheel made where torch is installed carries attnkit's C++ kernels, prebuilt.

``pip wheel . --no-build-isolation`` (torch installed) compiles each kernel once per CPU level of
``attnkit.kernels.build.WHEEL_LEVELS`` into ``attnkit/_prebuilt`` and tags the wheel for this Python and
platform; ``ATTNKIT_WHEEL_LEVELS=avx2,avx512`` picks the levels. With build isolation (torch absent
from the build environment) and in editable installs, the wheel carries none: a checkout's kernels
are built into the extensions folder by ``attnkit build`` or on first use. torch stays out of
``[build-system] requires`` so that a plain ``pip install .`` never pulls a second torch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

BUILD = Path(__file__).parent / "src" / "attnkit" / "kernels" / "build.py"


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _builder():
    """attnkit.kernels.build, loaded by path: importing attnkit would import all of it."""
    spec = importlib.util.spec_from_file_location("attnkit_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """The package's files, then (in a wheel, torch installed) its kernels for each level."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "attnkit" / "_prebuilt"
        shutil.rmtree(target, ignore_errors=True)  # never ship an earlier build's kernels
        if getattr(self, "editable_mode", False):
            return
        if not _torch_installed():
            print(
                "attnkit: torch is not installed where this wheel is built, so it carries no "
                "prebuilt kernels (they are built on first use); with torch installed, "
                "`pip wheel . --no-build-isolation` includes them"
            )
            return
        builder = _builder()
        levels = tuple(
            os.environ.get("ATTNKIT_WHEEL_LEVELS", ",".join(builder.WHEEL_LEVELS))
            .replace(" ", "")
            .split(",")
        )
        unknown = sorted(set(levels) - set(builder.LEVELS))
        if unknown:
            raise SystemExit(
                f"ATTNKIT_WHEEL_LEVELS: unknown levels {unknown}; known: {list(builder.LEVELS)}"
            )
        print(f"attnkit: building the C++ kernels for CPU levels {', '.join(levels)}")
        builder.build_wheel_kernels(target, levels)


class KernelDistribution(Distribution):
    """A wheel with kernels holds machine code: tagged for its Python and platform."""

    def has_ext_modules(self) -> bool:
        return _torch_installed()


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=KernelDistribution)
