"""What this CPU can do: the instruction-set extensions attnkit's kernels and choices depend on.

One probe for the whole package. The C++ kernels are built for the extensions it reports (and the
build's name lists them, so that a build is never loaded on a CPU that lacks one); the tiled backend
multiplies half-precision blocks in that precision only where it reports fast half-precision
products; ``auto`` and the benchmark read it too.

``ATTNKIT_CPU_FEATURES`` narrows what the probe reports, so that one machine can run attnkit (and its
tests) as a machine of a lesser kind: ``ATTNKIT_CPU_FEATURES=avx2`` makes a CPU with AVX512-BF16
behave as an AVX2 one. It takes levels and single extensions, separated by commas or spaces:

| level | extensions |
|---|---|
| ``none`` | no extension: the compiler's baseline x86-64 |
| ``avx2`` | avx2, fma, f16c |
| ``avx512`` | the avx2 level and avx512f, avx512bw, avx512vl, avx512dq |
| ``avx512_bf16`` | the avx512 level and avx512_bf16 |
| ``amx`` | the avx512_bf16 level and amx_tile, amx_bf16, amx_fp16 |

It can only narrow: an extension the CPU lacks is never reported. An unknown name raises
`ValueError`.

Example:
    >>> from attnkit.kernels import cpu
    >>> cpu.features() <= cpu.KNOWN
    True
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

import torch

from attnkit._tracing import traced
from attnkit.kernels import build

KNOWN = frozenset(
    {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
        "amx_fp16",
    }
)

_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
LEVELS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "amx": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16"},
}

# The extensions that matter to a reader of a benchmark, in the order they are shown.
SHOWN = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_fp16")

ENV = "ATTNKIT_CPU_FEATURES"


def detected() -> frozenset[str]:
    """The extensions the CPU and the OS support: the flags of /proc/cpuinfo on Linux, else torch's
    own probes (which cover fewer of them)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return KNOWN & set(line.partition(":")[2].split())
    probes = {
        "avx2": "_is_avx2_supported",
        "avx512f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_tile": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
    found = {name for name, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)()}
    if "avx2" in found:
        found |= _AVX2
    if "avx512f" in found:
        found |= _AVX512
    return frozenset(found)


def parse(spec: str) -> frozenset[str]:
    """The extensions named by an ``ATTNKIT_CPU_FEATURES`` value (levels expanded).

    Raises:
        ValueError: a name is neither a level nor a known extension.
    """
    named: set[str] = set()
    for word in spec.replace(",", " ").split():
        word = word.lower()
        if word in LEVELS:
            named |= LEVELS[word]
        elif word in KNOWN:
            named.add(word)
        else:
            choices = ", ".join([*LEVELS, *sorted(KNOWN - set(LEVELS))])
            raise ValueError(f"{ENV}={spec!r}: unknown CPU feature {word!r}; known: {choices}")
    return frozenset(named)


@functools.cache
def features_of(spec: str | None) -> frozenset[str]:
    """The extensions attnkit may use when ``ATTNKIT_CPU_FEATURES`` is ``spec`` (read once per
    spec)."""
    found = detected()
    return found if spec is None else found & parse(spec)


def features() -> frozenset[str]:
    """The extensions attnkit may use on this CPU: those it has, narrowed by ``ATTNKIT_CPU_FEATURES``
    (unset or blank: not narrowed). Under ``torch.compile``'s tracing, the answer of the last call
    outside it (or at import): the probe reads a file and the environment, which dynamo cannot
    trace, and the CPU does not change while a graph is traced."""
    if traced():
        return _last[0]
    spec = os.environ.get(ENV, "").strip()
    _last[0] = features_of(spec or None)
    return _last[0]


def has(*names: str) -> bool:
    """Whether the CPU has every one of ``names`` (after narrowing)."""
    return set(names) <= features()


def build_level() -> str:
    """The highest level of the C++ kernels' builds (`attnkit.kernels.build.LEVELS`) that this CPU runs,
    after narrowing: an AMX CPU runs the ``avx512_bf16`` build, one without AVX2 the ``none`` one."""
    present = features()
    return [level for level in build.LEVELS if LEVELS[level] <= present][-1]


def fast_half_products(dtype: torch.dtype) -> bool:
    """Whether matrix products in ``dtype`` (bf16 or fp16) run faster than in float32 on this CPU:
    bf16 with AVX512-BF16 or AMX, fp16 with AMX-FP16. Without such units they are emulated, tens to
    hundreds of times slower than float32."""
    if dtype == torch.bfloat16:
        return not features().isdisjoint(("avx512_bf16", "amx_bf16"))
    if dtype == torch.float16:
        return has("amx_fp16")
    return False


def describe() -> str:
    """The extensions that matter, as a benchmark prints them: ``avx2 avx512f avx512_bf16 -amx``."""
    present = features()
    shown = [name if name in present else f"-{name}" for name in SHOWN]
    spec = os.environ.get(ENV, "").strip()
    narrowed = f" ({ENV}={spec})" if spec else ""
    return " ".join(shown) + narrowed


_last = [frozenset()]
with contextlib.suppress(ValueError):  # a bad ATTNKIT_CPU_FEATURES: the first real call says so
    features()  # read once at import, outside anything dynamo traces
