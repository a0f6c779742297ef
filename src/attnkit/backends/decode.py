"""The decode backend: a handful of queries over a long key/value cache, in one pass over the cache.

Each decoding step reads the whole cache, so its speed is the memory bus's. torch's SDPA and the naive
path compute ``q . K`` and ``weights . V`` as two matrix-vector products, reading the cache twice per
query head group, and in bf16 on CPUs without bf16 matrix units they run several times slower than
the bus. This backend runs a small C++ kernel (``decode.cpp``, built once for this CPU and kept:
`attnkit.kernels.loader`) that streams each key/value head once for all the query
rows that share it (GQA groups included), with FlashAttention's online softmax; the splits of the keys
that the threads share are merged here.

It computes plain scaled dot-product attention with an optional ``key_mask`` (ragged batches) and
learned sinks, for
CPU tensors in float32, bfloat16 or float16 that need no gradient, with at most
[`MAX_ROWS`][attnkit.backends.decode.MAX_ROWS] query rows per key/value head. Where the kernel cannot be built (no C++ compiler;
or ``ATTNKIT_NATIVE=0``), [`refuses`][attnkit.backends.decode.refuses] says why and ``auto`` uses SDPA instead.

The same build holds the other half of a decoding step's memory traffic, the projections of a
few token rows ([`attnkit.kernels.gemv`][attnkit.kernels.gemv]).
"""

from __future__ import annotations

import torch

from attnkit import force
from attnkit._tracing import traced
from attnkit.backends.base import Backend, Route
from attnkit.call import AttentionOutput, Call, forward_ad_active
from attnkit.kernels import loader

MAX_ROWS = 16
"""The most query rows per key/value head (GQA group size x queries) the kernel takes."""
MAX_HEAD_DIM = 576
"""The widest key or value head the kernel takes: multi-head latent attention's decoding step
attends with keys of the latent and its RoPE key (DeepSeek-V3: 512 + 64)."""
PAIRS_FROM_ROWS = 8
"""The fewest query rows per key/value head that the kernel takes as the lanes of bf16 pair
products (fewer would leave most of a vector's 16 lanes idle); the kernel's ``kPairsFrom``."""
MIN_KEYS_PER_SPLIT = 1024
"""The shortest split of the keys that a thread streams on its own."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_SINKS = torch.empty(0)

KERNEL = loader.KERNELS["decode"]


def refuses(call: Call) -> str | None:
    """Why the decode kernel cannot run ``call`` (None if it can); the registry checks the options.
    Never builds or loads the kernel: a build that is at hand or can be made counts."""
    q, k, v = call.q, call.k, call.v
    _, h, t, d = q.shape
    rows = t * (h // k.shape[1])
    if not q.is_cpu:
        return f"tensors on {q.device.type} (the decode kernel is CPU-only)"
    if rows > MAX_ROWS:  # first of the rest: most calls that are not a decoding step stop here
        return f"{rows} query rows per key/value head (the decode kernel takes at most {MAX_ROWS})"
    if torch.jit.is_tracing() or traced():
        return "under torch.jit.trace or torch.compile (neither can see into the C++ kernel)"
    if torch._C._are_functorch_transforms_active() or forward_ad_active():
        return (
            "under a torch.func transform or forward-mode AD (the C++ kernel takes plain tensors)"
        )
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (the decode kernel takes float32, bfloat16 or float16)"
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, call.sinks)
    ):
        return "inputs that require grad (the decode kernel has no backward)"
    if max(d, v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims {d}/{v.shape[-1]} (the decode kernel takes up to {MAX_HEAD_DIM})"
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        return "q, k or v with a non-contiguous last dim"
    if not k.dtype == v.dtype == q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (q, k and v must share one)"
    usable, why = KERNEL.usable()
    return None if usable else f"without its kernel: {why}"


def decode(call: Call) -> AttentionOutput:
    """Shapes ``q (b, h, t, d)``, ``k`` ``(b, h_kv, s, d)`` and ``v`` ``(b, h_kv, s, d_v)`` (a view
    of ``k``'s rows too), few query rows (see
    [`refuses`][attnkit.backends.decode.refuses]). The kernel groups the query heads of each key/value head and splits the keys
    so that every thread has work, into no more than ``s //`` [`MIN_KEYS_PER_SPLIT`][attnkit.backends.decode.MIN_KEYS_PER_SPLIT] splits.

    Raises:
        attnkit.kernels.loader.KernelUnavailableError: the kernel could not be built or loaded now (the
            registry then chooses again).
    """
    kernel = KERNEL.require("backend 'decode'")
    key_mask = call.masks.key_mask
    mask = _NO_MASK if key_mask is None else key_mask.contiguous()
    sinks = _NO_SINKS if call.sinks is None else call.sinks.float().contiguous()
    min_keys = force.split_size() or MIN_KEYS_PER_SPLIT
    out = kernel.decode(call.q, call.k, call.v, mask, sinks, call.scale, min_keys)
    return AttentionOutput(out)


class DecodeBackend(Backend):
    """A few queries over a long key/value cache, in one pass over the cache."""

    name = "decode"
    supports = frozenset({"key_mask", "sinks"})
    reads_padding = False  # the kernel skips masked keys: no copy of a long cache

    def refuses(self, call: Call) -> str | None:
        return refuses(call)

    def path(self, call: Call) -> Route:
        """``native``, with bf16 pair products (``"bf16-avx512_bf16"``) where 8 to 16 query rows
        share a key/value head of a bf16 cache whose head dims are multiples of 32 and the build
        has AVX512-BF16 (`decode_pairs.h`), else float32."""
        q, k, v = call.q, call.k, call.v
        rows = q.shape[1] // k.shape[1] * q.shape[2]
        pairs = q.dtype == torch.bfloat16 and rows >= PAIRS_FROM_ROWS
        if pairs and q.shape[-1] % 32 == 0 and v.shape[-1] % 32 == 0 and KERNEL.has_avx512_bf16():
            return Route("native", "bf16-avx512_bf16")
        return Route("native", "float32")

    def run(self, call: Call) -> AttentionOutput:
        return decode(call)


BACKEND = DecodeBackend()
