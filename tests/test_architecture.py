"""The layer table of docs/architecture.md, held against the code: every import of an attnkit
module, at the top of a file or inside a function, runs to the importer's own layer or one
listed before it; no import circle; and every module's test file where the tree says it is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "attnkit"


def layers() -> dict[str, int]:
    """Each top-level name of the package (``_checks``, ``backends``, ...) and its row's number,
    from the table's ``files`` column."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The layers, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    found = {}
    for number, row in enumerate(rows):
        files = row.split("|")[2]
        for name in re.findall(r"`([\w.]+/?)`", files):
            found[name.removesuffix("/").removesuffix(".py")] = number
    return found


def top_level(module: str) -> str:
    """``attnkit.backends.sdpa`` -> ``backends``; ``attnkit`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[str, int]]:
    """The attnkit modules ``path`` imports, with their lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "attnkit":  # from attnkit import functional, ...
                found += [(f"attnkit.{alias.name}", node.lineno) for alias in node.names]
            elif node.module.startswith("attnkit."):
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("attnkit.")]
    return found


FILES = sorted(PACKAGE.rglob("*.py"))


def test_the_table_places_every_part_of_the_package_once():
    table = layers()
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (
        p.is_dir() and (p / "__init__.py").exists())}  # fmt: skip
    assert parts - table.keys() == set(), "not in docs/architecture.md's table"
    assert table.keys() - parts == set(), "in the table, not in the package"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_upward(path):
    table = layers()
    me = top_level(".".join(("attnkit", *path.relative_to(PACKAGE).with_suffix("").parts)))
    upward = [
        f"line {line}: {module} ({top_level(module)}, row {table[top_level(module)]})"
        for module, line in imports(path)
        if top_level(module) in table and table[top_level(module)] > table[me]
    ]
    assert not upward, f"{path.name} (row {table[me]}) imports upward: {upward}"


def module_of(path: Path) -> str:
    """``src/attnkit/backends/sdpa.py`` -> ``attnkit.backends.sdpa``; a package is its ``__init__``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each attnkit module and the attnkit modules it imports (anywhere in it, also under
    ``TYPE_CHECKING``), a ``from package import name`` read as the submodule where there is one."""
    known = {module_of(p) for p in FILES}
    graph = {}
    for path in FILES:
        me = module_of(path)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("attnkit"):
                    subs = {f"{node.module}.{a.name}" for a in node.names} & known
                    found |= subs or ({node.module} & known)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names} & known
        graph[me] = found - {me}
    return graph


def test_no_import_circle():
    graph = import_graph()
    circles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if other.startswith(module + "."):  # a package's __init__ gathering its own modules
                continue
            if state.get(other) == "open":
                circles.append(" -> ".join([*trail[trail.index(other) :], other]))
            elif other not in state:
                visit(other, [*trail, other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_module_has_a_test_file_named_after_it_in_its_folder():
    """``attnkit/a/b.py`` (or ``a/_b.py``) is tested in ``tests/a/test_b.py``; a package's
    ``__init__`` and ``__main__`` are tested through the modules and commands they hold."""
    missing = []
    for path in FILES:
        if path.stem in ("__init__", "__main__"):
            continue
        folder = path.parent.relative_to(PACKAGE)
        test = ROOT / "tests" / folder / f"test_{path.stem.removeprefix('_')}.py"
        if not test.exists():
            missing.append(f"{path.relative_to(PACKAGE)}: no {test.relative_to(ROOT)}")
    assert not missing, "\n".join(missing)
