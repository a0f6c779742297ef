"""Where attnkit's time goes around torch's SDPA on plain attention on this GPU, and what each piece
of the NaN rule costs, with the candidates for its costliest pieces. Plain attention, bf16, b=4,
h=16, d=128, N=4096 (the goal's shapes). Run by scripts/gpu-check.sh; prints two tables. Without a
GPU it runs the same on the CPU at a smaller size, as a check that it runs.

The first table: each call's median, timed as the bench times it (a clock around the call and a
synchronisation), the host's time until the call returns, and the device's time between two
events around it. The second: each piece alone, on SDPA's own output (in the memory layout its
kernel gives), the median of many runs between events."""

import statistics
import time

import torch
import torch.nn.functional as F

from attnkit import attention
from attnkit.backends.sdpa import nans_seen
from attnkit.rules.nonfinite import zero_or_nan_rows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SHAPE = (4, 16, 4096, 128) if CUDA else (1, 4, 256, 32)
NAN = float("nan")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Clock:
    """The device's time between two points: CUDA events, or the host's clock on a CPU."""

    def __init__(self) -> None:
        if CUDA:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))

    def begin(self) -> None:
        self.start.record() if CUDA else setattr(self, "t0", time.perf_counter())

    def stop(self) -> None:
        self.end.record() if CUDA else setattr(self, "t1", time.perf_counter())

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3 if CUDA else self.t1 - self.t0


def sdpa_then_rule(q, k, v, causal):
    """SDPA, then attnkit's rule alone: its functions without the rest of attnkit's call."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with torch.no_grad():
        bad = torch.isnan(nans_seen(q.detach(), k.detach(), causal))
    return torch.where(bad, NAN, out) if out.requires_grad else out.masked_fill_(bad, NAN)


def timed(fn, grad, repeats=40, warmups=5):
    """(ms with a synchronisation, host ms until return, device ms between events), medians."""

    def once():
        if not grad:
            with torch.inference_mode():
                return fn()
        out = fn()
        out.backward(torch.ones_like(out))
        return out

    for _ in range(warmups):
        once()
    sync()
    wall, host, device = [], [], []
    clock = Clock()
    for _ in range(repeats):
        start = time.perf_counter()
        clock.begin()
        once()
        returned = time.perf_counter()
        clock.stop()
        sync()
        wall.append(time.perf_counter() - start)
        host.append(returned - start)
        device.append(clock.seconds())
    return [statistics.median(x) * 1e3 for x in (wall, host, device)]


def calls(causal: bool, grad: bool) -> None:
    q, k, v = (
        torch.randn(SHAPE, device=DEVICE, dtype=torch.bfloat16, requires_grad=grad)
        for _ in range(3)
    )
    variants = {
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "attnkit": lambda: attention(q, k, v, causal=causal),
        "sdpa + rule": lambda: sdpa_then_rule(q, k, v, causal),
    }
    case = f"{'causal' if causal else 'full'} {'fwd+bwd' if grad else 'fwd'} N={SHAPE[2]}"
    base = None
    for name, fn in variants.items():
        ms, host, device = timed(fn, grad)
        base = base or ms
        print(f"{case:24s} {name:26s} {ms:7.3f} {ms / base:7.2f} {host:8.3f} {device:7.3f}")


def piece_ms(fn, repeats=50) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        clock = Clock()
        clock.begin()
        fn()
        clock.stop()
        sync()
        times.append(clock.seconds())
    return statistics.median(times) * 1e3


def first_bad_key(flags, t):
    """Which rows see a flagged key, causally, from the first flagged key's index (a reduction)
    rather than a cumulative sum (a scan): the candidate for `nans_seen`'s causal part."""
    s = flags.shape[-1]
    index = torch.arange(s, device=flags.device)
    first = torch.where(flags.isnan(), index, s).amin(dim=-1, keepdim=True)
    return index[s - t :] >= first


def pieces() -> None:
    q, k, v = (torch.randn(SHAPE, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        bad = torch.isnan(nans_seen(q, k, True))  # (b, h, t, 1), all False
        keys = zero_or_nan_rows(k)
        factor = torch.where(bad, NAN, 1.0).to(out.dtype)
        order = "(b, t, h, d)" if out.transpose(1, 2).is_contiguous() else "(b, h, t, d)"
        print(f"\nSDPA's output is laid out as {order}; each piece alone, ms:")
        candidates = {
            "read q: product with zeros": lambda: zero_or_nan_rows(q),
            "read k: product with zeros": lambda: zero_or_nan_rows(k),
            "causal rows seen: cumsum (now)": lambda: keys.cumsum(dim=-1),
            "causal rows seen: first bad key": lambda: first_bad_key(keys, SHAPE[2]),
            "fill: masked_fill_ (now)": lambda: out.masked_fill_(bad, NAN),
            "fill: where (with a gradient)": lambda: torch.where(bad, NAN, out),
            "fill: mul_ by 1 or NaN": lambda: out.mul_(factor),
            "fill: masked_fill_ in memory order": lambda: out.transpose(1, 2).masked_fill_(
                bad.transpose(1, 2), NAN
            ),
            "copy of the output (read + write)": lambda: out.clone(),
        }
        for name, fn in candidates.items():
            print(f"  {name:40s} {piece_ms(fn):8.4f}")


print(f"{'case':24s} {'variant':26s} {'ms':>7s} {'x sdpa':>7s} {'host ms':>8s} {'dev ms':>7s}")
for causal, grad in [(False, False), (True, False), (True, True)]:
    calls(causal, grad)
pieces()
