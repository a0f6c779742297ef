"""``attnkit build``, run in-process: what it reports, ``--check``, a build that fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.kernels.build import KERNELS


def test_build_reports_what_is_built_for_which_cpu_and_where(capsys):
    from attnkit.kernels import build as _build
    from attnkit.kernels import cpu as _cpu

    assert main(["build"]) == 0  # `make test` built them: nothing to do but report
    out = capsys.readouterr().out.splitlines()
    assert _cpu.describe() in out[0] and f"the {_cpu.build_level()} build" in out[0]
    assert str(_build.extensions_folder()) in out[0]
    rows = {line.split()[0]: line for line in out[1:]}
    assert set(rows) == set(_build.KERNELS)
    for kernel, row in rows.items():
        path = Path(row.split()[-1])
        assert path.exists() and path.name.startswith(f"attnkit_{kernel}_")
        assert any(said in row for said in ("already built", "built now", "prebuilt in the wheel"))


def test_build_check_builds_nothing_and_says_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    assert main(["build", "--check"]) == 1
    out = capsys.readouterr().out
    assert out.count("not built yet") == len(KERNELS) and str(tmp_path / "extensions") in out
    assert not (tmp_path / "extensions").exists()


def test_a_build_that_fails_exits_1_naming_the_cause(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", "/nowhere/c++")
    assert main(["build", "--force"]) == 1
    out = capsys.readouterr().out
    assert out.count("could not be built") == len(KERNELS)
    assert out.count("no C++ compiler: '/nowhere/c++' is not on PATH") == len(KERNELS)
    assert "runs PyTorch operations instead" in out.splitlines()[-1]


def test_build_takes_force_or_check_not_both(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["build", "--force", "--check"])
    assert stopped.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
