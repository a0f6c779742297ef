"""One self-contained HTML page of a run (inline CSS and JS, nothing from a network): a slider over
the snapshots redraws every head's attention map and its role scores, and marks the snapshot on
the loss curve.

All text reaches the page as JSON inside ``<script type="application/json">``, written by
[`attnkit.views.json_for_script`][attnkit.views.json_for_script] so that no string can end the
element, and the page's script puts it into the document with ``textContent``, never as markup.

Shapes: ``S`` snapshots, ``L`` layers, ``h`` heads, ``t`` tokens of the drawn sequence.
"""

from __future__ import annotations

import html

from attnkit.learn.record import LearnResult
from attnkit.learn.roles import ROLES
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
        "held_out_loss": result.held_out_loss,
    }
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", json_for_script(data))


def _rounded(values: list | float) -> list | float:
    """Nested lists rounded to 3 decimals (the page stays small)."""
    return [_rounded(v) for v in values] if isinstance(values, list) else round(values, 3)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
  h1 { font-size: 1.2em; }
  .controls { display: flex; gap: 1em; align-items: center; margin: 0.5em 0 1em; }
  #snapshot { width: 28em; }
  .layer { display: flex; gap: 1.2em; margin-bottom: 1em; flex-wrap: wrap; }
  .head { font-size: 0.85em; }
  .head .name { font-weight: 600; }
  .scores { font-family: monospace; white-space: pre; }
  .best { color: #1f77b4; font-weight: 600; }
  #hover, #sequence { font-family: monospace; min-height: 1.3em; white-space: pre; }
  svg text { font-size: 10px; fill: #555; }
</style>
</head>
<body>
<h1 id="title"></h1>
<svg id="curve" width="560" height="150"></svg>
<div class="controls">
  <label for="snapshot">Snapshot</label>
  <input type="range" id="snapshot" min="0" value="0">
  <span id="step"></span>
</div>
<div id="sequence"></div>
<div id="hover">Hover a map: the query (row) and key (column) under the pointer, and the weight.</div>
<div id="heads"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const S = data.snapshot_steps.length, L = data.weights[0].length, H = data.weights[0][0].length;
const T = data.labels.length;
const CELL = Math.max(10, Math.min(28, Math.floor(360 / T)));
const slider = document.getElementById("snapshot");
const svgNS = "http://www.w3.org/2000/svg";
document.getElementById("title").textContent = data.title;
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
    canvas.width = canvas.height = CELL * T;
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

function drawMap(canvas, w) {
  const ctx = canvas.getContext("2d");
  // the colours scaled to this map's weights, leaving out the first query (always 1 on itself)
  let low = Infinity, high = -Infinity;
  w.forEach((r, i) => r.forEach(v => { low = Math.min(low, v); if (i > 0 || T === 1) high = Math.max(high, v); }));
  const span = Math.max(high - low, 1e-6);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "8px monospace";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
    const a = Math.min(1, (w[i][j] - low) / span);
    ctx.fillStyle = "rgb(" + Math.round(247 - 216 * a) + "," + Math.round(251 - 132 * a) + ","
      + Math.round(255 - 75 * a) + ")";
    ctx.fillRect(j * CELL, i * CELL, CELL, CELL);
    if (CELL >= 22 && j <= i) {
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

function drawCurve(step) {
  const svg = document.getElementById("curve");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 560, Hh = 150, pad = 30;
  const maxStep = Math.max(1, data.steps[data.steps.length - 1] || 1);
  const all = data.loss.concat(data.held_out_loss);
  const top = Math.max(...all), bottom = Math.min(...all, 0);
  const x = s => pad + (W - 2 * pad) * s / maxStep;
  const y = v => Hh - pad + (pad + 10 - Hh) * (v - bottom) / Math.max(top - bottom, 1e-6);
  const line = document.createElementNS(svgNS, "polyline");
  line.setAttribute("points", data.steps.map((s, k) => x(s) + "," + y(data.loss[k])).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#1f77b4");
  svg.appendChild(line);
  const mark = document.createElementNS(svgNS, "line");
  mark.id = "marker";
  mark.setAttribute("x1", x(step)); mark.setAttribute("x2", x(step));
  mark.setAttribute("y1", 10); mark.setAttribute("y2", Hh - pad);
  mark.setAttribute("stroke", "#d62728");
  svg.appendChild(mark);
  const label = document.createElementNS(svgNS, "text");
  label.setAttribute("x", pad); label.setAttribute("y", Hh - 8);
  label.textContent = "training loss by step (0 to " + maxStep + "), from " + top.toFixed(2)
    + " down to " + Math.min(...data.loss).toFixed(2) + "; the red line is this snapshot";
  svg.appendChild(label);
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
redraw();
</script>
</body>
</html>
"""
