"""``attnkit bench``: attnkit's backends and modules side by side with their peers, decoding over
a KV cache, ring attention over processes, and whole Hugging Face models."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli.common import check_counts, check_folder


def add(commands) -> None:
    from attnkit.bench.peers import KERNEL_IMPLS, VARIANTS

    be = commands.add_parser(
        "bench",
        help="time attnkit against torch SDPA, nn.MultiheadAttention, FlexAttention and naive",
        description=(
            "Measure attnkit's backends and modules side by side with their peers in one run: "
            "median times interleaved in one process, ratios to torch SDPA, GFLOP/s, the share of "
            "this machine's matmul throughput, and peak memory per case (each in a subprocess). "
            "With --decode: one decoding step over a KV cache against the memory bus's limit, "
            "cache sizes, and generation cached vs recomputed. With --hf: whole Hugging Face models "
            "(random weights) on attnkit beside transformers' sdpa and eager attention."
        ),
    )
    be.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, every path: a check that each case runs (a minute or two on 2 cores)",
    )
    be.add_argument(
        "--decode", action="store_true", help="decoding over a KV cache (--n: cache lengths)"
    )
    be.add_argument(
        "--ring",
        action="store_true",
        help="ring attention over processes joined by gloo (--n: lengths, --ranks: world sizes)",
    )
    be.add_argument(
        "--hf",
        action="store_true",
        help="Hugging Face models on attnkit, sdpa and eager: training steps, a padded batch, "
        "generation (needs transformers)",
    )
    be.add_argument(
        "--torch-nn",
        action="store_true",
        help="torch's nn.TransformerEncoder before and after attnkit.nn.swap: a training step",
    )
    be.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the kernel and --decode cases run; cuda: the goals' shapes (b=4, h=16, "
        "d=128, bf16, N=4096 and 16384) unless given, and a decoding step over a 32k cache",
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
    be.add_argument(
        "--out",
        default="bench-results",
        help="folder for results.{json,md,png}: made if need be, in a folder that exists",
    )
    be.set_defaults(run=run)


def _run_gpu_decode_bench(args: argparse.Namespace) -> int:
    from attnkit.bench.gpu_decode import GPUDecodeConfig, run_gpu_decode, write_gpu_decode

    check_counts(args, ("n", "b", "h", "d", "kv_heads", "repeats"))
    if len(args.n or ()) > 1 or len(args.kv_heads or ()) > 1:
        raise ValueError("--device cuda --decode takes one --n and one --kv-heads")
    overrides = {
        "length": args.n and args.n[0],
        "kv_heads": args.kv_heads and args.kv_heads[0],
        "b": args.b,
        "h": args.h,
        "d": args.d,
        "repeats": args.repeats,
        "warmups": args.warmups,
    }
    config = GPUDecodeConfig(**{k: v for k, v in overrides.items() if v is not None})
    if config.h % config.kv_heads:
        raise ValueError(f"--h ({config.h}) must be a multiple of --kv-heads ({config.kv_heads})")
    _show(write_gpu_decode(run_gpu_decode(config), Path(args.out)))
    return 0


def _run_torch_nn_bench(args: argparse.Namespace) -> int:
    from attnkit.bench.torch_nn import TorchNNConfig, run_torch_nn, write_torch_nn

    check_counts(args, ("repeats",))
    given = {"repeats": args.repeats, "warmups": args.warmups, "dtypes": args.dtypes}
    overrides = {k: tuple(v) if k == "dtypes" else v for k, v in given.items() if v is not None}
    if args.smoke:
        smoke = {"repeats": 1, "warmups": 0, "shrink": 16, "dtypes": ("fp32",), "dropouts": (0.1,)}
        smoke |= {"one_process": True}  # the pipeline, not the figures: one probe process
        overrides = {**smoke, **overrides}
    config = TorchNNConfig(**overrides)
    _show(write_torch_nn(run_torch_nn(config), Path(args.out)))
    return 0


def _run_decode_bench(args: argparse.Namespace) -> int:
    if args.device != "cpu":
        return _run_gpu_decode_bench(args)

    from attnkit.bench.decode import DecodeConfig, run_decode, write_decode

    check_counts(args, ("n", "b", "h", "d", "kv_heads", "prompts", "new_tokens", "repeats"))
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
    _show(written)
    return 0


def _run_ring_bench(args: argparse.Namespace) -> int:

    from attnkit.bench.ring import RingConfig, run_ring, write_ring

    check_counts(args, ("n", "b", "h", "d", "ranks", "repeats"))
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
    _show(written)
    return 0


def _run_hf_bench(args: argparse.Namespace) -> int:

    from attnkit.bench.hf import HFBenchConfig, run_hf, write_hf

    check_counts(args, ("repeats",))
    overrides = {"repeats": args.repeats, "warmups": args.warmups, "timeout_s": args.timeout}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    config = HFBenchConfig.smoke(**overrides) if args.smoke else HFBenchConfig(**overrides)
    written = write_hf(run_hf(config), Path(args.out))
    _show(written)
    return 0


def _out(args: argparse.Namespace) -> Path:
    """The results' folder: it may be new, but its parent must exist and take files, as
    ``plot``'s output's folder must (checked before any work)."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: {out.resolve()} is a file, not a folder")
    check_folder(out if out.exists() else out.parent, args.out)
    return out


def _show(written: dict[str, Path]) -> None:
    """The report's table, then where the results went."""
    print(Path(written["markdown"]).read_text())
    print("wrote " + ", ".join(str(p) for p in written.values()))


def run(args: argparse.Namespace) -> int:

    from attnkit.bench import BenchConfig, write
    from attnkit.bench import run as run_cases

    if args.decode + args.ring + args.hf + args.torch_nn > 1:
        raise ValueError("give one of --decode, --ring, --hf and --torch-nn")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    _out(args)
    if args.device != "cpu":
        import torch

        if args.ring or args.hf or args.torch_nn:
            raise ValueError(
                "--device cuda runs the kernel cases and --decode; not --ring, --hf or --torch-nn"
            )
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
    if args.decode:
        return _run_decode_bench(args)
    if args.ring:
        return _run_ring_bench(args)
    if args.hf:
        return _run_hf_bench(args)
    if args.torch_nn:
        return _run_torch_nn_bench(args)

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
    check_counts(args, ("n", "b", "h", "d", "module_b", "module_n", "repeats"))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.device != "cpu":
        preset = "gpu"
        if args.smoke:  # the smoke preset's tiny shapes, on the GPU
            overrides = {**BenchConfig.PRESETS["smoke"], "device": args.device, **overrides}
            preset = "smoke"
        config = BenchConfig.from_name(preset, **overrides)
    else:
        smoke = args.smoke
        config = BenchConfig.from_name("smoke", **overrides) if smoke else BenchConfig(**overrides)
    results, info = run_cases(config)
    written = write(results, info, Path(args.out))
    _show(written)
    return 0
