"""Multi-head latent attention's decoding step beside reading its cache once and beside attention
over the decompressed cache, in one run, as ratios: DeepSeek-V3's head shapes (latent 512, RoPE
key 64, keys of 128 + 64 and values of 128 a head) scaled to 16 heads, a cache of 32768 tokens,
bf16, b=1. The absorbed step is the layer's middle product, attention of the 16 heads' latent
queries over the cache's rows (``attnkit.MultiHeadLatentAttention`` runs it so); the decompressed
one attends over every head's keys and values, as transformers' DeepSeek-V3 caches them.
Usage: ``python scripts/bench-latent.py``."""

from __future__ import annotations

import torch

from attnkit import LatentCache, attention
from attnkit.bench.measure import median_seconds
from attnkit.bench.report import machine
from attnkit.functional import which_backend

HEADS, LATENT, ROPE, NOPE, VALUE, TOKENS = 16, 512, 64, 128, 128, 32768


def median_s(fn, repeats: int = 30, warmups: int = 5) -> float:
    return median_seconds(fn, repeats, warmups)


def main() -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    cache = LatentCache(1, TOKENS, LATENT, ROPE, dtype=dtype)
    cache.append(
        torch.randn(1, TOKENS, LATENT, dtype=dtype), torch.randn(1, TOKENS, ROPE, dtype=dtype)
    )
    query = torch.randn(1, HEADS, 1, LATENT + ROPE, dtype=dtype)
    keys = torch.randn(1, HEADS, TOKENS, NOPE + ROPE, dtype=dtype)
    values = torch.randn(1, HEADS, TOKENS, VALUE, dtype=dtype)
    full_query = torch.randn(1, HEADS, 1, NOPE + ROPE, dtype=dtype)
    copy = torch.empty_like(cache.tokens)
    with torch.no_grad():
        read = median_s(lambda: copy.copy_(cache.tokens))
        absorbed = median_s(lambda: attention(query, cache.keys(), cache.latents()))
        decompressed = median_s(lambda: attention(full_query, keys, values))
    latent_bytes = cache.tokens.numel() * cache.tokens.element_size()
    full_bytes = (keys.numel() + values.numel()) * keys.element_size()
    m = machine()
    print(f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['cpu_features']})\n")
    print(f"absorbed: {which_backend(query, cache.keys(), cache.latents()).backend}; "
          f"decompressed: {which_backend(full_query, keys, values).backend}\n")  # fmt: skip
    print("| what | ms | ratio |")
    print("|---|---:|---:|")
    print(
        f"| `copy_` of the latent cache ({latent_bytes / 2**20:.0f} MiB) | {read * 1e3:.2f} | 1 |"
    )
    print(f"| absorbed step over it | {absorbed * 1e3:.2f} | {absorbed / read:.2f}x the copy |")
    print(f"| attention over the decompressed cache ({full_bytes / 2**20:.0f} MiB) | "
          f"{decompressed * 1e3:.2f} | {decompressed / absorbed:.2f}x the absorbed step |")  # fmt: skip
    print(f"\nlatent cache / decompressed cache: {latent_bytes / full_bytes:.4f} "
          f"((512 + 64) / (16 x (192 + 128)))")  # fmt: skip


if __name__ == "__main__":
    main()
