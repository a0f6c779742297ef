"""Progress on stderr for long work: a bar (benchmarks, model loading, training) and a line for
work that runs side by side (the C++ kernels' builds)."""

from __future__ import annotations

import sys
import threading
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


class Board:
    """Work that runs side by side (the C++ kernels a build compiles at once, one per thread) and
    one line on stderr while it runs: which items run, how many of this batch are done, and the
    time since the batch began. On a terminal the line is redrawn in place every second; in a log
    a new one is written every ``every`` seconds. The batch ends when nothing runs, and the next
    ``start`` begins another. Messages go through ``say``, which clears the line first.

    Stdlib only: ``attnkit.kernels.build`` uses it, and that module must not import torch to build.
    """

    def __init__(self, every: float = 10.0, prefix: str = "attnkit: ") -> None:
        self.every = every
        self.prefix = prefix
        self._lock = threading.Lock()
        self._running: list[str] = []
        self._done = 0
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = 0  # the width of the line drawn on a terminal, to clear it

    def start(self, name: str) -> None:
        """``name`` runs from now (a batch begins when nothing ran)."""
        with self._lock:
            if not self._running:
                self._done, self._started = 0, time.perf_counter()
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._tick, args=(self._stop,), daemon=True)
                self._thread.start()
            self._running.append(name)

    def finish(self, name: str, message: str | None = None) -> None:
        """``name`` is done (or failed): the line is cleared, then ``message`` written if given."""
        with self._lock:
            self._running.remove(name)
            self._done += 1
            self._clear()
            if message is not None:
                self._write(f"{self.prefix}{message}\n")
            last, stop, thread = not self._running, self._stop, self._thread
            if last:
                stop.set()
        if last and thread is not None and thread is not threading.current_thread():
            thread.join()

    def say(self, message: str) -> None:
        """One line on stderr, the progress line cleared first."""
        with self._lock:
            self._clear()
            self._write(f"{self.prefix}{message}\n")

    def line(self) -> str:
        """What the progress line says now."""
        total = self._done + len(self._running)
        elapsed = time.perf_counter() - self._started
        return (
            f"{self.prefix}compiling {', '.join(self._running)}: {self._done} of {total} done, "
            f"{elapsed:.0f} s so far"
        )

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(1.0 if sys.stderr.isatty() else self.every):
            with self._lock:
                if stop.is_set() or not self._running:
                    return
                line = self.line()
                if sys.stderr.isatty():
                    self._write(f"\r{line:<{self._drawn}}")
                    self._drawn = len(line)
                else:
                    self._write(line + "\n")

    def _clear(self) -> None:
        if self._drawn:
            self._write("\r" + " " * self._drawn + "\r")
            self._drawn = 0

    def _write(self, text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()


BUILDS = Board()
"""The progress line of this process's kernel builds (`attnkit.kernels.build.build`)."""
