"""Top-k sparse attention beside its peers, in one run, as ratios: attnkit's sparse backend
against attnkit's dense causal attention at the same shape (forward+backward, fp32 and bf16); the
peak memory of a training pass against transformers' ``sdpa`` path for DeepSeek-V3.2 (the
indices scattered into a dense ``(b, 1, t, s)`` mask); and a DeepSeek-V3.2-shaped model's
training step on attnkit against ``sdpa`` and ``eager``. The indices are what an indexer gives:
for each query, ``n`` distinct keys of its causal past in no particular order (all of them while
it has fewer). Usage: ``python scripts/bench-sparse.py [section ...]`` (the model's section needs
transformers)."""

from __future__ import annotations

import statistics
import subprocess
import sys

import torch

from attnkit import attention
from attnkit.bench.measure import Result, time_interleaved
from attnkit.bench.report import machine
from attnkit.functional import which_backend


def selection(t: int, n: int, b: int = 1) -> torch.Tensor:
    """``(b, t, n)``: for query i, n distinct keys of 0..i spread over it (one in each of n equal
    strata), shuffled; the first queries, which see fewer than n keys, take them all and -1."""
    i = torch.arange(t)[:, None].double()
    bounds = (torch.arange(n + 1)[None, :] * (i + 1) / n).floor()  # n strata of 0..i, none empty
    low, high = bounds[:, :-1], bounds[:, 1:]
    picked = (low + (torch.rand(t, n) * (high - low)).floor()).long()
    slots = torch.arange(n)[None, :].expand(t, n)
    early = torch.where(slots <= i.long(), slots, -1)
    chosen = torch.where(i < n, early, picked)
    return torch.stack([chosen.gather(-1, torch.rand(t, n).argsort(-1)) for _ in range(b)])


def leaves(b: int, h: int, t: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(b, h, t, d, dtype=dtype, requires_grad=True) for _ in range(3)]


def training_pass(q, k, v, **options) -> None:
    attention(q, k, v, causal=True, **options).sum().backward()
    for x in (q, k, v):
        x.grad = None


def speed(t: int = 32768, n: int = 2048, h: int = 4, d: int = 64) -> None:
    """Forward+backward of sparse attention against attnkit's dense causal attention, with a
    key/value head per query head, and with one shared by all (multi-query, as DeepSeek-V3.2
    runs its sparse attention on the latent)."""
    print(f"b=1, t=s={t}, n={n}, {h} query heads of {d}, forward+backward, medians of 5 after 2 "
          "warm-ups")  # fmt: skip
    print()
    print(
        "| dtype | key/value heads | dense causal s | sparse s | sparse / dense | pairs sparse / dense |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    indices = selection(t, n)
    pairs = float((indices >= 0).sum()) / (t * (t + 1) / 2)
    for dtype in (torch.float32, torch.bfloat16):
        for h_kv in (h, 1):
            q = torch.randn(1, h, t, d, dtype=dtype, requires_grad=True)
            k, v = leaves(1, h_kv, t, d, dtype)[:2]
            xs = (q, k, v)
            dense, sparse = Result("dense"), Result("sparse")
            time_interleaved(
                [(dense, lambda xs=xs: training_pass(*xs)),
                 (sparse, lambda xs=xs: training_pass(*xs, indices=indices))],
                repeats=5, warmups=2,
            )  # fmt: skip
            a, o = statistics.median(dense.times), statistics.median(sparse.times)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {h_kv} | {a:.2f} | {o:.2f} | {o / a:.3f} | {pairs:.3f} |")


MEMORY_PROBE = """
import sys
sys.path.insert(0, 'scripts')
import torch
bench = __import__('bench-sparse')
t, n, h, d, path = {t}, {n}, {h}, {d}, {path!r}
indices = bench.selection(t, n)
q, k, v = bench.leaves(1, h, t, d, torch.bfloat16)
bench.training_pass(*bench.leaves(1, 1, 64, 8, torch.bfloat16), indices=bench.selection(64, 4))
start = bench.resident_kib()
open('/proc/self/clear_refs', 'w').write('5')  # the peak (VmHWM) starts again here
if path == 'sdpa':
    bench.sdpa_pass(q, k, v, indices)
else:
    bench.training_pass(q, k, v, indices=indices)
print(start, bench.resident_kib('VmHWM'))
"""


def sdpa_pass(q, k, v, indices) -> None:
    """transformers' sdpa path for DeepSeek-V3.2: the model's additive causal mask, the indices
    scattered into a dense ``(b, 1, t, s)`` bool mask that masks it further, then SDPA."""
    b, _, t, _ = q.shape
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    lowest = torch.finfo(q.dtype).min
    mask = torch.zeros(b, 1, t, t, dtype=q.dtype).masked_fill(~causal, lowest)
    unselected = torch.ones(b, t, t, dtype=torch.bool).scatter(-1, indices.clamp_min(0), False)
    mask = mask.masked_fill(unselected.unsqueeze(1), lowest)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()


def resident_kib(field: str = "VmRSS") -> int:
    """This process's resident memory now (``VmRSS``) or at its peak (``VmHWM``), in KiB (Linux)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def memory(t: int = 32768, n: int = 2048, h: int = 4, d: int = 64) -> None:
    """The memory a bf16 training pass adds at its peak to a fresh process holding q, k, v and
    the indices."""
    print(
        f"b=1, t=s={t}, n={n}, {h} heads of {d}, bf16, forward+backward; each path in a fresh process"
    )
    print()
    print("| path | added at the peak MiB |")
    print("|---|---:|")
    added = {}
    for path in ("sdpa", "sparse"):
        script = MEMORY_PROBE.format(t=t, n=n, h=h, d=d, path=path)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        )
        start, peak = (int(x) / 1024 for x in out.stdout.split()[-2:])
        added[path] = peak - start
        label = "transformers' sdpa path (dense index mask)" if path == "sdpa" else "attnkit sparse"
        print(f"| {label} | {added[path]:.0f} |")
    print()
    print(f"attnkit / sdpa: {added['sparse'] / added['sdpa']:.4f}")


def model(t: int = 4096, layers: int = 4) -> None:
    """A DeepSeek-V3.2-shaped model's training step: attnkit against sdpa and eager, same weights."""
    import transformers

    import attnkit.hf

    config = transformers.DeepseekV32Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, index_topk=2048, index_head_dim=64, index_n_heads=4,
        first_k_dense_replace=1, max_position_embeddings=2 * t,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.DeepseekV32ForCausalLM(config)
    ids = torch.randint(0, 1024, (1, t))
    names = {"eager": "eager", "sdpa": "sdpa", "attnkit": attnkit.hf.register()}

    def step(name):
        net.set_attn_implementation(names[name])
        loss = net(ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        net.zero_grad()
        return float(loss.detach()), grads

    losses = {name: step(name) for name in names}

    def worst(name):  # the largest gradient difference from eager's, over eager's largest
        pairs = zip(losses[name][1], losses["eager"][1])
        return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in pairs)

    results = {name: Result(name) for name in names}
    time_interleaved([(results[n], lambda n=n: step(n)) for n in names], repeats=5, warmups=1)
    times = {n: statistics.median(r.times) for n, r in results.items()}
    print(f"DeepSeek-V3.2-shaped, {layers} layers, hidden 256, 4 heads, index_topk 2048, b=1, "
          f"t={t}, fp32 training step (forward+backward), medians of 5 after 1 warm-up")  # fmt: skip
    print()
    print("| attention | step s | / sdpa | loss |")
    print("|---|---:|---:|---|")
    for name in names:
        print(f"| {name} | {times[name]:.2f} | {times[name] / times['sdpa']:.2f} | "
              f"{losses[name][0]:.6f} |")  # fmt: skip
    print()
    print(
        "the largest gradient difference from eager's, over eager's largest: "
        f"attnkit {worst('attnkit'):.1e}, sdpa {worst('sdpa'):.1e}"
    )


if __name__ == "__main__":
    m = machine()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_features']})\n")
    q = torch.randn(1, 4, 64, 64)
    print(f"attnkit's path: {which_backend(q, q, q, indices=selection(64, 16), causal=True)}\n")
    for name in sys.argv[1:] or ["speed", "memory", "model"]:
        globals()[name]()
        print()
