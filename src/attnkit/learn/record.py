"""What a run of [`learn`][attnkit.learn.train.learn] records: the loss curve, every head's role
scores at each of its steps, and at each snapshot the scores and the weights on the sequence the
pictures draw; ``heads.json``; and the closing lines that name the heads that took a role, and
when.

A head *took* a role when its score at the end is at least
[`TOOK_ROLE`][attnkit.learn.record.TOOK_ROLE] (0.5): more than half of its attention, averaged
over the probes' queries, goes where the role says. *When* is not the step at which it crossed
0.5 (a score that ends at 0.55 crosses late in a slow rise, one that ends at 0.95 crosses early in
a fast one, which can tell two heads' order backwards): it is the window in which the score made
most of its rise from step 0 to the end, from the first step at 10% of the rise to the first at
90%, read at every step of the loss curve. The closing lines list the heads in the order their
rise began.

Shapes: ``S`` snapshots, ``C`` steps of the loss curve (step 0 included), ``L`` layers, ``h``
heads, ``t`` tokens of the drawn sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit.learn.roles import ROLES

if TYPE_CHECKING:
    from attnkit.learn.settings import Settings
    from attnkit.learn.tasks import Task

TOOK_ROLE = 0.5
"""A head "took" a role when its score at the end reached this."""

RISE = (0.1, 0.9)
"""The shares of its rise (from step 0 to the end) at which a score's rise begins and ends."""

ROLE_NAMES = {
    "previous_token": "a previous-token head",
    "first_token": "a first-token (sink) head",
    "self": "a self head",
    "induction": "an induction head",
}


@dataclass
class LearnResult:
    """One run: the settings, the loss curve and the snapshots.

    ``scores[role]`` is ``(S, L, h)``; ``weights`` is ``(S, L, h, t, t)``, every head's attention on
    the drawn sequence ``labels``; ``scores_by_step[role]`` is ``(C, L, h)``, at ``score_steps``
    (step 0 and each step of the loss curve). For the copy task, ``loss_repeated`` and
    ``loss_others`` split ``loss`` into the tokens that the first occurrence predicts and the rest.
    """

    settings: Settings
    labels: tuple[str, ...]
    unigram_entropy: float | None = None
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    loss_repeated: list[float] | None = None
    loss_others: list[float] | None = None
    snapshot_steps: list[int] = field(default_factory=list)
    held_out_loss: list[float] = field(default_factory=list)
    score_list: list[dict[str, Tensor]] = field(default_factory=list)
    weight_list: list[Tensor] = field(default_factory=list)
    score_steps: list[int] = field(default_factory=list)
    step_score_list: list[dict[str, Tensor]] = field(default_factory=list)
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    files: list[Path] = field(default_factory=list)  # what was written, with ``out``
    notes: list[str] = field(default_factory=list)  # what was not, and why

    @classmethod
    def start(cls, settings: Settings, task: Task) -> LearnResult:
        copy = task.name == "copy"
        return cls(
            settings,
            task.labels,
            task.unigram_entropy(),
            loss_repeated=[] if copy else None,
            loss_others=[] if copy else None,
        )

    @property
    def task(self) -> str:
        return self.settings.task

    @property
    def scores(self) -> dict[str, Tensor]:
        """``{role: (S, L, h)}``."""
        return {role: torch.stack([s[role] for s in self.score_list]) for role in ROLES}

    @property
    def scores_by_step(self) -> dict[str, Tensor]:
        """``{role: (C, L, h)}``."""
        return {role: torch.stack([s[role] for s in self.step_score_list]) for role in ROLES}

    @property
    def weights(self) -> Tensor:
        return torch.stack(self.weight_list)  # S x (L, h, t, t) -> (S, L, h, t, t)

    def add_losses(self, step: int, losses: list[tuple[float, ...]]) -> None:
        """The mean of a window of steps' losses, after ``step`` updates."""
        means = [sum(column) / len(column) for column in zip(*losses)]
        self.steps.append(step)
        self.loss.append(_round(means[0]))
        if self.loss_repeated is not None and self.loss_others is not None:
            self.loss_repeated.append(_round(means[1]))
            self.loss_others.append(_round(means[2]))

    def add_scores(self, step: int, scores: dict[str, Tensor]) -> None:
        """The role scores ``{role: (L, h)}`` after ``step`` updates."""
        self.score_steps.append(step)
        self.step_score_list.append({role: s.float() for role, s in scores.items()})

    def add_snapshot(
        self, step: int, scores: dict[str, Tensor], weights: Tensor, held_out_loss: float
    ) -> None:
        self.snapshot_steps.append(step)
        self.score_list.append({role: s.float() for role, s in scores.items()})
        self.weight_list.append(weights.float())
        self.held_out_loss.append(_round(held_out_loss))

    def heads_json(self) -> dict:
        """``heads.json``: the task, the loss curve, the snapshot steps and, per head (counted
        from 1), one score per snapshot for each role, and in ``scores_by_step`` one per entry of
        ``score_steps``; the copy task adds the loss on each part, and every task the held-out
        loss at each snapshot."""
        scores, by_step = self.scores, self.scores_by_step
        data: dict = {
            "task": self.task,
            "steps": self.steps,
            "loss": self.loss,
            "snapshot_steps": self.snapshot_steps,
            "heads": [
                {
                    "layer": layer + 1,
                    "head": head + 1,
                    **{
                        role: [_round(v) for v in scores[role][:, layer, head].tolist()]
                        for role in ROLES
                    },
                    "scores_by_step": {
                        role: [_round(v) for v in by_step[role][:, layer, head].tolist()]
                        for role in ROLES
                    },
                }
                for layer in range(self.settings.num_layers)
                for head in range(self.settings.num_heads)
            ],
            "held_out_loss": self.held_out_loss,
            "score_steps": self.score_steps,
        }
        if self.loss_repeated is not None:
            data["loss_repeated"] = self.loss_repeated
            data["loss_others"] = self.loss_others
        return data

    def summary(self) -> list[str]:
        """A few lines: the heads that took a role (a score of at least 0.5 at the end), each with
        the steps of its rise, in the order their rise began; then the losses."""
        found = []
        by_step = self.scores_by_step
        for role in ROLES:
            history = by_step[role]  # (C, L, h)
            for layer, head in (history[-1] >= TOOK_ROLE).nonzero().tolist():
                begun, done = rise(history[:, layer, head].tolist(), self.score_steps)
                when = (
                    f"rose from step {begun} to {done} (10% to 90% of its rise)"
                    if begun is not None
                    else "held from step 0"
                )
                found.append(
                    (
                        begun or 0,
                        f"layer {layer + 1} head {head + 1}: {ROLE_NAMES[role]} "
                        f"({history[0, layer, head]:.2f} at step 0, "
                        f"{history[-1, layer, head]:.2f} at the end), {when}",
                    )
                )
        lines = [line for _, line in sorted(found, key=lambda pair: pair[0])]
        if not lines:
            lines.append(f"no head took a role (a score of {TOOK_ROLE}) yet: try more --steps")
        lines.append(self._loss_line())
        return lines

    def _loss_line(self) -> str:
        line = f"loss {self.loss[-1]:.3f} at the end, {self.held_out_loss[-1]:.3f} held out"
        if self.unigram_entropy is not None:
            ratio = self.held_out_loss[-1] / self.unigram_entropy
            line += f" ({ratio:.2f}x the {self.unigram_entropy:.3f} of character frequencies alone)"
        if self.loss_repeated is not None and self.loss_others is not None:
            line += (
                f"; on the copied tokens {self.loss_repeated[-1]:.3f}, "
                f"on the others {self.loss_others[-1]:.3f}"
            )
        return (
            f"{line}; {self.settings.steps} steps in {self.seconds:.0f} s, "
            f"{self.tokens_per_second:,.0f} tokens/s"
        )


def rise(history: list[float], steps: list[int]) -> tuple[int | None, int | None]:
    """The first step at which ``history`` (a score at each of ``steps``) had made 10% of its rise
    from the first value to the last, and the first at 90%; ``(None, None)`` for a rise under 0.1
    (a score that did not change: the role was held from the start, or never taken)."""
    start, end = history[0], history[-1]
    if end - start < 0.1:
        return None, None
    begun, done = (
        next(step for step, v in zip(steps, history) if v >= start + share * (end - start))
        for share in RISE
    )
    return begun, done


def _round(value: float) -> float:
    return round(float(value), 4)
