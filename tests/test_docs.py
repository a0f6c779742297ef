"""Every example in the README, the guides and the docstrings runs and shows what it says.

- Python in Markdown: a ```` ```pycon ```` block is a doctest whose output is compared; a
  ```` ```python ```` block runs. The blocks of one page share their names, in page order, as a
  reader typing them in one session would.
- The command line in Markdown: every ```` ```sh ```` line (and ``$`` line of a ```` ```console ````
  block, whose following lines are its expected output) that calls ``attnkit`` runs in a temporary
  folder, benchmarks with ``--smoke`` and ``attnkit learn`` for 20 steps; one shown as
  ``attnkit: error: ...`` must exit with 2. A ``torchrun`` line runs in a folder holding its
  page's scripts: the ```` ```python ```` blocks that start with ``# file: NAME.py``. Other
  commands must be listed in ``NOT_RUN`` with the reason.
- Docstrings: every ``>>>`` example in the package runs as a doctest in its module's namespace.
- The site: ``mkdocs build --strict`` passes, and no built page shows a Sphinx role as text.

Nothing here is skipped: an example that cannot run belongs in ``NOT_RUN``, and an entry there
that matches no example fails too, so the list stays true.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import os
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import attnkit
from attnkit import cli

pytestmark = pytest.mark.outer  # out of `make test-fast`

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Commands shown in the docs that the suite does not run, each with why (matched by prefix).
NOT_RUN = {
    "make demo": "installs the package; CI's clean clone runs it",
    "make test": "the suite itself",
    "ATTNKIT_CPU_FEATURES=avx2 make test": "the whole suite again; test_cpu.py runs that setting",
    "pip install": "installs from a package registry",
    "pip wheel": "builds a wheel; test_native.py's build-marked test builds and installs one",
    "git clone": "fetches the peers' tests from their repositories (docs/bench/peer-suites.md)",
    "git -C PEERS": "a step of that checkout",
    ".venv/bin/pip install": "installs from a package registry",
    "OUT=peer-suites scripts/peer-suites.sh": "runs the peers' suites: minutes, and their files",
}

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
SCRIPT = re.compile(r"# file: (?P<name>\S+\.py)\n")  # the first line of a script's block
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    argv: list[str]
    shown: str | None = None  # the output a console block shows, compared with ELLIPSIS
    text: str = ""
    where: str = ""
    env: dict[str, str] = field(default_factory=dict)


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        indent = len(m["indent"])
        body = "\n".join(line[indent:] for line in m["body"].splitlines()) + "\n"
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, m["lang"], body))
    return found


def commands(block: Block) -> list[Command]:
    """The command lines of a ``sh`` or ``console`` block, with a console block's shown output."""
    found: list[Command] = []
    for line in block.body.splitlines():
        if block.lang == "console" and not line.startswith("$ "):
            if found:
                shown = found[-1].shown or ""
                found[-1].shown = shown + line + "\n"
            continue
        line = line.removeprefix("$ ").strip()
        if line:
            found.append(Command(shlex.split(line, comments=True), text=line, where=block.id))
    return found


def python_pages() -> dict[Path, list[Block]]:
    by_page = {
        p: [b for b in blocks(p) if b.lang in ("python", "pycon") and not SCRIPT.match(b.body)]
        for p in PAGES
    }
    return {p: b for p, b in by_page.items() if b}


def scripts(page: Path) -> dict[str, str]:
    """The page's scripts, by file name."""
    return {
        m["name"]: b.body
        for b in blocks(page)
        if b.lang == "python" and (m := SCRIPT.match(b.body))
    }


def all_commands() -> list[Command]:
    return [c for p in PAGES for b in blocks(p) if b.lang in ("sh", "console") for c in commands(b)]


def torchrun_commands() -> list[Command]:
    return [c for c in all_commands() if c.argv[0] == "torchrun"]


def not_run_reason(command: Command) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.text.startswith(start)), None)


@pytest.mark.parametrize("page", list(python_pages()), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_python_examples_of_a_page_run_and_show_their_output(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names: dict = {"__name__": "__docs__"}
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=FLAGS)
    for block in python_pages()[page]:
        if ">>>" in block.body:
            test = parser.get_doctest(block.body, names, block.id, str(page), block.line)
            out = io.StringIO()
            result = runner.run(test, out=out.write, clear_globs=False)
            assert result.failed == 0, f"{block.id}:\n{out.getvalue()}"
            names = test.globs  # a DocTest runs in a copy of the names it is given
        else:
            exec(compile(block.body, block.id, "exec"), names)


def runnable(command: Command) -> list[str]:
    argv = command.argv
    assert argv[0] == "attnkit", (
        f"{command.where}: `{command.text}` is not attnkit; list it in NOT_RUN"
    )
    argv = argv[1:]
    if argv[:1] == ["learn"] and "--steps" not in argv:
        argv = [*argv, "--steps", "20"]  # the default minute of training is the benchmark's
    if argv[:1] == ["bench"] and "--smoke" not in argv:
        argv = [*argv, "--smoke"]
        # --smoke picks its own sizes; the options that name sizes go
        for sized in ("--n", "--prompts", "--new-tokens"):
            if sized in argv:
                i = argv.index(sized)
                j = i + 1
                while j < len(argv) and not argv[j].startswith("--"):
                    j += 1
                del argv[i:j]
    return argv


@pytest.mark.parametrize(
    "command",
    [c for c in all_commands() if not not_run_reason(c) and c.argv[0] != "torchrun"],
    ids=lambda c: c.text,
)
def test_the_command_line_examples_run(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "emb.json").write_text('{"hello": [1, 0, 0], "world": [0, 1, 0]}')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = cli.main(runnable(command))
    # an example of an error shows the one line the command prints, and the command exits with 2
    expected = 2 if command.shown and command.shown.startswith("attnkit: error:") else 0
    assert (status or 0) == expected, f"{command.where}: `{command.text}` exited with {status}"
    if command.shown is not None:
        checker = doctest.OutputChecker()
        assert checker.check_output(command.shown, out.getvalue(), FLAGS), (
            f"{command.where}: `{command.text}` printed\n{out.getvalue()}\nnot\n{command.shown}"
        )


@pytest.mark.parametrize("command", torchrun_commands(), ids=lambda c: c.text)
def test_the_scripts_run_under_torchrun_as_shown(command, tmp_path):
    page = ROOT / command.where.rsplit(":", 1)[0]
    for name, body in scripts(page).items():
        (tmp_path / name).write_text(body)
    assert (tmp_path / command.argv[-1]).exists(), f"{command.where}: no script {command.argv[-1]}"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command.argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, f"{command.where}: `{command.text}` failed:\n{done.stderr[-3000:]}"
    if command.shown is not None:
        assert doctest.OutputChecker().check_output(command.shown, done.stdout, FLAGS), (
            f"{command.where}: `{command.text}` printed\n{done.stdout}\nnot\n{command.shown}"
        )


def test_every_command_not_run_is_listed_with_its_reason_and_every_reason_is_used():
    listed = {start for start in NOT_RUN if any(c.text.startswith(start) for c in all_commands())}
    assert listed == set(NOT_RUN), f"NOT_RUN entries that match no example: {set(NOT_RUN) - listed}"


def docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for info in pkgutil.walk_packages(attnkit.__path__, "attnkit."):
        module = importlib.import_module(info.name)
        found += [t for t in finder.find(module) if t.examples]
    found += [t for t in finder.find(attnkit) if t.examples]
    return sorted(found, key=lambda t: t.name)


@pytest.mark.parametrize("test", docstring_tests(), ids=lambda t: t.name)
def test_the_docstring_examples_run_and_show_their_output(test):
    out = io.StringIO()
    result = doctest.DocTestRunner(optionflags=FLAGS).run(test, out=out.write)
    assert result.failed == 0, out.getvalue()


def test_no_example_is_skipped_by_a_directive():
    pages = [b.body for p in PAGES for b in blocks(p)]
    docstrings = [e.source + e.want for t in docstring_tests() for e in t.examples]
    offenders = [s for s in pages + docstrings if "SKIP" in s]
    assert not offenders, offenders


SPHINX_ROLE = re.compile(r":(func|class|mod|data|meth|attr|exc|obj):`")


@pytest.mark.slow
def test_the_site_builds_strictly_and_shows_no_sphinx_role(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is part of the dev extra"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    pages = list(tmp_path.rglob("*.html"))
    assert len(pages) > 20
    shown = [(p, m.group(0)) for p in pages for m in SPHINX_ROLE.finditer(p.read_text())]
    assert not shown, shown[:10]
