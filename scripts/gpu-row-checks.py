"""Which per-row check of non-finite values reads a tensor fastest on this GPU: the candidates for
attnkit's NaN rule on CUDA (rules/nonfinite.py), timed on a decoding step's keys, beside a copy.
Run by scripts/gpu-check.sh; prints one line per candidate."""

import math
import time

import torch

x = torch.randn(8, 8, 32768, 128, device="cuda", dtype=torch.bfloat16)  # 512 MiB
zero = x.new_zeros(1, 128, 1).expand(64, 128, 1)
candidates = {
    "copy (read + write)": lambda: torch.empty_like(x).copy_(x),
    "vector_norm(inf, dim=-1)": lambda: torch.linalg.vector_norm(x, ord=math.inf, dim=-1),
    "aminmax(dim=-1)": lambda: torch.aminmax(x, dim=-1),
    "sum(dim=-1, float32)": lambda: x.sum(dim=-1, dtype=torch.float32),
    "isfinite(x).all(dim=-1)": lambda: torch.isfinite(x).all(dim=-1),
    "sum() of all": lambda: x.sum(dtype=torch.float32),
    "bmm with zeros (attnkit's)": lambda: torch.bmm(x.flatten(0, 1), zero).isnan(),
}
for name, fn in candidates.items():
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 20
    print(f"{name:28s} {seconds * 1e3:7.3f} ms  {x.nbytes / seconds / 1e9:7.0f} GB/s of x read")
