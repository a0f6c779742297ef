"""A one-line progress bar on stderr, for long work (benchmarks, model loading)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Progress:
    """A one-line progress bar on stderr: redrawn in place on a terminal, one line per tenth in a
    log; ``quiet_unless_tty`` keeps short work silent outside a terminal."""

    total: int
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    quiet_unless_tty: bool = False
    time_left: bool = False  # also show the time left, from the pace so far

    def step(self, label: str = "") -> None:
        before = 10 * self.done // max(self.total, 1)
        self.done += 1
        width = 28
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.started
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:6.0f} s"
        if self.time_left:
            left = elapsed / self.done * max(self.total - self.done, 0)
            line += f", {left:.0f} s left"
        if self.stream.isatty():
            end = "\n" if self.done >= self.total else ""
            self.stream.write(f"\r{line}  {label[:48]:<48}{end}")
        elif (
            not self.quiet_unless_tty and 10 * self.done // max(self.total, 1) > before
        ):  # a log: one line per tenth
            self.stream.write(f"{line}  {label}\n")
        self.stream.flush()
