"""The durations record of the CPU suite: ``make test`` writes ``build/test-times.xml`` (pytest's
JUnit report); this writes ``docs/bench/test-durations-cpu.json`` (every test's seconds, as the GPU
record has them) and ``docs/bench/test-durations-cpu.md`` (the totals by folder and the slowest
tests). Usage: ``python scripts/test-durations.py build/test-times.xml "<machine>" <make test's
seconds> ["<how it ran>"]``."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    report, machine, wall = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    run = sys.argv[4] if len(sys.argv) > 4 else "make test on a fresh clone, 2 cores"
    seconds: dict[str, float] = {}
    skipped = failed = 0
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        name = f"{path}.py::{case.get('name')}"
        seconds[name] = round(float(case.get("time", 0)), 3)
        skipped += case.find("skipped") is not None
        failed += case.find("failure") is not None or case.find("error") is not None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {
        "machine": machine,
        "date": str(date.today()),
        "commit": commit,
        "run": run,
        "pytest_seconds": round(sum(seconds.values()), 1),
        "make_test_seconds": wall,
        "seconds_by_test": dict(sorted(seconds.items())),
    }
    out = ROOT / "docs" / "bench"
    (out / "test-durations-cpu.json").write_text(json.dumps(record, indent=0) + "\n")
    folders: dict[str, float] = defaultdict(float)
    for name, s in seconds.items():
        parts = name.split("::")[0].split("/")
        folders["/".join(parts[:2]) if len(parts) > 2 else "tests/"] += s
    lines = [
        f"# The CPU suite's durations: {machine}, {record['date']}",
        "",
        f"{run}, at {commit}: `make test` {wall / 60:.1f} min in all; pytest's tests",
        f"{record['pytest_seconds'] / 60:.1f} min,",
        f"{len(seconds) - skipped - failed} passed, {skipped} skipped, {failed} failed. Every test's",
        "seconds: [test-durations-cpu.json](test-durations-cpu.json) (`scripts/test-durations.py`).",
        "",
        "| folder | seconds |",
        "|---|---:|",
        *(f"| `{f}` | {s:.0f} |" for f, s in sorted(folders.items(), key=lambda x: -x[1])),
        "",
        "The 20 slowest tests:",
        "",
        "| test | seconds |",
        "|---|---:|",
        *(f"| `{n}` | {s:.1f} |" for n, s in sorted(seconds.items(), key=lambda x: -x[1])[:20]),
        "",
    ]
    (out / "test-durations-cpu.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
