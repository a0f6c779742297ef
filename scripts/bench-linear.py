"""The gated delta rule beside transformers' reference (its PyTorch fallback, where
flash-linear-attention is not installed), in one run, as ratios: a prompt's forward and
forward+backward (``torch_chunk_gated_delta_rule``), a decoding step
(``torch_recurrent_gated_delta_rule``) beside one ``copy_`` of the state, the bound of a step that
reads and writes it once, and where linear attention overtakes attnkit's causal softmax attention
as the sequence grows. Usage: ``python scripts/bench-linear.py`` (needs transformers)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from attnkit import gated_delta_rule
from attnkit.bench.report import machine


def median_s(fn, repeats: int, warmups: int = 3) -> float:
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def inputs(b: int, t: int, h: int, d: int, grad: bool = False) -> list[torch.Tensor]:
    q, k, v = (torch.randn(b, t, h, d) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, h))
    beta = torch.rand(b, t, h)
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta)]


def prompts() -> None:
    print("| b, t, heads x dim | pass | transformers s | attnkit s | transformers / attnkit |")
    print("|---|---|---:|---:|---:|")
    for b, t, h, d in [(1, 2048, 4, 128), (1, 4096, 16, 128)]:
        for mode in ("forward", "forward+backward"):
            xs = inputs(b, t, h, d, grad=mode != "forward")

            def theirs(xs=xs, mode=mode):
                out = qwen3_next.torch_chunk_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)[0]
                if mode != "forward":
                    out.sum().backward()

            def ours(xs=xs, mode=mode):
                out = gated_delta_rule(*xs, use_qk_l2norm=True)[0]
                if mode != "forward":
                    out.sum().backward()

            with torch.set_grad_enabled(mode != "forward"):
                a, o = median_s(theirs, 5), median_s(ours, 5)
            print(f"| {b}, {t}, {h} x {d} | {mode} | {a:.3f} | {o:.3f} | {a / o:.2f} |")


def step_row(b: int, h: int, d: int) -> str:
    xs = inputs(b, 1, h, d)
    state, copy = torch.randn(b, h, d, d), torch.empty(b, h, d, d)
    options = {"initial_state": state, "output_final_state": True}
    theirs = qwen3_next.torch_recurrent_gated_delta_rule
    with torch.no_grad():
        c = median_s(lambda: copy.copy_(state), 200, 20)
        ours = {**options, "use_qk_l2norm": True, "inplace_final_state": True}
        s = median_s(lambda: gated_delta_rule(*xs, **ours), 200, 20)
        r = median_s(lambda: theirs(*xs, **options, use_qk_l2norm_in_kernel=True), 200, 20)
    mib = state.numel() * 4 / 2**20
    return f"| {b}, {h} x {d} ({mib:.0f} MiB) | {c * 1e6:.0f} | {s * 1e6:.0f} | {s / c:.2f} | {r * 1e6:.0f} |"


def steps() -> None:
    print(
        "| b, heads x dim (state) | copy_ us | attnkit step us | step / copy_ | transformers us |"
    )
    print("|---|---:|---:|---:|---:|")
    for b, h, d in [(1, 16, 128), (8, 16, 128)]:
        print(step_row(b, h, d))


def crossing() -> None:
    """Forward+backward of the gated delta rule and of causal softmax attention (attnkit's
    ``attention``, whichever backend ``auto`` takes), b=1, 4 heads of 128, fp32."""
    from attnkit import attention

    print("| t | softmax attention s | gated delta rule s | delta rule / softmax |")
    print("|---:|---:|---:|---:|")
    for t in (512, 1024, 2048, 4096, 8192):
        xs = inputs(1, t, 4, 128, grad=True)
        heads = [x.detach().transpose(1, 2).requires_grad_() for x in xs[:3]]  # (b, h, t, d)

        def softmax(heads=heads):
            attention(*heads, causal=True).sum().backward()

        def linear(xs=xs):
            gated_delta_rule(*xs, use_qk_l2norm=True)[0].sum().backward()

        a, b = median_s(softmax, 3, 1), median_s(linear, 3, 1)
        print(f"| {t} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    m = machine()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_features']})\n")
    prompts()
    print()
    steps()
    print()
    crossing()
