"""``attnkit explain``: attention on the chapter's example, your own text, or a real model, step
by step."""

from __future__ import annotations

import argparse

from attnkit.cli.common import check_output, model_encoding
from attnkit.explain import Example, explain
from attnkit.textbook import simple_self_attention


def add(commands) -> None:
    ex = commands.add_parser(
        "explain",
        help="walk through self-attention: scores, weights, context",
        description=(
            "Walk through simplified self-attention (scores = x x^T, weights = softmax, "
            "context = weights x) on the chapter's example 'Your journey starts with one step', "
            "or on your own text."
        ),
    )
    ex.add_argument("--text", help="your own text, split on whitespace")
    source = ex.add_mutually_exclusive_group()
    source.add_argument(
        "--embeddings", metavar="FILE.json", help="JSON object mapping each token to its vector"
    )
    source.add_argument(
        "--dim", type=int, help="width of the random embeddings for --text (default 3)"
    )
    ex.add_argument("--seed", type=int, default=123, help="seed of the random embeddings")
    query = ex.add_mutually_exclusive_group()
    query.add_argument("--query", metavar="TOKEN", help="the query token (its first occurrence)")
    query.add_argument("--query-index", type=int, metavar="I", help="the query's position")
    ex.add_argument("--normalize", choices=["softmax", "sum"], default="softmax")
    ex.add_argument("--causal", action="store_true", help="each token sees only earlier ones")
    ex.add_argument(
        "--delta-rule",
        action="store_true",
        help="walk through linear attention with the gated delta rule instead: the memory, its "
        "prediction, the correction and the write, token by token",
    )
    ex.add_argument(
        "--latent",
        action="store_true",
        help="walk through one decoding step of multi-head latent attention (DeepSeek's MLA) "
        "instead: the cache of latents, the query folded into latent space, the output brought "
        "back to each head, with shapes",
    )
    ex.add_argument(
        "--beta", type=float, default=0.5, help="--delta-rule: how strongly a token writes"
    )
    ex.add_argument(
        "--decay", type=float, default=0.9, help="--delta-rule: what the memory keeps a step"
    )
    ex.add_argument(
        "--model",
        choices=["minilm"],
        help="a real model instead: all-MiniLM-L6-v2 (needs the 'models' extra)",
    )
    ex.add_argument("--layer", type=int, help="--model: the layer, from 0 (default: the last)")
    ex.add_argument("--head", type=int, default=0, help="--model: the head, from 0 (default 0)")
    ex.add_argument(
        "--html", metavar="FILE.html", help="also write an interactive head view (self-contained)"
    )
    ex.set_defaults(run=run)


def _explain_model(args: argparse.Namespace) -> int:
    from attnkit.explain import explain_model
    from attnkit.views import head_view_html, write_html

    for option in ("embeddings", "dim", "query_index"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option.replace('_', '-')} does not apply to --model")
    if args.causal or args.normalize != "softmax":
        raise ValueError("--causal and --normalize do not apply to --model")
    output = None if args.html is None else check_output(args.html, ".html")
    encoding = model_encoding(args)
    print(explain_model(encoding, layer=args.layer, head=args.head, query=args.query), end="")
    if output is not None:
        title = f"all-MiniLM-L6-v2: {encoding.text}"
        write_html(head_view_html(encoding.tokens, encoding.attentions, title), output)
        print(f"wrote {output}")
    return 0


def _explain_delta_rule(args: argparse.Namespace, example) -> int:
    from attnkit.explain_delta import explain_delta_rule

    for option in ("query", "query_index", "html"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option.replace('_', '-')} does not apply to --delta-rule")
    if args.causal or args.normalize != "softmax":
        raise ValueError("--causal and --normalize do not apply to --delta-rule (it is causal)")
    print(explain_delta_rule(example, beta=args.beta, decay=args.decay), end="")
    return 0


def _explain_latent(args: argparse.Namespace, example) -> int:
    from attnkit.explain_latent import explain_latent_step

    for option in ("query", "query_index", "html"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option.replace('_', '-')} does not apply to --latent")
    if args.causal or args.normalize != "softmax" or args.delta_rule:
        raise ValueError("--causal, --normalize and --delta-rule do not apply to --latent")
    print(explain_latent_step(example, seed=args.seed), end="")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.model is not None and (args.delta_rule or args.latent):
        raise ValueError("--delta-rule and --latent walk through their own layers, not --model")
    if args.model is not None:
        return _explain_model(args)
    for option in ("layer",):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option} needs --model")
    if args.embeddings is not None:
        example = Example.from_json(args.embeddings, args.text)
    elif args.text is not None:
        example = Example.random(args.text, 3 if args.dim is None else args.dim, args.seed)
    elif args.dim is not None:
        raise ValueError("--dim gives random embeddings for --text; add --text")
    else:
        example = Example.journey()

    if args.latent:
        return _explain_latent(args, example)
    if args.delta_rule:
        return _explain_delta_rule(args, example)
    if args.beta != 0.5 or args.decay != 0.9:
        raise ValueError("--beta and --decay set the gates of --delta-rule; add --delta-rule")
    if args.query is not None:
        query_index = example.index_of(args.query)
    elif args.query_index is not None:
        query_index = args.query_index
    else:
        query_index = min(1, len(example.tokens) - 1)  # the chapter's query is the second token
    output = None if args.html is None else check_output(args.html, ".html")
    print(
        explain(example, query_index=query_index, normalize=args.normalize, causal=args.causal),
        end="",
    )
    if output is not None:
        from attnkit.views import head_view_html, write_html

        result = simple_self_attention(
            example.embeddings, normalize=args.normalize, causal=args.causal
        )
        name = "simplified self-attention" + (", causal" if args.causal else "")
        page = head_view_html(
            example.tokens, result.weights[None, None], " ".join(example.tokens), [name]
        )
        write_html(page, output)
        print(f"wrote {output}")
    return 0
