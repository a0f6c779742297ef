"""``attnkit memory``: how much a model's cache holds while it generates, layer kind by layer
kind, at the context lengths asked, beside the same model with plain multi-head attention."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnkit.cli.common import check_counts, check_output

LENGTHS = [4096, 32768, 131072]
"""The context lengths reported when none are asked for."""

_SAYS = {
    "full": "softmax, every token",
    "sliding": "softmax, a sliding window",
    "latent": "latent (MLA)",
    "linear": "linear (a fixed state)",
    "shared": "shares another's cache",
}


def add(commands) -> None:
    from attnkit.kv_memory import BYTES, PRESETS

    me = commands.add_parser(
        "memory",
        help="the KV cache's bytes per token and at context lengths, for a config or a preset",
        description=(
            "How much memory a model's cache takes while it generates: bytes per token and at "
            "each context length, for the attention each layer uses (MHA, GQA, sliding windows, "
            "latent attention, linear attention's state, caches shared across layers), beside "
            "the same model with plain multi-head attention. Reads a Hugging Face config.json or "
            "a preset."
        ),
    )
    model = me.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="a model's numbers, built in")
    model.add_argument("--config", metavar="CONFIG.json", help="a Hugging Face config.json")
    me.add_argument("--lengths", type=int, nargs="+", metavar="N", help="context lengths")
    me.add_argument("--batch", type=int, default=1, help="sequences held at once (default 1)")
    me.add_argument("--dtype", default="bf16", choices=sorted(BYTES), help="the cache's dtype")
    me.add_argument("--plot", metavar="FILE.png", help="also draw bytes against context length")
    me.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnkit import kv_memory

    check_counts(args, ("lengths", "batch"))
    plot = check_output(args.plot, ".png") if args.plot else None
    if args.preset:
        config, name = kv_memory.PRESETS[args.preset], args.preset
    else:
        config, name = _read(args.config), None
    cache = kv_memory.from_config(config, dtype=args.dtype, name=name)
    plain = kv_memory.from_config(kv_memory.as_mha(config), dtype=args.dtype, name="as MHA")
    lengths = args.lengths or LENGTHS
    print(
        f"{cache.name}: {len(cache.layers)} layers, keys, values and latents in {args.dtype}, "
        f"linear attention's state in fp32, batch {args.batch}"
    )
    print(f"\n{'layers':>7}  {'kind':<34}{'bytes per token':>16}{'fixed bytes':>14}")
    for kind in kv_memory.KINDS:
        layers = [layer for layer in cache.layers if layer.kind == kind]
        if layers:
            window = f" of {layers[0].window:,}" if layers[0].window else ""
            per_token = sum(layer.per_token for layer in layers)
            fixed = sum(layer.fixed for layer in layers)
            kind_said = _SAYS[kind] + window
            print(f"{len(layers):>7}  {kind_said:<34}{per_token:>16,}{fixed:>14,}")
    fixed = sum(layer.fixed for layer in cache.layers)
    print(f"{'':>7}  {'in all':<34}{cache.per_token():>16,}{fixed:>14,}")
    print(f"\n{'context':>9}{'this model':>14}{'as MHA':>14}{'of MHA':>9}")
    for tokens in lengths:
        ours, theirs = cache.bytes_at(tokens, args.batch), plain.bytes_at(tokens, args.batch)
        print(f"{tokens:>9,}{_size(ours):>14}{_size(theirs):>14}{ours / theirs:>9.3f}")
    if plot is not None:
        _draw(cache, plain, lengths, args.batch, plot)
        print(f"wrote {plot}")
    return 0


def _read(path: str) -> dict:
    """The dict a config.json holds, or a one-line error naming the file."""
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object (a config.json)")
    return config


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.2f} {unit}"
    return f"{count} B"


def _draw(cache, plain, lengths: list[int], batch: int, output: Path) -> None:
    """Bytes against context length, the model beside plain MHA, as the book's estimators draw
    them."""
    from attnkit.views import pyplot

    plt = pyplot()
    longest = max(lengths)
    xs = sorted({*lengths, *(2**p for p in range(8, 40) if 2**p <= longest)})
    fig, ax = plt.subplots(figsize=(6, 4))
    for memory, label in ((cache, cache.name), (plain, "as MHA")):
        ax.plot(xs, [memory.bytes_at(x, batch) / 2**30 for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache (GiB)")
    ax.set_title(f"KV cache of {cache.name}, batch {batch}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
