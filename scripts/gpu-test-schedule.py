"""How long `make test-gpu` takes under each of pytest-xdist's schedules, replayed from each test's
time on a GPU machine: the busiest worker's seconds, without the workers' start-up.

    python scripts/gpu-test-schedule.py [times] [--workers 16]

``times``: a JSON of ``{"seconds_by_test": {node id: seconds}}`` (the default:
docs/bench/gpu-h100-test-times.json) or the junit report gpu-check.sh leaves in OUT (tests.xml).
Each test keeps its recorded time whichever worker runs it. The order is
the one pytest collects here (``pytest --collect-only -m gpu``), as on the GPU machine. The two
schedules follow pytest-xdist 3.8: ``load`` hands each worker runs of consecutive tests (a quarter
of its share first, then more as its queue runs low); ``worksteal`` splits the tests into one
consecutive share per worker, and a worker with less than two left takes half the longest
queue."""

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_times(path: Path) -> dict[str, float]:
    if path.suffix == ".xml":
        cases = ET.parse(path).getroot().iter("testcase")
        return {  # (a module skipped whole has a case without a class name: not a test that ran)
            f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}": float(c.get("time"))
            for c in cases
            if c.get("classname")
        }
    return json.loads(path.read_text())["seconds_by_test"]


def collection_order() -> list[str]:
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "--collect-only",
         "-q", "tests"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line.strip() for line in listing.splitlines() if "::" in line]


def replay(seconds: list[float], workers: int, schedule: str) -> float:
    """The time at which the last worker finishes, each test taking its recorded seconds."""
    pending = list(range(len(seconds)))
    queues: list[list[int]] = [[] for _ in range(workers)]

    def send(worker: int, count: int) -> None:
        queues[worker].extend(pending[:count])
        del pending[:count]

    for worker in range(workers):  # the first shares
        if schedule == "load":
            send(worker, max(len(seconds) // workers // 4, 2))
        else:
            send(worker, len(pending) // (workers - worker))
    finish = [seconds[q[0]] if q else None for q in queues]  # of each worker's running test
    now = 0.0
    while any(t is not None for t in finish):
        worker = min((w for w, t in enumerate(finish) if t is not None), key=lambda w: finish[w])
        now = finish[worker]
        done = queues[worker].pop(0)
        if schedule == "load" and pending:
            low = max(2, len(pending) // workers // 4)
            high = max(2, len(pending) // workers // 2)
            waits = seconds[done] >= 0.1 and len(queues[worker]) >= 2  # a long test: no more yet
            if len(queues[worker]) < low and not waits:
                send(worker, high - len(queues[worker]))
        elif schedule == "worksteal":
            for idle in (w for w in range(workers) if len(queues[w]) < 2):
                richest = max(range(workers), key=lambda w: len(queues[w]))
                count = min(len(queues[richest]) // 2, len(queues[richest]) - 2)
                if count > 0:
                    queues[idle].extend(queues[richest][-count:])
                    del queues[richest][-count:]
        for w in range(workers):  # a worker that finished a test, or was idle, starts its next
            if w == worker or finish[w] is None:
                finish[w] = now + seconds[queues[w][0]] if queues[w] else None
    return now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("times", nargs="?", type=Path,
                        default=ROOT / "docs/bench/gpu-h100-test-times.json")  # fmt: skip
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    times = test_times(args.times)
    order = [name for name in collection_order() if name in times]
    seconds = [times[name] for name in order]
    found = f"{len(seconds)} of {len(times)} tests found here"
    print(f"{found}; {sum(seconds):.0f} s in all, the longest {max(seconds):.0f} s;")
    print(f"with {args.workers} workers, the busiest takes:")
    for schedule in ("load", "worksteal"):
        print(f"  {schedule:9} {replay(seconds, args.workers, schedule):4.0f} s")


if __name__ == "__main__":
    main()
