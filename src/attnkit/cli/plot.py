"""``attnkit plot``: attention weights as a heatmap (PNG)."""

from __future__ import annotations

import argparse

from attnkit.cli.common import check_output, model_encoding
from attnkit.explain import Example, layer_and_head
from attnkit.textbook import simple_self_attention


def add(commands) -> None:
    pl = commands.add_parser(
        "plot",
        help="draw attention weights as a heatmap (PNG)",
        description=(
            "Draw the chapter's example (simplified self-attention) or one head of a real model "
            "as a heatmap with token labels, or every head of a layer as a grid."
        ),
    )
    pl.add_argument("-o", "--output", required=True, metavar="FILE.png", help="where to write")
    pl.add_argument("--text", help="your own text (with --model; the chapter's sentence otherwise)")
    pl.add_argument("--model", choices=["minilm"], help="all-MiniLM-L6-v2 (the 'models' extra)")
    pl.add_argument("--layer", type=int, help="--model: the layer, from 0 (default: the last)")
    pl.add_argument("--head", type=int, default=0, help="--model: the head, from 0 (default 0)")
    pl.add_argument("--all-heads", action="store_true", help="--model: every head of the layer")
    pl.add_argument("--causal", action="store_true", help="the chapter's example, causal")
    pl.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.views import plot_head, plot_layer

    output = check_output(args.output, ".png")
    if args.model is None:
        if args.layer is not None or args.all_heads or args.head != 0:
            raise ValueError("--layer, --head and --all-heads need --model")
        if args.text is not None:
            raise ValueError("--text needs --model (the chapter's example has its own sentence)")
        example = Example.journey()
        weights = simple_self_attention(example.embeddings, causal=args.causal).weights
        title = "simplified self-attention" + (", causal" if args.causal else "")
        plot_head(weights, example.tokens, output, title)
    else:
        if args.causal:
            raise ValueError("--causal does not apply to --model")
        encoding = model_encoding(args)
        layer = layer_and_head(encoding, args.layer, args.head)
        if args.all_heads:
            plot_layer(encoding.attentions[layer], encoding.tokens, output, f"layer {layer}")
        else:
            weights = encoding.attentions[layer, args.head]
            plot_head(weights, encoding.tokens, output, f"layer {layer}, head {args.head}")
    print(f"wrote {output}")
    return 0
