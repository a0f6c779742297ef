"""The progress bar: redrawn on a terminal, a line per tenth in a log, or silent for short work;
and the line of work that runs side by side (the kernels' builds)."""

from __future__ import annotations

import io
import re
import sys
import time

from attnkit._progress import Board, Progress


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


def test_a_board_repeats_its_line_in_a_log_while_work_runs(capsys):
    board = Board(every=0.1)
    board.start("a.cpp")
    board.start("b.cpp")
    time.sleep(0.35)
    board.finish("a.cpp", "built a.cpp in 1 s")
    time.sleep(0.35)
    board.finish("b.cpp", "built b.cpp in 1 s")
    lines = capsys.readouterr().err.splitlines()
    done = lines.index("attnkit: built a.cpp in 1 s")
    assert lines[-1] == "attnkit: built b.cpp in 1 s"
    before, after = lines[:done], lines[done + 1 : -1]
    assert before and all(
        re.fullmatch(r"attnkit: compiling a\.cpp, b\.cpp: 0 of 2 done, \d+ s so far", line)
        for line in before
    ), before
    assert after and all(
        re.fullmatch(r"attnkit: compiling b\.cpp: 1 of 2 done, \d+ s so far", line)
        for line in after
    ), after
    time.sleep(0.3)
    assert capsys.readouterr().err == ""  # the batch is over: silence


def test_a_board_redraws_in_place_on_a_terminal_and_clears_before_a_message(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    board = Board()
    board.start("tiled.cpp")
    time.sleep(2.6)  # a terminal's line is redrawn every second
    board.say("a message")
    board.finish("tiled.cpp", "built tiled.cpp in 2 s")
    text = terminal.getvalue()
    drawn = re.findall(r"\r(attnkit: compiling tiled\.cpp: 0 of 1 done, (\d+) s so far)", text)
    assert len(drawn) >= 2 and int(drawn[-1][1]) >= 2
    assert "\n" not in text.split("attnkit: a message")[0]  # the progress line takes no new lines
    width = len(drawn[-1][0])
    assert text.endswith(f"\r{' ' * width}\rattnkit: a message\nattnkit: built tiled.cpp in 2 s\n")


def test_a_new_batch_counts_afresh(capsys):
    board = Board(every=0.1)
    board.start("a.cpp")
    board.finish("a.cpp")
    board.start("b.cpp")
    time.sleep(0.25)
    board.finish("b.cpp")
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("attnkit: compiling b.cpp: 0 of 1 done") for line in lines)
