"""One self-contained HTML page of a run (inline CSS and JS, nothing from a network): a slider over
the snapshots redraws every head's attention map and its role scores, and marks the snapshot on
the loss chart (axes, the training loss, for the copy task its copied and other tokens, and the
held-out loss at each snapshot). A layer's heads share one row: the maps' cells are sized to the
window's width, again when it is resized.

All text reaches the page as JSON inside ``<script type="application/json">``, written by
[`attnkit.views.json_for_script`][attnkit.views.json_for_script] so that no string can end the
element, and the page's script puts it into the document with ``textContent``, never as markup.

Shapes: ``S`` snapshots, ``L`` layers, ``h`` heads, ``t`` tokens of the drawn sequence.
"""

from __future__ import annotations

import html

from attnkit.learn.record import LearnResult
from attnkit.learn.roles import ROLES
from attnkit.learn.tasks import PROBES
from attnkit.views import json_for_script


def learn_page(result: LearnResult) -> str:
    """The page's HTML."""
    scores = result.scores  # {role: (S, L, h)}
    title = f"attnkit learn --task {result.task}: {result.settings.num_layers} layers of " + (
        f"{result.settings.num_heads} heads"
    )
    data = {
        "title": title,
        "labels": list(result.labels),
        "snapshot_steps": result.snapshot_steps,
        "roles": list(ROLES),
        "weights": _rounded(result.weights.tolist()),  # (S, L, h, t, t)
        "scores": {role: _rounded(s.tolist()) for role, s in scores.items()},  # (S, L, h) each
        "steps": result.steps,
        "loss": result.loss,
        "loss_repeated": result.loss_repeated,  # None but for the copy task
        "loss_others": result.loss_others,
        "held_out_loss": result.held_out_loss,
        "caption": loss_caption(result),
        "scores_note": (
            f"The scores under each map: the mean over {PROBES} held-out probes (induction: over "
            f"{PROBES} random sequences written twice), not over the one sequence drawn."
        ),
    }
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", json_for_script(data))


def loss_caption(result: LearnResult) -> str:
    """What the loss chart shows, with the loss at the end (and the lowest, which can come
    earlier: each point is the mean of a window of steps)."""
    caption = (
        f"Training loss by step, each point the mean of a window of steps: {result.loss[0]:.3f} "
        f"at the start, {result.loss[-1]:.3f} at the end (the lowest {min(result.loss):.3f})"
    )
    if result.loss_repeated is not None and result.loss_others is not None:
        caption += (
            f"; at the end {result.loss_repeated[-1]:.3f} on the copied tokens and "
            f"{result.loss_others[-1]:.3f} on the others"
        )
    return (
        f"{caption}. The dots: the held-out loss at each snapshot ({result.held_out_loss[-1]:.3f} "
        "at the last); the red line: the snapshot shown."
    )


def _rounded(values: list | float) -> list | float:
    """Nested lists rounded to 3 decimals (the page stays small)."""
    return [_rounded(v) for v in values] if isinstance(values, list) else round(values, 3)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  html { overflow-y: scroll; }  /* the scrollbar always there: the width the maps get is stable */
  body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
  h1 { font-size: 1.2em; }
  .controls { display: flex; gap: 1em; align-items: center; margin: 0.5em 0 1em; }
  #snapshot { width: 28em; }
  .layer { display: flex; gap: 12px; margin-bottom: 1em; flex-wrap: wrap; }
  .head { font-size: 0.85em; }
  .head .name { font-weight: 600; }
  .scores { font-family: monospace; white-space: pre; }
  .best { color: #1f77b4; font-weight: 600; }
  #hover, #sequence { font-family: monospace; min-height: 1.3em; white-space: pre; }
  #caption, #note { font-size: 0.85em; color: #444; max-width: 60em; }
  svg text { font-size: 10px; fill: #555; }
</style>
</head>
<body>
<h1 id="title"></h1>
<svg id="curve" width="760" height="230" role="img" aria-labelledby="caption"></svg>
<p id="caption"></p>
<div class="controls">
  <label for="snapshot">Snapshot</label>
  <input type="range" id="snapshot" min="0" value="0">
  <span id="step"></span>
</div>
<div id="sequence"></div>
<div id="hover">Hover a map: the query (row) and key (column) under the pointer, and the weight.</div>
<p id="note"></p>
<div id="heads"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const S = data.snapshot_steps.length, L = data.weights[0].length, H = data.weights[0][0].length;
const T = data.labels.length;
const GAP = 12;  // px between maps, as .layer's gap
let CELL = 10;
const slider = document.getElementById("snapshot");
const svgNS = "http://www.w3.org/2000/svg";
document.getElementById("title").textContent = data.title;
document.getElementById("caption").textContent = data.caption;
document.getElementById("note").textContent = data.scores_note;
document.getElementById("sequence").textContent = "The sequence drawn (queries down, keys across): "
  + data.labels.join(" ");
slider.max = String(S - 1);
slider.value = String(S - 1);

const heads = [];
for (let l = 0; l < L; l++) {
  const row = document.createElement("div");
  row.className = "layer";
  for (let h = 0; h < H; h++) {
    const box = document.createElement("div");
    box.className = "head";
    const name = document.createElement("div");
    name.className = "name";
    name.textContent = "layer " + (l + 1) + " head " + (h + 1);
    const canvas = document.createElement("canvas");
    canvas.id = "map-" + (l + 1) + "-" + (h + 1);
    canvas.addEventListener("mousemove", e => hover(e, l, h));
    const scores = document.createElement("div");
    scores.className = "scores";
    box.append(name, canvas, scores);
    row.appendChild(box);
    heads.push({l, h, canvas, scores});
  }
  document.getElementById("heads").appendChild(row);
}

// the cells sized so that a layer's H maps fit the page's width side by side (10 to 28 px)
function layout() {
  const width = document.getElementById("heads").clientWidth;
  CELL = Math.max(10, Math.min(28, Math.floor((width - (H - 1) * GAP) / (H * T))));
  heads.forEach(({canvas}) => { canvas.width = canvas.height = CELL * T; });
}

function drawMap(canvas, w) {
  const ctx = canvas.getContext("2d");
  // the colours scaled to this map's weights, leaving out the first query (always 1 on itself)
  let low = Infinity, high = -Infinity;
  w.forEach((r, i) => r.forEach(v => { low = Math.min(low, v); if (i > 0 || T === 1) high = Math.max(high, v); }));
  const span = Math.max(high - low, 1e-6);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = Math.floor(CELL * 0.4) + "px monospace";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
    const a = Math.min(1, (w[i][j] - low) / span);
    ctx.fillStyle = "rgb(" + Math.round(247 - 216 * a) + "," + Math.round(251 - 132 * a) + ","
      + Math.round(255 - 75 * a) + ")";
    ctx.fillRect(j * CELL, i * CELL, CELL, CELL);
    if (CELL >= 18 && j <= i) {
      ctx.fillStyle = a > 0.5 ? "#fff" : "#000";
      ctx.fillText(w[i][j].toFixed(2).replace(/^0/, ""), j * CELL + CELL / 2, i * CELL + CELL / 2);
    }
  }
}

function hover(e, l, h) {
  const rect = e.target.getBoundingClientRect();
  const j = Math.floor((e.clientX - rect.left) / CELL), i = Math.floor((e.clientY - rect.top) / CELL);
  if (i < 0 || j < 0 || i >= T || j >= T) return;
  const w = data.weights[Number(slider.value)][l][h][i][j];
  document.getElementById("hover").textContent = "layer " + (l + 1) + " head " + (h + 1)
    + ": query " + i + " " + JSON.stringify(data.labels[i]) + " -> key " + j + " "
    + JSON.stringify(data.labels[j]) + ": " + w.toFixed(3);
}

const CURVES = [["loss", "training loss", "#1f77b4"], ["loss_repeated", "on the copied tokens", "#2ca02c"],
  ["loss_others", "on the other tokens", "#7f7f7f"]].filter(([key]) => data[key]);

function svgAdd(svg, name, attrs, text) {
  const el = document.createElementNS(svgNS, name);
  Object.entries(attrs).forEach(([k, v]) => el.setAttribute(k, v));
  if (text !== undefined) el.textContent = text;
  svg.appendChild(el);
  return el;
}

function ticks(low, high, count) {  // round values from low to high, about count of them
  const raw = Math.max(high - low, 1e-6) / count, size = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map(m => m * size).find(s => s >= raw);
  const out = [];
  for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-6; v += step) out.push(Number(v.toFixed(6)));
  return out;
}

function drawCurve(step) {
  const svg = document.getElementById("curve");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 760, Hh = 230, left = 50, right = 190, top = 10, bottom = 40;
  const maxStep = Math.max(1, data.steps[data.steps.length - 1] || 1);
  const all = CURVES.flatMap(([key]) => data[key]).concat(data.held_out_loss);
  const high = Math.max(...all), low = Math.min(...all, 0);
  const x = s => left + (W - left - right) * s / maxStep;
  const y = v => Hh - bottom - (Hh - bottom - top) * (v - low) / Math.max(high - low, 1e-6);
  const axis = {stroke: "#555"};
  svgAdd(svg, "line", {...axis, class: "axis", x1: left, x2: W - right, y1: Hh - bottom, y2: Hh - bottom});
  svgAdd(svg, "line", {...axis, class: "axis", x1: left, x2: left, y1: top, y2: Hh - bottom});
  ticks(0, maxStep, 5).forEach(s => {
    svgAdd(svg, "line", {...axis, x1: x(s), x2: x(s), y1: Hh - bottom, y2: Hh - bottom + 4});
    svgAdd(svg, "text", {class: "tick-x", x: x(s), y: Hh - bottom + 15, "text-anchor": "middle"}, String(s));
  });
  ticks(low, high, 4).forEach(v => {
    svgAdd(svg, "line", {stroke: "#eee", x1: left, x2: W - right, y1: y(v), y2: y(v)});
    svgAdd(svg, "text", {class: "tick-y", x: left - 6, y: y(v) + 3, "text-anchor": "end"}, String(v));
  });
  svgAdd(svg, "text", {x: (left + W - right) / 2, y: Hh - 6, "text-anchor": "middle"}, "step");
  svgAdd(svg, "text", {x: 12, y: (top + Hh - bottom) / 2, "text-anchor": "middle",
    transform: "rotate(-90 12 " + (top + Hh - bottom) / 2 + ")"}, "loss (nats per token)");
  const legend = [];
  CURVES.forEach(([key, name, colour]) => {
    svgAdd(svg, "polyline", {class: "curve", "data-curve": key, fill: "none", stroke: colour,
      points: data.steps.map((s, k) => x(s) + "," + y(data[key][k])).join(" ")});
    legend.push([name, colour, "line"]);
  });
  data.held_out_loss.forEach((v, k) => svgAdd(svg, "circle",
    {class: "held-out", cx: x(data.snapshot_steps[k]), cy: y(v), r: 2.5, fill: "#d62728"}));
  legend.push(["held out, at each snapshot", "#d62728", "dot"], ["the snapshot shown", "#d62728", "mark"]);
  svgAdd(svg, "line", {id: "marker", x1: x(step), x2: x(step), y1: top, y2: Hh - bottom,
    stroke: "#d62728", "stroke-dasharray": "3 2"});
  legend.forEach(([name, colour, kind], k) => {
    const ly = top + 8 + 16 * k, lx = W - right + 14;
    if (kind === "dot") svgAdd(svg, "circle", {cx: lx + 9, cy: ly, r: 2.5, fill: colour});
    else svgAdd(svg, "line", {x1: lx, x2: lx + 18, y1: ly, y2: ly, stroke: colour,
      "stroke-dasharray": kind === "mark" ? "3 2" : "none"});
    svgAdd(svg, "text", {class: "legend", x: lx + 24, y: ly + 3}, name);
  });
}

function redraw() {
  const k = Number(slider.value);
  const step = data.snapshot_steps[k];
  document.getElementById("step").textContent = "step " + step + " (" + (k + 1) + " of " + S
    + "), held-out loss " + data.held_out_loss[k].toFixed(3);
  heads.forEach(({l, h, canvas, scores}) => {
    drawMap(canvas, data.weights[k][l][h]);
    canvas.dataset.snapshot = String(k);
    let best = data.roles[0];
    data.roles.forEach(r => { if (data.scores[r][k][l][h] > data.scores[best][k][l][h]) best = r; });
    while (scores.firstChild) scores.removeChild(scores.firstChild);
    data.roles.forEach(r => {
      const line = document.createElement("div");
      line.textContent = r.replace("_", "-").padEnd(15) + data.scores[r][k][l][h].toFixed(2);
      line.dataset.role = r;
      if (r === best && data.scores[r][k][l][h] >= 0.5) line.className = "best";
      scores.appendChild(line);
    });
  });
  drawCurve(step);
}
slider.addEventListener("input", redraw);
window.addEventListener("resize", () => { layout(); redraw(); });
layout();
redraw();
</script>
</body>
</html>
"""
