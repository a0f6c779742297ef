"""The user functions' long-sequence goal (docs/bench/goals.md): one forward and backward at
N=65536, b=1, h=1, d=64, fp32, of a causal mask within 8 documents (a block mask from
`create_block_mask`) and a learned relative bias (a `score_mod` reading a table that trains), with
the peak growth of this process's resident memory over its set-up. Prints one line.

    python scripts/flex-n65536.py
"""

import time

import torch

from attnkit.bench.measure import peak_mib, reset_peak, resident_mib
from attnkit.block_mask import create_block_mask
from attnkit.flex import flex_attention

N, D, DOCUMENTS = 65536, 64, 8

torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, N, D, requires_grad=True) for _ in range(3))
table = (torch.randn(1, 2 * N - 1) * 0.1).requires_grad_()
documents = torch.arange(N) * DOCUMENTS // N


def causal_within_documents(b, h, q_idx, kv_idx):
    return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + table[h, q_idx - kv_idx + N - 1]


base = resident_mib()
reset_peak()
began = time.perf_counter()
block_mask = create_block_mask(causal_within_documents, 1, 1, N, N)
masked = time.perf_counter()
out = flex_attention(q, k, v, score_mod=relative_bias, block_mask=block_mask)
out.sum().backward()
done = time.perf_counter()
finite = all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v, table))
print(
    f"N={N}: block mask {masked - began:.1f} s, forward+backward {done - masked:.1f} s, "
    f"peak extra {peak_mib() - base:.0f} MiB; every gradient finite: {finite}"
)
