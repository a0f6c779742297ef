"""The ``attnkit`` command.

``attnkit explain`` walks through attention on the chapter's example or on your own text;
``attnkit build`` builds the C++ kernels for this CPU ahead of use. Bad input prints one line,
``attnkit: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from attnkit import __version__
from attnkit.explain import Example, explain, layer_and_head
from attnkit.textbook import JOURNEY_TOKENS, simple_self_attention


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"attnkit: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit",
        description="Attention mechanisms on PyTorch: see them work, step by step.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
        "--model",
        choices=["minilm"],
        help="a real model instead: all-MiniLM-L6-v2 (needs the 'models' extra)",
    )
    ex.add_argument("--layer", type=int, help="--model: the layer, from 0 (default: the last)")
    ex.add_argument("--head", type=int, default=0, help="--model: the head, from 0 (default 0)")
    ex.add_argument(
        "--html", metavar="FILE.html", help="also write an interactive head view (self-contained)"
    )
    ex.set_defaults(run=_run_explain)

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
    pl.set_defaults(run=_run_plot)

    bu = commands.add_parser(
        "build",
        help="build the C++ kernels for this CPU now (else the first call that needs one does)",
        description=(
            "Build attnkit's C++ kernels (tiled.cpp, decode.cpp) for this CPU's level into the "
            "extensions folder (TORCH_EXTENSIONS_DIR, else torch's default), unless a wheel "
            "carries them prebuilt, and report what is built, for which CPU features, and where."
        ),
    )
    what = bu.add_mutually_exclusive_group()
    what.add_argument("--force", action="store_true", help="rebuild even where a build exists")
    what.add_argument("--check", action="store_true", help="build nothing: report what is there")
    bu.set_defaults(run=_run_build)

    from attnkit.bench.peers import KERNEL_IMPLS, VARIANTS

    be = commands.add_parser(
        "bench",
        help="time attnkit against torch SDPA, nn.MultiheadAttention, FlexAttention and naive",
        description=(
            "Measure attnkit's backends and modules side by side with their peers in one run: "
            "median times interleaved in one process, ratios to torch SDPA, GFLOP/s, the share of "
            "this machine's matmul throughput, and peak memory per case (each in a subprocess). "
            "With --decode: one decoding step over a KV cache against the memory bus's limit, "
            "cache sizes, and generation cached vs recomputed."
        ),
    )
    be.add_argument("--smoke", action="store_true", help="tiny sizes, every path, in seconds")
    be.add_argument(
        "--decode", action="store_true", help="decoding over a KV cache (--n: cache lengths)"
    )
    be.add_argument(
        "--ring",
        action="store_true",
        help="ring attention over processes joined by gloo (--n: lengths, --ranks: world sizes)",
    )
    be.add_argument("--ranks", type=int, nargs="+", help="--ring: world sizes")
    be.add_argument("--kv-heads", type=int, nargs="+", help="--decode: key/value heads (GQA)")
    be.add_argument("--prompts", type=int, nargs="+", help="--decode: prompt lengths (generation)")
    be.add_argument("--new-tokens", type=int, help="--decode: tokens generated after each prompt")
    be.add_argument("--n", type=int, nargs="+", metavar="N", help="sequence lengths")
    be.add_argument("--b", type=int, help="batch size (kernel cases)")
    be.add_argument("--h", type=int, help="heads")
    be.add_argument("--d", type=int, help="head dim")
    be.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16", "fp16"])
    be.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"])
    be.add_argument("--causal", choices=["both", "yes", "no"], default=None)
    be.add_argument("--impls", nargs="+", choices=list(KERNEL_IMPLS), help="kernel implementations")
    be.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="score modifiers")
    be.add_argument("--module", action="store_true", help="add the module cases (projections)")
    be.add_argument("--module-b", type=int)
    be.add_argument("--module-n", type=int)
    be.add_argument("--repeats", type=int, help="timed runs per case (median reported)")
    be.add_argument("--warmups", type=int)
    be.add_argument("--timeout", type=float, help="seconds a case may take before it is a timeout")
    be.add_argument("--out", default="bench-results", help="folder for results.{json,md,png}")
    be.set_defaults(run=_run_bench)
    return parser


def _check_counts(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _run_decode_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnkit.bench.decode import DecodeConfig, run_decode, write_decode

    _check_counts(args, ("n", "b", "h", "d", "kv_heads", "prompts", "new_tokens", "repeats"))
    for h_kv in args.kv_heads or []:
        if args.h is not None and args.h % h_kv:
            raise ValueError(f"--h ({args.h}) must be a multiple of every --kv-heads, got {h_kv}")
    overrides = {
        "lengths": None if args.n is None else tuple(args.n),
        "dtypes": None if args.dtypes is None else tuple(args.dtypes),
        "kv_heads": None if args.kv_heads is None else tuple(args.kv_heads),
        "prompts": None if args.prompts is None else tuple(args.prompts),
        "new_tokens": args.new_tokens,
        "b": args.b,
        "h": args.h,
        "d": args.d,
        "repeats": args.repeats,
        "warmups": args.warmups,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    smoke = args.smoke
    config = DecodeConfig.from_name("smoke", **overrides) if smoke else DecodeConfig(**overrides)
    written = write_decode(run_decode(config), Path(args.out))
    print(Path(written["markdown"]).read_text())
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


def _run_ring_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnkit.bench.ring import RingConfig, run_ring, write_ring

    _check_counts(args, ("n", "b", "h", "d", "ranks", "repeats"))
    overrides = {
        "ns": None if args.n is None else tuple(args.n),
        "worlds": None if args.ranks is None else tuple(args.ranks),
        "b": args.b,
        "h": args.h,
        "d": args.d,
        "repeats": args.repeats,
        "warmups": args.warmups,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    config = RingConfig.smoke(**overrides) if args.smoke else RingConfig(**overrides)
    for n in config.ns:
        for world in config.worlds:
            if n % (2 * world):
                raise ValueError(f"--n {n} must split into 2 x {world} equal chunks (--ranks)")
    written = write_ring(run_ring(config), Path(args.out))
    print(Path(written["markdown"]).read_text())
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnkit.bench import BenchConfig, run, write

    if args.decode and args.ring:
        raise ValueError("give --decode or --ring, not both")
    if args.decode:
        return _run_decode_bench(args)
    if args.ring:
        return _run_ring_bench(args)

    overrides = {
        "ns": None if args.n is None else tuple(args.n),
        "b": args.b,
        "h": args.h,
        "d": args.d,
        "dtypes": None if args.dtypes is None else tuple(args.dtypes),
        "modes": None if args.modes is None else tuple(args.modes),
        "causal": {"both": (False, True), "yes": (True,), "no": (False,), None: None}[args.causal],
        "impls": None if args.impls is None else tuple(args.impls),
        "variants": None if args.variants is None else tuple(args.variants),
        "module": args.module or None,
        "module_b": args.module_b,
        "module_n": args.module_n,
        "repeats": args.repeats,
        "warmups": args.warmups,
        "timeout_s": args.timeout,
    }
    _check_counts(args, ("n", "b", "h", "d", "module_b", "module_n", "repeats"))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    config = BenchConfig.from_name("smoke", **overrides) if args.smoke else BenchConfig(**overrides)
    results, info = run(config)
    written = write(results, info, Path(args.out))
    print(Path(written["markdown"]).read_text())
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


def _run_build(args: argparse.Namespace) -> int:
    from attnkit import _build, _cpu
    from attnkit.backends import _native

    print(
        f"attnkit: C++ kernels for this CPU ({_cpu.describe()}): the {_cpu.build_level()} build, "
        f"for torch {_build.torch_build_id()['torch']}; extensions folder "
        f"{_build.extensions_folder()}"
    )
    said = {
        "prebuilt": "prebuilt in the wheel",
        "cached": "already built",
        "built": "built now",
        "missing": "not built yet",
        "failed": "could not be built",
    }
    reports = _native.build_all(force=args.force, check=args.check)
    for report in reports:
        took = f" in {report.seconds:.0f} s" if report.origin == "built" else ""
        print(
            f"  {report.kernel:<7} {report.level:<12} {said[report.origin] + took:<24} {report.path}"
        )
        if report.error is not None:
            print(f"          {report.error}")
    if any(report.origin == "failed" for report in reports):
        print("attnkit: without its kernels, attnkit runs PyTorch operations instead (slower)")
        return 1
    return 1 if any(report.origin == "missing" for report in reports) else 0


def _check_output(path: str, suffix: str) -> Path:
    """Fail before any work when ``path`` cannot be written."""
    target = Path(path)
    if target.suffix.lower() != suffix:
        raise ValueError(f"{path}: the output must be a {suffix} file")
    folder = target.parent.resolve()
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"cannot write {path}: permission denied")
    return target


def _model_encoding(args: argparse.Namespace):
    from attnkit.models import load_minilm

    text = " ".join(JOURNEY_TOKENS) if args.text is None else args.text
    return load_minilm().encode(text)


def _run_plot(args: argparse.Namespace) -> int:
    from attnkit.views import plot_head, plot_layer

    output = _check_output(args.output, ".png")
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
        encoding = _model_encoding(args)
        layer = layer_and_head(encoding, args.layer, args.head)
        if args.all_heads:
            plot_layer(encoding.attentions[layer], encoding.tokens, output, f"layer {layer}")
        else:
            weights = encoding.attentions[layer, args.head]
            plot_head(weights, encoding.tokens, output, f"layer {layer}, head {args.head}")
    print(f"wrote {output}")
    return 0


def _run_explain_model(args: argparse.Namespace) -> int:
    from attnkit.explain import explain_model
    from attnkit.views import head_view_html, write_html

    for option in ("embeddings", "dim", "query_index"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option.replace('_', '-')} does not apply to --model")
    if args.causal or args.normalize != "softmax":
        raise ValueError("--causal and --normalize do not apply to --model")
    output = None if args.html is None else _check_output(args.html, ".html")
    encoding = _model_encoding(args)
    print(explain_model(encoding, layer=args.layer, head=args.head, query=args.query), end="")
    if output is not None:
        title = f"all-MiniLM-L6-v2: {encoding.text}"
        write_html(head_view_html(encoding.tokens, encoding.attentions, title), output)
        print(f"wrote {output}")
    return 0


def _run_explain(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _run_explain_model(args)
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

    if args.query is not None:
        query_index = example.index_of(args.query)
    elif args.query_index is not None:
        query_index = args.query_index
    else:
        query_index = min(1, len(example.tokens) - 1)  # the chapter's query is the second token
    output = None if args.html is None else _check_output(args.html, ".html")
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


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"attnkit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
