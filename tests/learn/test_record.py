"""What a run records: the closing lines that say when each head took its role."""

from __future__ import annotations

import pytest
import torch

from attnkit.learn import Settings
from attnkit.learn.record import LearnResult, rise
from attnkit.learn.roles import ROLES

STEPS = list(range(0, 1001, 10))


def ramp(low: float, high: float, begin: int, end: int) -> list[float]:
    """A score at ``low`` until step ``begin``, rising linearly to ``high`` at step ``end``."""
    return [low + (high - low) * min(max((s - begin) / (end - begin), 0.0), 1.0) for s in STEPS]


def recorded(histories: dict[tuple[str, int, int], list[float]]) -> LearnResult:
    """A run of 2 layers of 1 head whose scores at each step of the loss curve are ``histories``
    (``(role, layer, head)`` from 0; every other score 0.1)."""
    settings = Settings.for_task("copy", steps=STEPS[-1], num_layers=2, num_heads=1)
    result = LearnResult(settings, ("a", "b"), loss=[1.0], held_out_loss=[1.0])
    for k, step in enumerate(STEPS):
        scores = {role: torch.full((2, 1), 0.1) for role in ROLES}
        for (role, layer, head), history in histories.items():
            scores[role][layer, head] = history[k]
        result.add_scores(step, scores)
        if step in (0, STEPS[-1]):  # two snapshots, at the ends
            result.add_snapshot(step, scores, torch.eye(2).expand(2, 1, 2, 2), 1.0)
    return result


def test_the_closing_lines_say_when_each_rise_began_in_that_order():
    """The order the heads began to take their roles, not the order they crossed 0.5: this
    previous-token head crosses 0.5 long before the induction head does, yet the induction head
    began to rise first (a fixed threshold told the issue's run backwards)."""
    result = recorded(
        {
            ("previous_token", 0, 0): ramp(0.1, 0.95, 305, 405),  # crosses 0.5 at step 352
            ("induction", 1, 0): ramp(0.04, 0.6, 95, 895),  # crosses 0.5 at step 752
        }
    )
    lines = result.summary()
    assert lines[0] == (
        "layer 2 head 1: an induction head (0.04 at step 0, 0.60 at the end), "
        "rose from step 180 to 820 (10% to 90% of its rise)"
    )
    assert lines[1] == (
        "layer 1 head 1: a previous-token head (0.10 at step 0, 0.95 at the end), "
        "rose from step 320 to 400 (10% to 90% of its rise)"
    )
    assert len(lines) == 3 and lines[2].startswith("loss 1.000 at the end")


def test_a_role_held_from_the_start_says_so():
    result = recorded({("self", 1, 0): [0.9] * len(STEPS)})
    assert result.summary()[0].endswith(
        "a self head (0.90 at step 0, 0.90 at the end), held from step 0"
    )


def test_no_role_taken_says_to_train_longer():
    assert "try more --steps" in recorded({}).summary()[0]


@pytest.mark.parametrize(
    "history, expected",
    [
        ([0.0, 0.05, 0.5, 0.95, 1.0], (20, 30)),  # 0.1 first reached at step 20, 0.9 at step 30
        ([0.2, 0.25, 0.22, 0.28], (None, None)),  # a rise under 0.1: no window
        ([0.0, 1.0, 0.4, 0.5], (10, 10)),  # a score that overshoots: its first crossings
    ],
)
def test_rise_is_the_first_steps_at_10_and_90_percent(history, expected):
    steps = [10 * k for k in range(len(history))]
    assert rise(history, steps) == expected


def test_heads_json_holds_the_scores_at_every_step_of_the_loss_curve():
    result = recorded({("induction", 1, 0): ramp(0.04, 0.6, 100, 900)})
    data = result.heads_json()
    assert data["score_steps"] == STEPS
    head = data["heads"][1]
    assert (head["layer"], head["head"]) == (2, 1)
    assert head["scores_by_step"]["induction"] == [round(v, 4) for v in ramp(0.04, 0.6, 100, 900)]
    assert set(head["scores_by_step"]) == set(ROLES)
