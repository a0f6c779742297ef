"""Pictures of attention weights: a heatmap table (Jupyter's ``_repr_html_``), PNG heatmaps
(matplotlib), and a self-contained interactive HTML head view.

Every piece of text that reaches HTML (tokens, titles) is escaped: tokens travel as JSON inside a
``<script type="application/json">`` with ``<``, ``>`` and ``&`` written as ``\\u003c`` escapes, and the
page's script puts them into the document with ``textContent``, never as markup.

Shapes: ``L`` layers, ``h`` heads, ``t`` query tokens, ``s`` key tokens.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor


def heatmap_table(weights: Tensor, rows: Sequence[str], cols: Sequence[str], caption: str) -> str:
    """An HTML table of ``weights`` ``(t, s)``, each cell shaded by its weight, the largest weight
    darkest (the shades are scaled to the data, so small weights still differ)."""
    cells = []
    high = max(weights.max().item(), 1e-12)
    for label, row in zip(rows, weights.tolist()):
        tds = "".join(
            f'<td style="background:rgba(31,119,180,{w / high:.3f});'
            f"color:{'#fff' if w / high > 0.5 else '#000'}"
            f';padding:2px 6px;text-align:right">{w:.2f}</td>'
            for w in row
        )
        cells.append(f'<tr><th style="text-align:left">{html.escape(label)}</th>{tds}</tr>')
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    return (
        f'<table style="border-collapse:collapse;font-family:monospace">'
        f"<caption>{html.escape(caption)}</caption><tr><th></th>{head}</tr>{''.join(cells)}</table>"
    )


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or a clear error without the extra."""
    try:
        import matplotlib
    except ImportError as error:
        raise ModuleNotFoundError("plots need matplotlib: pip install 'attnkit[plots]'") from error
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


CELL_TEXT_INCHES = 0.25  # a cell at least this wide shows its value (2 decimals at 6 points)


def draw_heatmap(
    ax,
    weights: Tensor,
    tokens: Sequence[str],
    title: str,
    labels: bool = True,
    *,
    high: float | None = None,
) -> object:
    """Weights ``(t, s)`` on ``ax``, the colours scaled from the smallest weight to the largest
    (or to ``high``, above which cells take the darkest colour), as the book's figures are, and
    each value but exact zeros (masked cells) written in its cell where it fits."""
    values = weights.float()
    low = values.min().item()
    high = values.max().item() if high is None else high
    image = ax.imshow(values.numpy(), cmap="Blues", vmin=low, vmax=max(high, low + 1e-6))
    ax.set_title(title, fontsize="small")
    ticks = range(len(tokens))
    if labels:
        ax.set_xticks(ticks, tokens, rotation=90, fontsize="x-small")
        ax.set_yticks(ticks, tokens, fontsize="x-small")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    cell_inches = ax.get_position().width * ax.figure.get_figwidth() / max(values.shape[1], 1)
    if cell_inches >= CELL_TEXT_INCHES:
        size = min(9.0, 6.0 * cell_inches / CELL_TEXT_INCHES)  # larger cells, larger figures
        middle = (low + high) / 2
        for i, row in enumerate(values.tolist()):
            for j, w in enumerate(row):
                if w == 0.0:  # a masked cell (a causal head's future): left blank
                    continue
                colour = "white" if w > middle else "black"  # readable on dark and light cells
                ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=size, color=colour)
    return image


def plot_head(weights: Tensor, tokens: Sequence[str], path: str | Path, title: str) -> Path:
    """One head's weights ``(t, t)`` as a heatmap, queries down and keys across, to a PNG."""
    plt = pyplot()
    size = 2.5 + 0.45 * len(tokens)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    image = draw_heatmap(ax, weights, tokens, title)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.colorbar(image, ax=ax, fraction=0.046)
    return save_figure(fig, plt, path)


def plot_layer(attentions: Tensor, tokens: Sequence[str], path: str | Path, title: str) -> Path:
    """Every head of one layer ``(h, t, t)`` as a grid of heatmaps, to a PNG."""
    plt = pyplot()
    h = attentions.shape[0]
    cols = min(h, 4)
    rows = -(-h // cols)
    side = max(3.2, 0.32 * attentions.shape[-1])  # room for the values of short sequences
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < h:
            draw_heatmap(ax, attentions[i], tokens, f"head {i}", labels=len(tokens) <= 24)
        else:
            ax.axis("off")
    fig.suptitle(title)
    return save_figure(fig, plt, path)


def save_figure(fig, plt, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` and close it."""
    path = Path(path)
    try:
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def json_for_script(data: object) -> str:
    """JSON that cannot end the ``<script>`` element it sits in, whatever the strings hold."""
    text = json.dumps(data, ensure_ascii=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def head_view_html(
    tokens: Sequence[str],
    attentions: Tensor,
    title: str,
    layer_names: Sequence[str] | None = None,
) -> str:
    """A self-contained page (inline CSS and JS, no network) to explore ``attentions``
    ``(L, h, t, t)``: choose a layer and a head; hover a query token on the left to see where it
    attends on the right, each line as strong as its weight, each weight written beside its key."""
    layers, heads = attentions.shape[0], attentions.shape[1]
    data = {
        "title": title,
        "tokens": list(tokens),
        "layers": list(layer_names) if layer_names else [f"layer {i}" for i in range(layers)],
        "heads": heads,
        "weights": _rounded(attentions.float().tolist()),
    }
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", json_for_script(data))


def _rounded(values: list | float) -> list | float:
    """Nested lists of weights, rounded to 5 decimals (the page stays small)."""
    return [_rounded(v) for v in values] if isinstance(values, list) else round(values, 5)


def write_html(page: str, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
  h1 { font-size: 1.2em; }
  .controls { margin-bottom: 1em; }
  .view { display: grid; grid-template-columns: max-content 220px max-content; }
  .column { display: flex; flex-direction: column; }
  .token { font-family: monospace; height: 22px; line-height: 22px; padding: 0 6px;
           white-space: pre; cursor: default; }
  .query.active { background: #ffe08a; }
  .key { display: flex; gap: 8px; }
  .weight { color: #1f77b4; min-width: 3.5em; text-align: right; visibility: hidden; }
  .shown .weight { visibility: visible; }
  svg line { stroke: #1f77b4; }
  .hint { color: #666; font-size: 0.9em; }
</style>
</head>
<body>
<h1 id="title"></h1>
<div class="controls">
  <label>Layer <select id="layer"></select></label>
  <label>Head <select id="head"></select></label>
  <span class="hint">Hover a token on the left: lines go to the tokens it attends to.</span>
</div>
<div class="view">
  <div class="column" id="queries"></div>
  <svg id="lines" width="220"></svg>
  <div class="column" id="keys"></div>
</div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const ROW = 22;
const layerSelect = document.getElementById("layer");
const headSelect = document.getElementById("head");
const queries = document.getElementById("queries");
const keys = document.getElementById("keys");
const svg = document.getElementById("lines");
let active = null;

document.getElementById("title").textContent = data.title;
data.layers.forEach((name, i) => layerSelect.add(new Option(name, String(i))));
for (let h = 0; h < data.heads; h++) headSelect.add(new Option(String(h), String(h)));
layerSelect.value = String(data.layers.length - 1);
svg.setAttribute("height", String(ROW * data.tokens.length));

data.tokens.forEach((token, i) => {
  const q = document.createElement("div");
  q.className = "token query";
  q.dataset.i = String(i);
  q.textContent = token;
  q.addEventListener("mouseenter", () => show(i));
  queries.appendChild(q);
  const k = document.createElement("div");
  k.className = "token key";
  k.dataset.j = String(i);
  const label = document.createElement("span");
  label.textContent = token;
  const weight = document.createElement("span");
  weight.className = "weight";
  k.append(weight, label);
  keys.appendChild(k);
});

function weights() {
  return data.weights[Number(layerSelect.value)][Number(headSelect.value)];
}

function show(i) {
  active = i;
  const row = weights()[i];
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  queries.querySelectorAll(".query").forEach(q => q.classList.toggle("active", Number(q.dataset.i) === i));
  keys.classList.add("shown");
  keys.querySelectorAll(".key").forEach(k => {
    const j = Number(k.dataset.j);
    const w = row[j];
    k.querySelector(".weight").textContent = w.toFixed(3);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
    line.setAttribute("x1", "0");
    line.setAttribute("y1", String(ROW * i + ROW / 2));
    line.setAttribute("x2", "220");
    line.setAttribute("y2", String(ROW * j + ROW / 2));
    line.setAttribute("stroke-width", String(1 + 5 * w));
    line.setAttribute("stroke-opacity", String(w));
    line.dataset.weight = String(w);
    svg.appendChild(line);
  });
}

function redraw() { show(active === null ? 0 : active); }
layerSelect.addEventListener("change", redraw);
headSelect.addEventListener("change", redraw);
redraw();
</script>
</body>
</html>
"""
