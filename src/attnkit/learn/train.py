"""Train the book's GPT on a CPU and take snapshots of its heads as it learns.

[`learn`][attnkit.learn.train.learn] is ``attnkit learn`` as a function. It trains a
[`GPTModel`][attnkit.models.gpt.GPTModel] with AdamW (a short linear warm-up, then a cosine decay
of the learning rate to a tenth) and, at regular steps, the first of them step 0 (before any
update), runs the model on held-out probes to read every head's attention weights and score its
roles ([`attnkit.learn.roles`][attnkit.learn.roles]); at every step of the loss curve between them
it scores the roles too, keeping no weights, so that the closing lines can say when each rose.

The same seed, on the same machine with the same number of threads (one unless asked), gives the
same numbers: the weights, the batches and the probes each come from their own seeded generator.

Shapes: ``b`` batch, ``t`` tokens, ``L`` layers, ``h`` heads, ``S`` snapshots.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import _checks
from attnkit._progress import Progress
from attnkit.force import forced
from attnkit.learn.outputs import check_out, write_outputs
from attnkit.learn.record import LearnResult
from attnkit.learn.roles import role_scores
from attnkit.learn.settings import Settings
from attnkit.learn.tasks import Task, make_task
from attnkit.models.gpt import GPTModel


def learning_rate(step: int, settings: Settings) -> float:
    """Linear warm-up to ``lr``, then a cosine decay to ``lr / 10`` at the last step."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    done = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def snapshot_steps(steps: int, count: int) -> list[int]:
    """Step 0, then ``count`` steps spaced evenly up to ``steps`` (fewer when ``steps`` is small)."""
    return sorted({round(i * steps / count) for i in range(count + 1)})


def learn(
    task: str = "text",
    *,
    text: str | Path | None = None,
    steps: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
    dim: int | None = None,
    context: int | None = None,
    seed: int = 123,
    attention_only: bool | None = None,
    out: str | Path | None = None,
    progress: bool | TextIO = True,
    threads: int | None = 1,
) -> LearnResult:
    """Train a small GPT on ``task`` and record how its heads specialise.

    Args:
        task: ``"text"`` (English characters) or ``"copy"`` (a repeated random segment).
        text: ``"text"`` only: a UTF-8 file to learn instead of CPython's help topics.
        steps: training steps (updates).
        layers: transformer blocks.
        heads: heads per block.
        dim: embedding width, divisible by ``heads``.
        context: tokens per training sequence.
        seed: the seed of the weights, the batches and the probes.
        attention_only: blocks without feed-forward networks (the copy task's default).
        out: a new or empty folder to write ``heads.json``, the pictures and the page into
            ([`attnkit.learn.write_outputs`][attnkit.learn.outputs.write_outputs]).
        progress: a progress bar on stderr (True), on another stream, or none (False).
        threads: the CPU threads of the training (None: torch's setting as it is). One by
            default: a model this small gains little from a second thread, and where another
            program keeps a core busy, threads that wait for each other make the run several
            times slower.

    Returns:
        A [`LearnResult`][attnkit.learn.record.LearnResult].

    Raises:
        ValueError: an unknown task, a size below 1, ``dim`` not divisible by ``heads``, a
            ``context`` outside the task's bounds, a missing or empty text file, a text shorter
            than two contexts, or an ``out`` that is not empty or cannot be written.
        TypeError: a size or ``threads`` that is not an int.
    """
    feed_forward = None if attention_only is None else not attention_only
    settings = Settings.for_task(
        task,
        steps=steps,
        num_layers=layers,
        num_heads=heads,
        emb_dim=dim,
        context_length=context,
        feed_forward=feed_forward,
        seed=seed,
    )
    if text is not None and task != "text":
        raise ValueError("a text file is for --task text")
    if threads is not None:
        _checks.check_positive_int(threads, "threads")
    folder = None if out is None else check_out(out)
    stream = sys.stderr if progress is True else progress or None
    data = make_task(task, text, settings.context_length, seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        result = train(settings, data, stream)
    finally:
        torch.set_num_threads(before)
    if folder is not None:
        result.files, result.notes = write_outputs(result, folder)
    return result


def train(settings: Settings, task: Task, progress: TextIO | None = None) -> LearnResult:
    """The training loop: ``settings.steps`` updates, with snapshots of the heads on the way."""
    torch.manual_seed(settings.seed)
    model = GPTModel(
        task.vocab_size,
        settings.context_length,
        settings.emb_dim,
        settings.num_heads,
        settings.num_layers,
        feed_forward=settings.feed_forward,
    )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms and biases
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(0.9, 0.99),
    )
    batches = torch.Generator().manual_seed(settings.seed + 1)
    result = LearnResult.start(settings, task)
    when = set(snapshot_steps(settings.steps, settings.snapshots))
    bar = None if progress is None else Progress(settings.steps, progress, time_left=True)
    started = time.perf_counter()
    window = max(1, settings.steps // 250)  # the loss curve: the mean of each window of steps
    # the role scores at each step of the loss curve too: when a head's score rose, to a window
    scored = {0, settings.steps, *range(window, settings.steps + 1, window)}
    losses = []
    for step in range(settings.steps + 1):
        if step in when or step in scored:
            snapshot(model, task, step, result, keep=step in when)
        if step == settings.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        tokens, copied = task.batch(settings.batch_size, batches)  # (b, t + 1) each
        logits = model(tokens[:, :-1])  # (b, t) -> (b, t, V)
        token_losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss = token_losses.mean()  # (b, t) -> ()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(_split_loss(token_losses.detach(), copied))
        if len(losses) == window or step == settings.steps - 1:
            result.add_losses(step + 1, losses)
            losses = []
        if bar is not None:
            seconds = time.perf_counter() - started
            rate = (step + 1) * settings.tokens_per_step / seconds
            bar.step(f"step {step + 1}, loss {loss.item():.3f}, {rate:,.0f} tokens/s")
    result.seconds = time.perf_counter() - started
    result.tokens_per_second = settings.steps * settings.tokens_per_step / result.seconds
    return result


def _split_loss(token_losses: Tensor, copied: Tensor | None) -> tuple[float, ...]:
    """The batch's mean loss and, for the copy task, the means on the copied tokens and the
    rest (``copied`` ``(b, t + 1)``: the first token is never a target)."""
    if copied is None:
        return (token_losses.mean().item(),)
    targets = copied[:, 1:]  # (b, t + 1) -> (b, t), aligned with the losses
    return (
        token_losses.mean().item(),
        token_losses[targets].mean().item(),
        token_losses[~targets].mean().item(),
    )


@torch.no_grad()
def snapshot(
    model: GPTModel, task: Task, step: int, result: LearnResult, keep: bool = True
) -> None:
    """Every head's role scores on the held-out probes at ``step``; with ``keep``, a snapshot:
    also the weights on the drawn sequence and the held-out loss."""
    model.eval()
    # The drawn sequence rides along with the probes: each pass reads 16 sequences or more (a
    # pass of 16 tokens or fewer without gradients would go to the decode kernel's products and
    # build it, half a minute or more of a 2-core machine), and the tiled backend's PyTorch loop
    # gives the weights without building its C++ kernel either.
    with forced("tiled:loop"):
        inputs = torch.cat([task.probes[:, :-1], task.shown])  # (p + 1, t)
        logits, attn_weights = model(inputs, need_weights=True)  # (L, p + 1, h, t, t)
        _, repeated_weights = model(task.repeated, need_weights=True)
    model.train()
    n = len(task.labels)
    # causal: the weights among a sequence's first n tokens are those of the n tokens alone
    shown_weights = attn_weights[:, -1, :, :n, :n]  # (L, h, n, n)
    held_out = F.cross_entropy(logits[:-1].transpose(1, 2), task.probes[:, 1:]).item()
    scores = role_scores(attn_weights[:, :-1], repeated_weights)
    result.add_scores(step, scores)
    if keep:
        result.add_snapshot(step, scores, shown_weights, held_out)
