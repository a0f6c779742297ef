"""The CPU-feature probe (attnkit._cpu): what it reports, how ATTNKIT_CPU_FEATURES narrows it, and
the C++ builds that follow from it. Nothing here assumes the CPU the tests run on."""

from __future__ import annotations

import pytest
import torch

from attnkit import _cpu
from attnkit.backends import _native


def test_the_probe_reports_known_extensions_only():
    assert _cpu.features() <= _cpu.KNOWN
    if "avx512f" in _cpu.features():  # every AVX-512 CPU has AVX2 too
        assert "avx2" in _cpu.features()


@pytest.mark.parametrize("spec", ["avx2", "avx512", "avx512_bf16", "none", "avx2,amx"])
def test_narrowing_never_adds_an_extension(spec, monkeypatch):
    detected = _cpu.features()
    monkeypatch.setenv(_cpu.ENV, spec)
    assert _cpu.features() == detected & _cpu.parse(spec)


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


def test_bf16_products_are_fast_exactly_with_avx512_bf16_or_amx(monkeypatch):
    for spec, fast in (("avx512_bf16", "avx512_bf16"), ("amx", "amx_bf16"), ("avx512", None)):
        monkeypatch.setenv(_cpu.ENV, spec)
        expected = fast is not None and fast in _cpu.features()
        assert _cpu.fast_half_products(torch.bfloat16) == expected


@pytest.mark.parametrize("spec", ["avx2", "avx512", "avx512_bf16", "none"])
def test_a_build_is_named_after_every_extension_it_enables(spec, monkeypatch):
    """A build for one CPU is never loaded on another that lacks an extension it uses: the
    extensions are in its name, and its flags enable nothing else."""
    monkeypatch.setenv(_cpu.ENV, spec)
    tag, flags = _native._isa_flags()
    enabled = {flag for flag in flags if flag in _native._FLAGS.values()}
    named = set(tag.split("_")) - {"baseline"}
    assert named == {
        name.replace("_", "") for name, flag in _native._FLAGS.items() if flag in enabled
    }
    assert enabled <= {_native._FLAGS[name] for name in _cpu.features() if name in _native._FLAGS}
    kernel = _native.Kernel("tiled.cpp", ("-O3",))
    assert kernel.name().startswith(f"attnkit_tiled_{tag}_")
    if spec == "none" or not {"avx2", "fma"} <= _cpu.features():
        assert (tag, flags) == ("baseline", [])


def test_builds_for_different_cpus_have_different_names(monkeypatch):
    kernel = _native.Kernel("tiled.cpp", ("-O3",))
    names = {}  # the flags of each narrowing -> the build's name
    for spec in ("none", "avx2", "avx512", "avx512_bf16"):
        monkeypatch.setenv(_cpu.ENV, spec)
        names[tuple(_native._isa_flags()[1])] = kernel.name()
    assert len(set(names.values())) == len(names)
