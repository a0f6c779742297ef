"""The counting half of the peer-suite plugins: wrap a stand-in so that every call is counted,
print the counts when pytest ends, write them to ``$ATTNKIT_PEER_REPORT`` (JSON) and fail a run
in which a stand-in was never called, so that a substitution that silently did not happen
(a name the tests look up elsewhere, a fast path that bypasses it) cannot pass for a clean run.

Used by ``attnkit_mha.py``, ``attnkit_sdpa.py`` and ``attnkit_hf.py`` (scripts/peer-suites.sh
loads one of them with ``-p``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any

import pytest


class Counter:
    """Counts the calls of one stand-in: ``calls``, and ``reentered``, the calls made while a call
    of the same stand-in was still running (a stand-in that calls the function it replaced, looked
    up again by name, lands back in itself: that is the count of such recursions).

    Plain attributes, not thread-locals: ``torch.compile`` traces these increments as side effects
    on a Python object, so a compiled region still counts, and nothing here breaks its graph.
    """

    def __init__(self, name: str, replaces: str) -> None:
        self.name = name
        self.replaces = replaces
        self.calls = 0
        self.reentered = 0
        self._depth = 0

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, counted."""
        self.calls += 1
        if self._depth:
            self.reentered += 1
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with every call counted (same name and docstring; for code that only calls it
        from Python: TorchScript cannot compile the ``*args`` of the wrapper, see attnkit_sdpa)."""

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            return self.call(fn, *args, **kwargs)

        return counted

    def reset(self) -> None:
        self.calls = self.reentered = self._depth = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "stand_in": self.name,
            "replaces": self.replaces,
            "calls": self.calls,
            "reentered": self.reentered,
        }


COUNTERS: list[Counter] = []


def counter(name: str, replaces: str) -> Counter:
    """A new counter, reported at the end of the session."""
    made = Counter(name, replaces)
    COUNTERS.append(made)
    return made


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.section("attnkit stand-ins")
    for each in COUNTERS:
        note = f", {each.reentered} re-entered" if each.reentered else ""
        terminalreporter.write_line(f"{each.name} (for {each.replaces}): {each.calls} calls{note}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the report; a session whose tests ran but never called a stand-in fails."""
    path = os.environ.get("ATTNKIT_PEER_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "counters": [each.as_dict() for each in COUNTERS],
                    "tests_collected": session.testscollected,
                },
                f,
                indent=2,
            )
    never = [each.name for each in COUNTERS if each.calls == 0]
    if session.testscollected and never:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(
            f"\nattnkit stand-ins never called: {', '.join(never)}: the substitution did not happen"
        )
