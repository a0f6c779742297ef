"""``attnkit bench --torch-nn``: models written with PyTorch's own attention before and after the
one-line switch to attnkit, a training step (forward and backward of a loss) in one run:

- ``encoder``: ``nn.TransformerEncoder`` before and after [`attnkit.nn.swap`][attnkit.nn.swap.swap];
- ``encoder weights``: the same with ``need_weights=True`` in its attention calls;
- ``nanogpt``: nanoGPT's blocks, which call ``F.scaled_dot_product_attention(..., is_causal=True)``,
  and the same calling [`attnkit.nn.functional`][attnkit.nn.functional]'s.

Each model and dtype first runs one step in a fresh process, which measures its peak memory above
a step of 64 tokens; then the two are timed in turns in this process (A B A B ...), median after
warm-ups, and the report gives attnkit's time and memory as ratios to torch's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnkit._progress import Progress
from attnkit.bench.measure import peak_mib, probe_each, probe_in_turn, reset_peak, resident_mib
from attnkit.bench.report import machine, write_record

IMPLS = ("torch", "attnkit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class EncoderCase:
    """``nn.TransformerEncoder`` of ``layers`` ``nn.TransformerEncoderLayer(d_model, heads,
    ff, dropout)``, batch first, trained on ``batch`` sequences of ``seq`` tokens (``nanogpt``:
    its blocks, ``ff = 4 d_model``)."""

    dtype: str = "fp32"
    impl: str = "torch"
    model: str = "encoder"
    d_model: int = 512
    heads: int = 8
    layers: int = 6
    ff: int = 2048
    dropout: float = 0.1
    seq: int = 1024
    batch: int = 8


@dataclass(frozen=True)
class TorchNNConfig:
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    models: tuple[str, ...] = ("encoder", "encoder weights", "nanogpt")
    dropouts: tuple[float, ...] = (0.1, 0.0)  # the encoder's: torch's default, and none
    repeats: int = 3
    warmups: int = 1
    shrink: int = 1  # divides the widths and the length: the smoke run
    timeout_s: float = 900.0
    one_process: bool = False  # probe every case's memory in one process (rough; the smoke run)

    def cases(self) -> list[EncoderCase]:
        s = self.shrink
        encoder = {"d_model": 512 // s, "ff": 2048 // s, "seq": 1024 // s}
        nanogpt = {"d_model": 384 // s, "heads": 6, "ff": 4 * 384 // s, "seq": 1024 // s}
        cases = []
        for model in self.models:
            shape = nanogpt if model == "nanogpt" else encoder
            dropouts = {"encoder": self.dropouts, "nanogpt": (0.0,)}.get(model, self.dropouts[:1])
            for dtype in self.dtypes:
                for dropout in dropouts:
                    cases += [EncoderCase(dtype, i, model, dropout=dropout, **shape) for i in IMPLS]
        return cases


def step_of(case: EncoderCase, seq: int | None = None):
    """The model of ``case`` in training mode, and a call that runs one training step."""
    from attnkit.nn import swap

    torch.manual_seed(0)
    if case.model == "nanogpt":
        model = _nanogpt(case)
    else:
        layer = torch.nn.TransformerEncoderLayer(
            case.d_model, case.heads, case.ff, case.dropout, batch_first=True
        )
        model = torch.nn.TransformerEncoder(layer, case.layers, enable_nested_tensor=False)
        if case.impl == "attnkit":
            swap(model)
        if case.model == "encoder weights":
            for module in model.modules():
                if isinstance(module, torch.nn.MultiheadAttention):
                    module.register_forward_pre_hook(_with_weights, with_kwargs=True)
    model = model.to(DTYPES[case.dtype]).train()
    x = torch.randn(case.batch, seq or case.seq, case.d_model, dtype=DTYPES[case.dtype])

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()

    return model, step


def _with_weights(module, args, kwargs):
    """An attention call that returns its weights (``need_weights=True``, per head)."""
    return args, {**kwargs, "need_weights": True, "average_attn_weights": False}


class _Block(torch.nn.Module):
    """nanoGPT's block: pre-norm causal self-attention through an SDPA function, then an MLP."""

    def __init__(self, case: EncoderCase, sdpa) -> None:
        super().__init__()
        d = case.d_model
        self.heads, self.sdpa = case.heads, sdpa
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, case.ff), torch.nn.GELU(), torch.nn.Linear(case.ff, d)
        )

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for y in self.qkv(self.ln1(x)).split(d, dim=2)
        )
        y = self.sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


def _nanogpt(case: EncoderCase) -> torch.nn.Module:
    from attnkit.nn import functional

    sdpa = functional if case.impl == "attnkit" else torch.nn.functional
    blocks = [_Block(case, sdpa.scaled_dot_product_attention) for _ in range(case.layers)]
    return torch.nn.Sequential(*blocks)


def _probe_one(case_json: str) -> dict:
    case = EncoderCase(**json.loads(case_json))
    step_of(case, seq=64)[1]()  # warm: the first call's one-time costs
    step = step_of(case)[1]
    reset_peak()
    before = resident_mib()
    start = time.perf_counter()
    step()
    return {"status": "ok", "peak_mib": peak_mib() - before, "seconds": time.perf_counter() - start}


def run_torch_nn(config: TorchNNConfig, stream=None) -> dict:
    """Peak memory of each case in a fresh process, then the steps timed in turns."""
    cases = config.cases()
    progress = Progress(len(cases) * (1 + config.warmups + config.repeats), stream or sys.stderr)
    arguments = [json.dumps(asdict(case)) for case in cases]
    labels = [f"memory {c.model} {c.impl} {c.dtype} dropout={c.dropout}" for c in cases]
    reports = probe_in_turn(__name__, arguments, labels, config.timeout_s,
                            one_process=config.one_process, step=progress.step)  # fmt: skip
    rows = [{**asdict(case), **report, "times": []} for case, report in zip(cases, reports)]
    for i in range(0, len(rows), len(IMPLS)):  # torch and attnkit of one dtype and dropout
        pair = rows[i : i + len(IMPLS)]
        steps = [step_of(EncoderCase(**_fields(row)))[1] for row in pair]
        for round_ in range(config.warmups + config.repeats):
            for row, step in zip(pair, steps):
                start = time.perf_counter()
                step()
                if round_ >= config.warmups:
                    row["times"].append(time.perf_counter() - start)
                progress.step(f"time {row['model']} {row['impl']} {row['dtype']}")
        base = pair[0]
        for row in pair:
            row["median_s"] = statistics.median(row["times"])
            row["vs_torch"] = row["median_s"] / statistics.median(base["times"])
            if "peak_mib" in row and base.get("peak_mib", 0) > 0:
                row["memory_vs_torch"] = row["peak_mib"] / base["peak_mib"]
    return {
        "machine": machine(),
        "config": asdict(config),
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
    }


def _fields(row: dict) -> dict:
    return {k: row[k] for k in EncoderCase.__dataclass_fields__}


def markdown(record: dict) -> str:
    m, rows = record["machine"], record["rows"]
    c = rows[0]
    lines = [
        f"Machine: {m['cpu']}, {m['torch_threads']} threads, torch {m['torch']} (CPU features: "
        f"{m['cpu_features']}). A training step on {c['batch']} x {c['seq']} tokens of "
        f"{c['layers']} layers ({_shapes(rows)}); median of {record['config']['repeats']} "
        f"after {record['config']['warmups']} warm-up, interleaved.",
        "",
        "| model | dtype | dropout | attention | step s | vs torch | peak MiB | memory vs torch |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        memory = f"{r['peak_mib']:.0f}" if "peak_mib" in r else r.get("status", "—")
        ratio = f"{r['memory_vs_torch']:.2f}" if "memory_vs_torch" in r else "—"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['dropout']} | {r['impl']} | {r['median_s']:.2f} | "
            f"{r['vs_torch']:.2f} | {memory} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def _shapes(rows: list[dict]) -> str:
    seen = {r["model"]: r for r in rows}
    return "; ".join(
        f"{name}: d_model {r['d_model']}, {r['heads']} heads, feed-forward {r['ff']}"
        for name, r in seen.items()
    )


def write_torch_nn(record: dict, out_dir: Path) -> dict[str, Path]:
    return write_record(record, out_dir, "torch-nn", markdown(record))


if __name__ == "__main__":
    probe_each(_probe_one, sys.argv[1:])
