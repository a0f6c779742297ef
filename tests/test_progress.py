"""The progress bar: redrawn on a terminal, a line per tenth in a log, or silent for short work."""

from __future__ import annotations

import io
import time

from attnkit._progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_tenth():
    stream = io.StringIO()
    progress = Progress(20, stream)
    for _ in range(20):
        progress.step("x")
    assert stream.getvalue().count("\n") == 10
    assert "[############################] 20/20" in stream.getvalue()


def test_quiet_unless_tty():
    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        progress = Progress(3, stream, quiet_unless_tty=True)
        for _ in range(3):
            progress.step("loading")
    assert log.getvalue() == ""
    assert terminal.getvalue().count("\r") == 3 and terminal.getvalue().endswith("\n")


def test_time_left_follows_the_pace_so_far():
    stream = io.StringIO()
    started = time.perf_counter() - 5.0  # 5 s spent before the first step
    progress = Progress(10, stream, started=started, time_left=True)
    progress.step("x")  # 1 of 10 done in about 5 s: about 45 s left
    left = float(stream.getvalue().split(", ")[1].split(" s left")[0])
    assert 44 <= left <= 47
