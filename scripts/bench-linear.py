"""The gated delta rule beside transformers' reference (its PyTorch fallback, where
flash-linear-attention is not installed), in one run, as ratios: a prompt's forward and
forward+backward (``torch_chunk_gated_delta_rule``), the backward from kept or recomputed chunk
states, bf16 against fp32, a packed batch against one sequence, the memory of a long training
step, a decoding step (``torch_recurrent_gated_delta_rule``) beside one ``copy_`` of the state, the
bound of a step that reads and writes it once, where linear attention overtakes attnkit's causal
softmax attention as the sequence grows, and a Qwen3.5-shaped model's training step. Usage:
``python scripts/bench-linear.py`` (needs transformers)."""

from __future__ import annotations

import subprocess
import sys

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from attnkit import gated_delta_rule
from attnkit.bench.measure import median_seconds
from attnkit.bench.report import machine
from attnkit.linear import kernel, which_gated_delta_rule


def median_s(fn, repeats: int, warmups: int = 3) -> float:
    return median_seconds(fn, repeats, warmups)


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


def training(xs, **options) -> None:
    gated_delta_rule(*xs, use_qk_l2norm=True, **options)[0].sum().backward()


def kept_or_recomputed() -> None:
    """The backward from the forward's kept chunk states, or from a first pass over the chunks."""
    print("| b, t, heads x dim | kept states s | recomputed states s | kept / recomputed |")
    print("|---|---:|---:|---:|")
    b, t, h, d = 1, 4096, 16, 128
    xs = inputs(b, t, h, d, grad=True)
    times = []
    for keep in (True, False):
        kernel.KEEP_STATES = keep
        times.append(median_s(lambda: training(xs), 5))
    kernel.KEEP_STATES = True
    print(f"| {b}, {t}, {h} x {d} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.2f} |")


def bf16_against_fp32() -> None:
    print("| b, t, heads x dim | pass | fp32 s | bf16 s | bf16 / fp32 |")
    print("|---|---|---:|---:|---:|")
    b, t, h, d = 1, 4096, 16, 128
    for mode in ("forward", "forward+backward"):
        grad = mode != "forward"
        times = []
        for dtype in (torch.float32, torch.bfloat16):
            xs = [x.detach().to(dtype).requires_grad_(grad) for x in inputs(b, t, h, d)]
            with torch.set_grad_enabled(grad):
                run = (lambda xs=xs: training(xs)) if grad else (lambda xs=xs: ours(xs))
                times.append(median_s(run, 5))
        print(f"| {b}, {t}, {h} x {d} | {mode} | {times[0]:.3f} | {times[1]:.3f} | "
              f"{times[1] / times[0]:.2f} |")  # fmt: skip


def ours(xs, **options) -> None:
    gated_delta_rule(*xs, use_qk_l2norm=True, **options)


def packed() -> None:
    """8 sequences of mixed lengths in one row (``cu_seqlens``) against one sequence as long."""
    print("| sequences (tokens) | heads x dim | pass | one sequence s | packed s | packed / one |")
    print("|---|---|---|---:|---:|---:|")
    lengths, h, d = [1, 17, 64, 100, 333, 512, 1000, 2069], 16, 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    for mode in ("forward", "forward+backward"):
        grad = mode != "forward"
        xs = inputs(1, t, h, d, grad=grad)
        run = training if grad else ours
        with torch.set_grad_enabled(grad):
            one = median_s(lambda run=run, xs=xs: run(xs), 5)
            many = median_s(lambda run=run, xs=xs: run(xs, cu_seqlens=cu), 5)
        print(f"| 8 ({t}) | {h} x {d} | {mode} | {one:.3f} | {many:.3f} | {many / one:.2f} |")


def resident_kib(field: str = "VmRSS") -> int:
    """This process's resident memory now (``VmRSS``) or at its peak (``VmHWM``), in KiB (Linux)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def memory() -> None:
    """The peak memory a forward+backward adds to a fresh process that holds its inputs, against
    the size of its inputs (q, k, v, g, beta) and output."""
    print(
        "| b, t, heads x dim | inputs and output MiB | added at the peak MiB | peak / (inputs and output) |"
    )
    print("|---|---:|---:|---:|")
    b, t, h, d = 1, 65536, 4, 128
    script = (
        "import sys\n"
        "sys.path.insert(0, 'scripts')\n"
        "bench = __import__('bench-linear')\n"
        "bench.training(bench.inputs(1, 128, 1, 8, grad=True))\n"  # the kernel loaded
        f"xs = bench.inputs({b}, {t}, {h}, {d}, grad=True)\n"
        "start = bench.resident_kib()\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"  # the peak (VmHWM) starts again here
        "bench.training(xs)\n"
        "print(start, bench.resident_kib('VmHWM'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    start, peak = (int(x) / 1024 for x in out.stdout.split()[-2:])
    sizes = (4 * b * t * h * d + 2 * b * t * h) * 4 / 2**20  # q, k, v, o; g, beta
    print(
        f"| {b}, {t}, {h} x {d} | {sizes:.0f} | {peak - start:.0f} | {(peak - start) / sizes:.2f} |"
    )


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
    for t in (512, 1024, 2048, 4096, 8192, 16384):
        xs = inputs(1, t, 4, 128, grad=True)
        heads = [x.detach().transpose(1, 2).requires_grad_() for x in xs[:3]]  # (b, h, t, d)

        def softmax(heads=heads):
            attention(*heads, causal=True).sum().backward()

        def linear(xs=xs):
            gated_delta_rule(*xs, use_qk_l2norm=True)[0].sum().backward()

        a, b = median_s(softmax, 3, 1), median_s(linear, 3, 1)
        print(f"| {t} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


def qwen35_step() -> None:
    """A training step (forward, loss, backward) of a Qwen3.5-shaped model (4 layers, three Gated
    DeltaNet layers to one softmax layer, hidden 512, heads of 128), on transformers' own path and
    with its linear-attention layers on attnkit (``attnkit.hf.linear.use_gated_delta_rule``); the
    softmax layer runs torch's SDPA both ways."""
    import transformers

    from attnkit.hf.linear import use_gated_delta_rule

    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
    )  # fmt: skip
    model = transformers.Qwen3_5ForCausalLM(config).train()
    b, t = 1, 2048
    ids = torch.randint(0, config.vocab_size, (b, t))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    theirs_s = median_s(step, 3, 1)
    loss, grads = step()
    undo = use_gated_delta_rule()
    try:
        ours_s = median_s(step, 3, 1)
        our_loss, our_grads = step()
    finally:
        undo()
    worst = max(float((a - b_).abs().max() / b_.abs().max().clamp_min(1e-30))
                for a, b_ in zip(our_grads, grads))  # fmt: skip
    print(
        "| model, b x t | transformers s | attnkit s | attnkit / transformers | loss, theirs vs ours | worst gradient difference / its largest |"
    )
    print("|---|---:|---:|---:|---|---:|")
    print(f"| Qwen3.5-shaped (4 layers, 3:1, hidden 512), {b} x {t} | {theirs_s:.3f} | "
          f"{ours_s:.3f} | {ours_s / theirs_s:.2f} | {float(loss):.5f} vs {float(our_loss):.5f} | "
          f"{worst:.1e} |")  # fmt: skip


if __name__ == "__main__":
    m = machine()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_features']})\n")
    q = torch.randn(1, 4096, 16, 128)
    print(f"attnkit's form: {which_gated_delta_rule(q, q, q).reason}\n")
    sections = sys.argv[1:] or ["prompts", "kept_or_recomputed", "bf16_against_fp32", "packed",
                                "memory", "steps", "crossing", "qwen35_step"]  # fmt: skip
    for name in sections:
        globals()[name]()
        print()
