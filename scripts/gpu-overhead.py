"""Where attnkit's time goes around torch's SDPA on plain attention on this GPU, and whether the NaN
rule's check of q and k can run beside SDPA's kernel on a second stream. Plain attention, bf16,
b=4, h=16, d=128, N=4096 (the goal's shapes). Run by scripts/gpu-check.sh; prints one table.

Each row is the median of many calls, timed as the bench times them (a clock around the call and
a synchronisation), plus the host's time until the call returns (no synchronisation), and the
GPU's time between two events around the call."""

import statistics
import time

import torch
import torch.nn.functional as F

from attnkit import attention
from attnkit.backends.sdpa import nans_seen

NAN = float("nan")
SIDE = torch.cuda.Stream()


def sdpa_then_rule(q, k, v, causal):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with torch.no_grad():
        bad = torch.isnan(nans_seen(q.detach(), k.detach(), causal))
    return out.masked_fill(bad, NAN) if out.requires_grad else out.masked_fill_(bad, NAN)


def sdpa_rule_beside(q, k, v, causal, check_first):
    """The rule's check on a second stream, forked before SDPA's kernel, joined before the fill."""
    main = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(main)
    if not check_first:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    SIDE.wait_event(ready)
    with torch.cuda.stream(SIDE), torch.no_grad():
        bad = torch.isnan(nans_seen(q.detach(), k.detach(), causal))
    if check_first:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    main.wait_stream(SIDE)
    bad.record_stream(main)
    return out.masked_fill(bad, NAN) if out.requires_grad else out.masked_fill_(bad, NAN)


def timed(fn, grad, repeats=40, warmups=5):
    """(ms with a synchronisation, host ms until return, GPU ms between events), medians."""

    def once():
        if not grad:
            with torch.inference_mode():
                return fn()
        out = fn()
        out.backward(torch.ones_like(out))
        return out

    for _ in range(warmups):
        once()
    torch.cuda.synchronize()
    wall, host, gpu = [], [], []
    for _ in range(repeats):
        start_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        start_event.record()
        once()
        returned = time.perf_counter()
        end_event.record()
        torch.cuda.synchronize()
        done = time.perf_counter()
        wall.append(done - start)
        host.append(returned - start)
        gpu.append(start_event.elapsed_time(end_event) / 1e3)
    return [statistics.median(x) * 1e3 for x in (wall, host, gpu)]


def report(causal: bool, grad: bool, shape=(4, 16, 4096, 128)) -> None:
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        for _ in range(3)
    )
    variants = {
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "attnkit": lambda: attention(q, k, v, causal=causal),
        "sdpa + rule, one stream": lambda: sdpa_then_rule(q, k, v, causal),
        "sdpa + rule beside, after": lambda: sdpa_rule_beside(q, k, v, causal, False),
        "sdpa + rule beside, first": lambda: sdpa_rule_beside(q, k, v, causal, True),
    }
    case = f"{'causal' if causal else 'full'} {'fwd+bwd' if grad else 'fwd'} N={shape[2]}"
    base = None
    for name, fn in variants.items():
        ms, host, gpu = timed(fn, grad)
        base = base or ms
        print(f"{case:24s} {name:26s} {ms:7.3f} {ms / base:7.2f} {host:8.3f} {gpu:7.3f}")


print(f"{'case':24s} {'variant':26s} {'ms':>7s} {'x sdpa':>7s} {'host ms':>8s} {'gpu ms':>7s}")
for causal, grad in [(False, False), (True, False), (True, True)]:
    report(causal, grad)
