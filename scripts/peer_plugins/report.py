"""The record of a peer-suite run (scripts/peer-suites.sh): reads the JUnit XML and the stand-in
counts that each run left in OUT and prints Markdown: per suite and run, passed / failed / skipped
and the stand-in's calls; then every test that passes in the suite's baseline (without attnkit) and
fails with attnkit, with the first line of its error.

    usage: python scripts/peer_plugins/report.py OUT

A run is OUT/<suite>.<run>.xml (run ``baseline`` is the one without attnkit) with its counts in
OUT/<suite>.<run>.count.json.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BASELINE = "baseline"


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first line of its error)}``; outcome ``passed``, ``failed``,
    ``error`` or ``skipped``."""
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = first_line(found.get("message") or found.text or "")
                break
        if test in results and results[test][0] != "passed":
            continue  # a teardown error after a failure: keep the first
        results[test] = (outcome, message)
    return results


def first_line(text: str) -> str:
    """The error's first line; with the next one when the first only names the exception
    (``RuntimeError:``, its message on the lines below)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    if re.fullmatch(r"[\w.]+:", lines[0]) and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def counts(results: dict[str, tuple[str, str]]) -> dict[str, int]:
    tally = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome, _ in results.values():
        tally[outcome] += 1
    return tally


def stand_ins(path: Path) -> str:
    if not path.exists():
        return ""
    report = json.loads(path.read_text(encoding="utf-8"))
    parts = []
    for each in report["counters"]:
        again = f", {each['reentered']} re-entered" if each["reentered"] else ""
        parts.append(f"{each['stand_in']}: {each['calls']}{again}")
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    runs: dict[str, dict[str, Path]] = {}
    for xml in sorted(out.glob("*.xml")):
        suite, _, run = xml.stem.partition(".")
        runs.setdefault(suite, {})[run] = xml
    print("| suite | run | passed | failed | errors | skipped | stand-in calls |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    regressions: list[tuple[str, str, str, str]] = []
    for suite, by_run in runs.items():
        base = outcomes(by_run[BASELINE]) if BASELINE in by_run else {}
        for run in sorted(by_run, key=lambda name: (name != BASELINE, name)):
            results = base if run == BASELINE else outcomes(by_run[run])
            tally = counts(results)
            calls = stand_ins(out / f"{suite}.{run}.count.json") if run != BASELINE else "-"
            print(
                f"| {suite} | {run} | {tally['passed']} | {tally['failed']} | {tally['error']} "
                f"| {tally['skipped']} | {calls} |"
            )
            if run == BASELINE:
                continue
            for test, (outcome, message) in results.items():
                if base.get(test, ("",))[0] == "passed" and outcome in ("failed", "error"):
                    regressions.append((suite, run, test, message))
    print()
    print(f"Tests that pass without attnkit and fail with it: {len(regressions)}")
    print()
    for suite, run, test, message in regressions:
        print(f"- `{suite}` / `{run}`: `{test}`: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
