"""The pictures of a run (the 'plots' extra, matplotlib): the loss curve with the snapshots marked,
and every head's attention at the last snapshot, one heatmap per head.

Shapes: ``S`` snapshots, ``L`` layers, ``h`` heads, ``t`` tokens of the drawn sequence.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from attnkit.learn.record import LearnResult
from attnkit.learn.roles import SCORES
from attnkit.learn.tasks import PROBES
from attnkit.views import draw_heatmap, pyplot, save_figure


def plot_loss(result: LearnResult, path: str | Path) -> Path:
    """The training loss by step (for the copy task also on the copied tokens and the others), the
    held-out loss at each snapshot, and a dotted line at each snapshot."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(result.steps, result.loss, label="training loss", color="tab:blue")
    if result.loss_repeated is not None:
        ax.plot(result.steps, result.loss_repeated, label="on the copied tokens", color="tab:green")
        ax.plot(result.steps, result.loss_others, label="on the other tokens", color="tab:gray")
    ax.plot(
        result.snapshot_steps,
        result.held_out_loss,
        "o",
        ms=3,
        color="tab:red",
        label="held out, at each snapshot",
    )
    for step in result.snapshot_steps:
        ax.axvline(step, color="tab:red", alpha=0.15, linestyle=":")
    if result.unigram_entropy is not None:
        ax.axhline(
            result.unigram_entropy,
            color="black",
            linestyle="--",
            linewidth=0.8,
            label="character frequencies alone",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"attnkit learn --task {result.task}")
    ax.legend(fontsize="small")
    return save_figure(fig, plt, path)


def plot_heads(result: LearnResult, path: str | Path) -> Path:
    """Every head's weights on the drawn sequence at the last snapshot: a row per layer."""
    return save_figure(heads_figure(result), pyplot(), path)


def heads_figure(result: LearnResult):
    """The figure of [`plot_heads`][attnkit.learn.pictures.plot_heads]. Each head's title names
    its highest role score at the end twice: the mean over the held-out probes (the score the
    closing lines and ``heads.json`` give) and on the sequence drawn, which is one sequence and
    can differ."""
    plt = pyplot()
    weights = result.weights[-1]  # (L, h, t, t)
    layers, heads, t = weights.shape[0], weights.shape[1], weights.shape[-1]
    side = max(3.0, 0.42 * t)  # wide enough for each value in its cell
    fig, axes = plt.subplots(
        layers,
        heads,
        figsize=(side * heads, side * layers + 0.6),
        squeeze=False,
        layout="constrained",
    )
    scores = {role: s[-1] for role, s in result.scores.items()}  # (L, h) each
    for layer in range(layers):
        for head in range(heads):
            best = max(scores, key=lambda role: scores[role][layer, head].item())
            title = (
                f"layer {layer + 1} head {head + 1}\n"
                f"{best.replace('_', '-')} {scores[best][layer, head]:.2f} on the probes"
            )
            here = drawn_score(result, best, weights[layer, head])
            if here is not None:
                title += f", {here:.2f} here"
            # the first query can only attend to itself (weight 1): the colours leave it out
            high = weights[layer, head, 1:].max().item()
            draw_heatmap(axes[layer, head], weights[layer, head], result.labels, title, high=high)
    fig.suptitle(
        f"every head at step {result.snapshot_steps[-1]} (queries down, keys across); above each, "
        f"its highest role score: the mean over {PROBES} held-out probes, and on this sequence"
    )
    return fig


def drawn_score(result: LearnResult, role: str, weights: Tensor) -> float | None:
    """``role``'s score on the drawn sequence's weights ``(t, t)``; None for the induction score of
    a sequence that is not written twice (the text task's)."""
    if role == "induction" and result.task != "copy":
        return None
    return SCORES[role](weights).item()
