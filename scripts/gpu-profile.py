"""Where attnkit's time goes around torch's kernels on this GPU: the CUDA kernels of a few calls of
`attention` (plain causal attention at N=4096, one decoding step over a 32k cache, a document mask
at N=8192 forward and backward), from torch.profiler, beside those of torch's SDPA or compiled
FlexAttention. Run by scripts/gpu-check.sh; prints one table per case (``--only document``: that
case alone)."""

import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import attnkit
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
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    )


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def document_case() -> None:
    """8 packed documents, causal within each, N=8192, forward and backward (the bench's case)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = 8192
    documents = torch.arange(n, device="cuda") * 8 // n

    def mask_mod(b, h, q_idx, kv_idx):
        return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

    q, k, v = (bf16(4, 16, n, 128).requires_grad_() for _ in range(3))
    ours = attnkit.create_block_mask(mask_mod, None, None, n, n, device="cuda")
    theirs = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def step(fn):
        out = fn()
        out.backward(torch.ones_like(out))

    report(
        "attnkit document N=8192 fwd+bwd", lambda: step(lambda: attention(q, k, v, block_mask=ours))
    )
    report(
        "torch flex document N=8192 fwd+bwd",
        lambda: step(lambda: compiled(q, k, v, block_mask=theirs)),
    )


if sys.argv[1:] == ["--only", "document"]:
    document_case()
    sys.exit()
q, k, v = bf16(4, 16, 4096, 128), bf16(4, 16, 4096, 128), bf16(4, 16, 4096, 128)
report("attnkit causal N=4096", lambda: attention(q, k, v, causal=True))
report("torch SDPA causal N=4096", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
q1, kc, vc = bf16(8, 32, 1, 128), bf16(8, 8, 32768, 128), bf16(8, 8, 32768, 128)
report("attnkit decode 32k", lambda: attention(q1, kc, vc, causal=True))
report("torch SDPA decode 32k", lambda: F.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True))
document_case()
