"""The package's shape: every file within its line bound, and no attnkit module reading another's
private names (a package-private module such as ``attnkit._checks`` may be imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "attnkit"
LIMITS = {".py": 450, ".cpp": 500, ".h": 500}  # physical lines


def sources() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*") if p.suffix in LIMITS and "__pycache__" not in p.parts
    )


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_file_stays_within_its_line_bound(path):
    lines = len(path.read_text().splitlines())
    assert lines <= LIMITS[path.suffix], f"{path.name}: {lines} lines, over {LIMITS[path.suffix]}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether ``attnkit.a.b`` is a module or package of attnkit's."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def foreign_private_names(path: Path, me: str | None = None) -> list[str]:
    """``module._name`` and ``from module import _name`` where ``module`` is another attnkit
    module and ``_name`` is not itself a module (``me``: the module ``path`` is)."""
    me = me or module_name(path)
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> the attnkit module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("attnkit") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnkit"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if is_module(full):
                    aliases[a.asname or a.name] = full
                elif private(a.name) and node.module != me:
                    found.append(f"from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and private(node.attr)
            and aliases[node.value.id] != me
            and not is_module(f"{aliases[node.value.id]}.{node.attr}")
        ):
            found.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return found


def test_no_module_reads_another_modules_private_names():
    found = {
        str(p.relative_to(PACKAGE)): names
        for p in sources()
        if p.suffix == ".py" and (names := foreign_private_names(p))
    }
    assert found == {}


def test_the_check_finds_what_it_looks_for(tmp_path):
    """The walk above, on a module that reads another's privates in both ways, and on one that
    reads a package-private module's public names."""
    fake = tmp_path / "fake.py"
    fake.write_text(
        "from attnkit import _cpu, mods\n"
        "from attnkit.masks import _block\n"
        "mods._WORTH_COMPILING\n"
        "_cpu.features()\n"
    )
    found = foreign_private_names(fake, "attnkit.fake")
    assert found == ["from attnkit.masks import _block", "attnkit.mods._WORTH_COMPILING (line 3)"]
