"""``attnkit bench --hf``: whole Hugging Face models on attnkit beside transformers' own ``sdpa``
and ``eager`` attention, in one run.

The models have random weights, built from configs (nothing is downloaded): a Llama-, a Gemma-2-
and a GPT-OSS-shaped model of 4 layers, hidden 512, vocab 8192 (the shapes of issue 28's goals),
a tiny Llama on a long padded batch, and generation with a Llama-shaped model. For each case, each
attention implementation runs once in a fresh process, which measures its peak memory above a
64-token warm-up; then the implementations are timed in turns in this process (A B C A B C ...),
median after warm-ups, and reported as ratios to the first of them (``sdpa`` where transformers
can run it there, else ``eager``). ``none`` is an attention that does nothing: the rest of the
model's time and memory.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from attnkit._progress import Progress
from attnkit.bench.measure import peak_mib, probe_each, probe_in_turn, reset_peak, resident_mib
from attnkit.bench.report import machine, write_record

WARM_UP_TOKENS = 64

DECODER = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "head_dim": 64,
}
ALTERNATE = ["sliding_attention", "full_attention"] * 2


@dataclass(frozen=True)
class ModelCase:
    """One model and what is measured on it: a training ``step`` (forward + backward of the
    language-model loss), an ``eval`` forward of a padded batch, or ``generate``."""

    name: str
    config: str  # a transformers config class
    model: str  # a transformers model class
    options: dict
    seq: int
    batch: int = 1
    mode: str = "step"
    dtype: str = "fp32"
    impls: tuple[str, ...] = ("sdpa", "eager", "attnkit")
    left_padding: int = 0
    new_tokens: int = 0


CASES = (
    ModelCase(
        "llama bf16", "LlamaConfig", "LlamaForCausalLM",
        {**DECODER, "num_key_value_heads": 2, "intermediate_size": 1376}, 2048, dtype="bf16",
    ),
    ModelCase(
        "llama fp32", "LlamaConfig", "LlamaForCausalLM",
        {**DECODER, "num_key_value_heads": 2, "intermediate_size": 1376}, 2048,
    ),
    ModelCase(
        "gemma2 fp32", "Gemma2Config", "Gemma2ForCausalLM",
        {**DECODER, "num_key_value_heads": 4, "intermediate_size": 2048,
         "attn_logit_softcapping": 50.0, "sliding_window": 1024, "layer_types": ALTERNATE},
        4096, impls=("eager", "attnkit", "none"),
    ),
    ModelCase(
        "gpt-oss fp32", "GptOssConfig", "GptOssForCausalLM",
        {**DECODER, "num_key_value_heads": 2, "intermediate_size": 512, "num_local_experts": 2,
         "num_experts_per_tok": 1, "sliding_window": 128, "layer_types": ALTERNATE},
        4096, impls=("eager", "attnkit", "none"),
    ),
    ModelCase(
        "padded tiny llama fp32", "LlamaConfig", "LlamaForCausalLM",
        {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1},
        8192, batch=2, mode="eval", left_padding=100,
    ),
    ModelCase(
        "llama generate fp32", "LlamaConfig", "LlamaForCausalLM",
        {**DECODER, "num_key_value_heads": 2, "intermediate_size": 1376}, 4096,
        mode="generate", new_tokens=128, impls=("sdpa", "attnkit"),
    ),
)  # fmt: skip


@dataclass(frozen=True)
class HFBenchConfig:
    cases: tuple[str, ...] = tuple(c.name for c in CASES)
    repeats: int = 3
    warmups: int = 1
    shrink: int = 1  # divides the lengths and widths: the smoke run
    timeout_s: float = 900.0
    one_process: bool = False  # probe every run's memory in one process (rough; the smoke run)

    @staticmethod
    def smoke(**overrides) -> HFBenchConfig:
        chosen = ("gemma2 fp32", "llama generate fp32")  # a step, three kinds; generation
        return HFBenchConfig(
            **{"cases": chosen, "repeats": 1, "warmups": 0, "shrink": 32, "one_process": True}
            | overrides
        )


def shrunk(case: ModelCase, shrink: int) -> ModelCase:
    """``case`` at ``1 / shrink`` of its lengths and widths (heads kept), for a quick run."""
    if shrink == 1:
        return case
    options = dict(case.options)
    for key in ("hidden_size", "intermediate_size", "vocab_size", "sliding_window"):
        if key in options:
            options[key] = max(options[key] // shrink, 8)
    if "head_dim" in options:
        options["head_dim"] = max(options["head_dim"] // shrink, 4)
    new = max(case.new_tokens // shrink, 2) if case.new_tokens else 0
    padding = min(case.left_padding, case.seq // shrink // 4)
    return replace(
        case, options=options, seq=case.seq // shrink, new_tokens=new, left_padding=padding
    )


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that does nothing (it returns its queries): what the rest of the model
    costs, in time and memory, registered as ``"none"``."""
    return query.transpose(1, 2).contiguous(), None


def build(case: ModelCase) -> torch.nn.Module:
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    from attnkit import hf

    hf.register()
    transformers.AttentionInterface.register("none", no_attention)
    AttentionMaskInterface.register("none", hf.mask_builder)
    torch.manual_seed(0)
    config = getattr(transformers, case.config)(**case.options)
    model = getattr(transformers, case.model)(config)
    model = model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype])
    return model.train() if case.mode == "step" else model.eval()


def inputs(case: ModelCase, seq: int | None = None) -> dict:
    seq = seq or case.seq
    generator = torch.Generator().manual_seed(1)
    vocab = case.options["vocab_size"]
    ids = torch.randint(0, vocab, (case.batch, seq), generator=generator)
    mask = torch.ones(case.batch, seq, dtype=torch.long)
    if case.left_padding:
        mask[-1, : min(case.left_padding, seq - 1)] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_once(model: torch.nn.Module, impl: str, case: ModelCase, given: dict) -> None:
    """One training step, forward or generation of ``model`` with ``impl``."""
    model.set_attn_implementation(impl)
    if case.mode == "step":
        model(**given, labels=given["input_ids"]).loss.backward()
        model.zero_grad(set_to_none=True)
    elif case.mode == "eval":
        with torch.no_grad():
            model(**given)
    else:
        new = case.new_tokens
        with torch.no_grad():
            model.generate(
                **given, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )


def _probe_one(argument: str) -> dict:
    """Peak memory of one run of a case with an implementation (``argument``: the two as JSON)
    above a short warm-up."""
    fields, impl = json.loads(argument)
    case = ModelCase(**{**fields, "impls": tuple(fields["impls"])})
    model = build(case)
    run_once(
        model, impl, replace(case, new_tokens=min(case.new_tokens, 2)), inputs(case, WARM_UP_TOKENS)
    )
    given = inputs(case)
    reset_peak()
    before = resident_mib()
    start = time.perf_counter()
    run_once(model, impl, case, given)
    seconds = time.perf_counter() - start
    return {"status": "ok", "peak_mib": peak_mib() - before, "first_s": seconds}


def run_hf(config: HFBenchConfig, progress: Progress | None = None) -> dict:
    """Every case of ``config``: a record with the machine and one row per case and
    implementation."""
    cases = [shrunk(c, config.shrink) for c in CASES if c.name in config.cases]
    progress = progress or Progress(sum(len(c.impls) + 1 for c in cases))
    pairs = [(case, impl) for case in cases for impl in case.impls]
    arguments = [json.dumps([asdict(case), impl]) for case, impl in pairs]
    labels = [f"memory {case.name} {impl}" for case, impl in pairs]
    reports = probe_in_turn(__name__, arguments, labels, config.timeout_s,
                            one_process=config.one_process, step=progress.step)  # fmt: skip
    probes = {(case.name, impl): report for (case, impl), report in zip(pairs, reports)}
    rows = []
    for case in cases:
        progress.step(f"time {case.name}")
        ok = [i for i in case.impls if probes[case.name, i]["status"] == "ok"]
        times = _timed(case, ok, config)
        for impl in case.impls:
            median = statistics.median(times[impl]) if times.get(impl) else None
            rows.append(
                {"case": case.name, "impl": impl, **probes[case.name, impl], "median_s": median}
            )
    return {"machine": machine(), "config": asdict(config), "rows": rows}


def _timed(case: ModelCase, impls: list[str], config: HFBenchConfig) -> dict[str, list[float]]:
    model, given = build(case), inputs(case)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(config.warmups):
        for impl in impls:
            run_once(model, impl, case, given)
    for _ in range(config.repeats):
        for impl in impls:
            start = time.perf_counter()
            run_once(model, impl, case, given)
            times[impl].append(time.perf_counter() - start)
    return times


def markdown(record: dict) -> str:
    m = record["machine"]
    c = record["config"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} (CPU features: "
        f"{m['cpu_features']}); median of {c['repeats']} after {c['warmups']} warm-up(s), the "
        "implementations in turns; peak memory of one run in a fresh process, above a "
        f"{WARM_UP_TOKENS}-token warm-up.",
        "",
        "| case | attention | time s | vs first | peak MiB | vs first | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    first: dict[str, dict] = {}
    by_case = {c.name: c for c in CASES}
    for r in record["rows"]:
        base = first.setdefault(r["case"], r)
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['impl']} | {r['status']} | — | — | — | — |")
            continue
        time_s, peak = r["median_s"], r["peak_mib"]
        new = shrunk(by_case[r["case"]], c["shrink"]).new_tokens
        tokens = f"{new / time_s:.1f}" if new and time_s else "—"
        lines.append(
            f"| {r['case']} | {r['impl']} | {_fmt(time_s)} | {_ratio(time_s, base.get('median_s'))} "
            f"| {peak:.0f} | {_ratio(peak, base.get('peak_mib'))} | {tokens} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _ratio(x: float | None, base: float | None) -> str:
    return f"{x / base:.2f}" if x is not None and base else "—"


def write_hf(record: dict, out_dir: Path) -> dict[str, Path]:
    return write_record(record, out_dir, "hf", markdown(record))


if __name__ == "__main__":
    probe_each(_probe_one, sys.argv[1:])
