"""What a run of [`learn`][attnkit.learn.train.learn] records: the loss curve, and at each snapshot
every head's role scores and its weights on the sequence the pictures draw; ``heads.json``; and
the closing lines that name the heads that took a role, and when.

Shapes: ``S`` snapshots, ``L`` layers, ``h`` heads, ``t`` tokens of the drawn sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnkit.learn.roles import ROLES

if TYPE_CHECKING:
    from attnkit.learn.tasks import Task
    from attnkit.learn.train import Settings

TOOK_ROLE = 0.5  # a head "took" a role once its score reached this
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
    the drawn sequence ``labels``. For the copy task, ``loss_repeated`` and ``loss_others`` split
    ``loss`` into the tokens that the first occurrence predicts and the rest.
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

    def add_snapshot(
        self, step: int, scores: dict[str, Tensor], weights: Tensor, held_out_loss: float
    ) -> None:
        self.snapshot_steps.append(step)
        self.score_list.append({role: s.float() for role, s in scores.items()})
        self.weight_list.append(weights.float())
        self.held_out_loss.append(_round(held_out_loss))

    def heads_json(self) -> dict:
        """``heads.json``: the task, the loss curve, the snapshot steps and, per head (counted
        from 1), one score per snapshot for each role; the copy task adds the loss on each part,
        and every task the held-out loss at each snapshot."""
        scores = self.scores
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
                }
                for layer in range(self.settings.num_layers)
                for head in range(self.settings.num_heads)
            ],
            "held_out_loss": self.held_out_loss,
        }
        if self.loss_repeated is not None:
            data["loss_repeated"] = self.loss_repeated
            data["loss_others"] = self.loss_others
        return data

    def summary(self) -> list[str]:
        """A few lines: the heads that took a role (a score of at least 0.5 at the end), the first
        snapshot at which they had it, and the losses."""
        lines = []
        scores = self.scores
        for role in ROLES:
            final = scores[role][-1]  # (L, h)
            for layer, head in (final >= TOOK_ROLE).nonzero().tolist():
                history = scores[role][:, layer, head]
                first = next(i for i, s in enumerate(history.tolist()) if s >= TOOK_ROLE)
                lines.append(
                    f"layer {layer + 1} head {head + 1}: {ROLE_NAMES[role]} "
                    f"({history[0]:.2f} at step 0, {final[layer, head]:.2f} at the end), "
                    f"from step {self.snapshot_steps[first]}"
                )
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


def _round(value: float) -> float:
    return round(float(value), 4)
