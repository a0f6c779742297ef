"""The package's shape: every file within its line bound, no attnkit module reading another's
private names (a package-private module such as ``attnkit._checks`` may be imported), and what
``import attnkit`` imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
        "from attnkit import _checks, mods\n"
        "from attnkit.masks import _block\n"
        "mods._WORTH_COMPILING\n"
        '_checks.check_flag(True, "x")\n'
    )
    found = foreign_private_names(fake, "attnkit.fake")
    assert found == ["from attnkit.masks import _block", "attnkit.mods._WORTH_COMPILING (line 3)"]


_CODE = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", re.S)
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|->|::|\S")
_BLOCK_AFTER = {")", "]", "else", "do", "try", "const", "mutable", "noexcept", "override", ";"}
_BLOCK_AFTER |= {"{", "}", ":"}
_SCOPES = {"namespace", "struct", "class", "enum", "union"}


def deepest_nesting(source: str) -> list[tuple[int, int]]:
    """``(depth, line)`` of the deepest block of each C++ function: its body is level 1, each
    block inside (a loop's, a branch's, a lambda's) one more; braced initialisers do not count."""
    code = _CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), source)
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in code.split("\n"))
    tokens = [
        (m.group(), n) for n, line in enumerate(code.split("\n"), 1) for m in _TOKEN.finditer(line)
    ]
    stack: list[str] = []
    found, deepest, start = [], (0, 0), 0
    for i, (token, line) in enumerate(tokens):
        if token == "{":
            before = [t for t, _ in tokens[start:i]]
            previous = tokens[i - 1][0] if i else ";"
            if (any(t in _SCOPES for t in before) and "(" not in before) or previous == "namespace":
                kind = "scope"
            else:
                kind = "block" if previous in _BLOCK_AFTER else "init"
            if kind == "block" and all(k == "scope" for k in stack):
                deepest = (0, line)
            stack.append(kind)
            depth = stack.count("block")
            if kind == "block" and depth > deepest[0]:
                deepest = (depth, line)
            start = i + 1
        elif token == "}":
            kind = stack.pop()
            if kind == "block" and all(k == "scope" for k in stack):
                found.append(deepest)
            if kind != "init":
                start = i + 1
        elif token == ";":
            start = i + 1
    return found


@pytest.mark.parametrize("path", [p for p in sources() if p.suffix != ".py"], ids=lambda p: p.name)
def test_no_cpp_function_nests_deeper_than_4_levels(path):
    depths = deepest_nesting(path.read_text())
    assert depths, f"{path.name}: no function found"
    too_deep = [line for depth, line in depths if depth > 4]
    assert too_deep == [], f"{path.name}: blocks nested over 4 deep at lines {too_deep}"


def test_the_nesting_count_sees_loops_lambdas_and_not_initialisers():
    source = """
namespace n {
struct S { int a[2] = {1, 2}; };
void f() {                        // 1
  for (;;) {                      // 2
    auto g = [](int x) {          // 3
      if (x) { while (x) { } }    // 4, 5
    };
    int b[2] = {3, 4};
  }
}
}  // namespace n
"""
    assert deepest_nesting(source) == [(5, 7)]


def test_importing_attnkit_imports_no_optional_package_and_not_torchdynamo():
    # the extras are imported where they are used; TorchDynamo (torch.compile's tracer) would
    # double the time `import attnkit` takes, in every process that imports it
    code = (
        "import sys, attnkit, attnkit.functional; "
        "print(*(m in sys.modules for m in ('transformers', 'matplotlib', 'torch._dynamo')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False", "False"]
