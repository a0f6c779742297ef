"""One ``attnkit learn`` run's settings, with each task's defaults and the bounds they are
checked against."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from attnkit import _checks
from attnkit.learn.tasks import MIN_SEGMENT, PROBES

TASKS = ("text", "copy")


@dataclass(frozen=True)
class Settings:
    """One run's settings. ``Settings.for_task`` fills in the task's defaults."""

    task: str
    steps: int
    num_layers: int
    num_heads: int
    emb_dim: int
    context_length: int
    feed_forward: bool  # False: the attention-only model
    seed: int = 123
    batch_size: int = 32
    lr: float = 3e-3  # the peak learning rate
    warmup: int = 100  # steps of linear warm-up
    weight_decay: float = 0.1  # on the weight matrices and embeddings, not on norms and biases
    snapshots: int = 25  # snapshots after step 0, evenly spaced

    @classmethod
    def for_task(cls, task: str, **given: object) -> Settings:
        """The task's defaults, with every setting in ``given`` that is not None."""
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        settings = replace(DEFAULTS[task], **{k: v for k, v in given.items() if v is not None})
        for name in ("steps", "num_layers", "num_heads", "emb_dim"):
            _checks.check_positive_int(getattr(settings, name), name)
        if settings.emb_dim % settings.num_heads:
            raise ValueError(
                f"dim ({settings.emb_dim}) must be divisible by heads ({settings.num_heads})"
            )
        _check_context(settings)
        return settings

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_length


DEFAULTS = {
    # characters of English: two full blocks find the previous character and common words
    "text": Settings("text", 2000, 2, 4, 64, 64, True),
    # induction heads form fastest in an attention-only model (Olsson et al., 2022) and in short
    # sequences, where the repeated segment is a large share of the tokens
    "copy": Settings("copy", 4000, 2, 4, 64, 32, False),
}


MIN_CONTEXT = {"text": 2, "copy": 2 * MIN_SEGMENT}
"""The shortest context of each task: a token and the next one; the copy task's shortest segment
written twice."""

SNAPSHOT_BYTES = 1 << 30
"""What a snapshot's weights may take: every head's ``(t, t)`` weights on the probes and on the
sequences written twice, in float32. It bounds ``--context``."""


def max_context(num_layers: int, num_heads: int) -> int:
    """The longest context whose snapshot weights fit in
    [`SNAPSHOT_BYTES`][attnkit.learn.settings.SNAPSHOT_BYTES]."""
    sequences = 2 * PROBES + 1  # the probes with the drawn sequence, then the repeated probes
    return math.isqrt(SNAPSHOT_BYTES // (4 * sequences * num_layers * num_heads))


def _check_context(settings: Settings) -> None:
    context = settings.context_length
    if isinstance(context, bool) or not isinstance(context, int):
        raise TypeError(f"--context must be an int, got {type(context).__name__}")
    low = MIN_CONTEXT[settings.task]
    if context < low:
        raise ValueError(f"--context must be >= {low} for --task {settings.task}, got {context}")
    high = max_context(settings.num_layers, settings.num_heads)
    if context > high:
        layers, heads = settings.num_layers, settings.num_heads
        raise ValueError(
            f"--context must be <= {high} with {layers} layers of {heads} heads, got {context}: "
            f"each snapshot holds every head's t x t weights on {2 * PROBES + 1} sequences, "
            f"at most {SNAPSHOT_BYTES >> 30} GiB"
        )
