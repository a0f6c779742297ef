"""Generate text-like tokens with a small decoder built from attnkit modules, with and without a KV cache.

The model is a stack of pre-norm decoder blocks (grouped-query attention with rotary positions, then
an MLP), with random weights: what matters here is the mechanics. Without a cache every new token
runs the whole sequence through the model again; with one, each block keeps the keys and values of
the tokens it has seen, and a new token costs one row.

    python examples/decode.py --prompt 512 --new 64
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor, nn

from attnkit import KVCache, MultiHeadAttention


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, context: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = MultiHeadAttention(
            width, width, context, 0.1, heads, num_kv_heads=kv_heads, rope=True, causal=True
        )
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(
        self, vocab: int, width: int, heads: int, kv_heads: int, layers: int, context: int
    ):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads, context) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def new_caches(self, batch_size: int) -> list[KVCache]:
        attn = self.blocks[0].attn
        return [
            KVCache(batch_size, attn.num_kv_heads, self.context, attn.head_dim) for _ in self.blocks
        ]

    def forward(self, ids: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """Logits ``(b, t, vocab)`` for token ids ``(b, t)``, after the cached tokens if any."""
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))


@torch.no_grad()
def generate(model: TinyDecoder, prompt: Tensor, new: int, use_cache: bool) -> tuple[Tensor, float]:
    """Greedy decoding of ``new`` tokens; returns them and the seconds they took."""
    start = time.perf_counter()
    ids = prompt
    if use_cache:
        caches = model.new_caches(prompt.shape[0])
        logits = model(prompt, caches)  # the prompt once
        for _ in range(new):
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            logits = model(token, caches)  # one row per block
    else:
        for _ in range(new):
            token = model(ids)[:, -1].argmax(dim=-1, keepdim=True)  # everything again
            ids = torch.cat([ids, token], dim=1)
    return ids[:, prompt.shape[1] :], time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt length")
    parser.add_argument("--new", type=int, default=64, help="tokens to generate")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    context = args.prompt + args.new
    model = TinyDecoder(args.vocab, args.width, args.heads, args.kv_heads, args.layers, context)
    model.eval()  # dropout off: decoding is inference
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    for use_cache in (True, False):  # untimed: the first calls load attnkit's C++ kernels
        generate(model, prompt[:, :8], 2, use_cache)
    cached, cached_s = generate(model, prompt, args.new, use_cache=True)
    recomputed, recomputed_s = generate(model, prompt, args.new, use_cache=False)
    print(f"{args.new} tokens after a {args.prompt}-token prompt, {args.layers} blocks:")
    print(f"  with a KV cache: {cached_s:.3f} s ({args.new / cached_s:.0f} tokens/s)")
    print(f"  recomputing:     {recomputed_s:.3f} s ({args.new / recomputed_s:.1f} tokens/s)")
    print(f"  speed-up: {recomputed_s / cached_s:.1f}x")
    print(f"  same tokens: {torch.equal(cached, recomputed)}")
    print(f"  first tokens: {cached[0, :10].tolist()}")


if __name__ == "__main__":
    main()
