"""Where attnkit's time goes around torch's SDPA on this GPU: the CUDA kernels of a few calls of
`attention` (plain causal attention at N=4096, one decoding step over a 32k cache), from
torch.profiler, beside SDPA's own. Run by scripts/gpu-check.sh; prints one table per case."""

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from attnkit import attention


def report(name: str, fn, calls: int = 10) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"\n--- {name}: {calls} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


q, k, v = bf16(4, 16, 4096, 128), bf16(4, 16, 4096, 128), bf16(4, 16, 4096, 128)
report("attnkit causal N=4096", lambda: attention(q, k, v, causal=True))
report("torch SDPA causal N=4096", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
q1, kc, vc = bf16(8, 32, 1, 128), bf16(8, 8, 32768, 128), bf16(8, 8, 32768, 128)
report("attnkit decode 32k", lambda: attention(q1, kc, vc, causal=True))
report("torch SDPA decode 32k", lambda: F.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True))
