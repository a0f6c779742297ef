"""``attnkit build``: the C++ kernels for this CPU, built ahead of use, and what is built where."""

from __future__ import annotations

import argparse


def add(commands) -> None:
    bu = commands.add_parser(
        "build",
        help="build the C++ kernels for this CPU now (else the first call that needs one does)",
        description=(
            "Build attnkit's C++ kernels (tiled.cpp, decode.cpp, linear.cpp) for this CPU's level into the "
            "extensions folder (TORCH_EXTENSIONS_DIR, else torch's default), unless a wheel "
            "carries them prebuilt, and report what is built, for which CPU features, and where."
        ),
    )
    what = bu.add_mutually_exclusive_group()
    what.add_argument("--force", action="store_true", help="rebuild even where a build exists")
    what.add_argument("--check", action="store_true", help="build nothing: report what is there")
    bu.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.kernels import build, cpu, loader

    print(
        f"attnkit: C++ kernels for this CPU ({cpu.describe()}): the {cpu.build_level()} build, "
        f"for torch {build.torch_build_id()['torch']}; extensions folder "
        f"{build.extensions_folder()}"
    )
    said = {
        "prebuilt": "prebuilt in the wheel",
        "cached": "already built",
        "built": "built now",
        "missing": "not built yet",
        "failed": "could not be built",
    }
    reports = loader.build_all(force=args.force, check=args.check)
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
