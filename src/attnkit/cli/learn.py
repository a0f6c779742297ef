"""``attnkit learn``: train the book's small GPT on this CPU and watch its heads specialise."""

from __future__ import annotations

import argparse

from attnkit.cli.common import check_counts


def add(commands) -> None:
    le = commands.add_parser(
        "learn",
        help="train a small GPT on this CPU and watch its heads specialise",
        description=(
            "Train the book's GPT (attnkit's MultiHeadAttention in every block) on English "
            "characters or on the copy task, taking snapshots of every head's attention on "
            "held-out probes. Ends with the heads that took a role, and when."
        ),
    )
    le.add_argument(
        "--task",
        choices=["text", "copy"],
        default="text",
        help="text: English characters (default); copy: a repeated random segment, where "
        "induction heads form",
    )
    le.add_argument("--text", metavar="FILE", help="text: a UTF-8 file instead of Python's help")
    le.add_argument("--steps", type=int, help="training steps (text 2000, copy 4000)")
    le.add_argument("--layers", type=int, help="transformer blocks (default 2)")
    le.add_argument("--heads", type=int, help="heads per block (default 4)")
    le.add_argument("--dim", type=int, help="embedding width (default 64)")
    le.add_argument(
        "--context",
        type=int,
        help="tokens per sequence (text 64, copy 32; at least 2 for text, 8 for copy, and at "
        "most what keeps a snapshot's weights under 1 GiB: 1008 with 2 layers of 4 heads)",
    )
    le.add_argument("--seed", type=int, default=123, help="seed of weights, batches and probes")
    model = le.add_mutually_exclusive_group()
    model.add_argument(
        "--attention-only",
        dest="attention_only",
        action="store_true",
        default=None,
        help="blocks without feed-forward networks (the copy task's default)",
    )
    model.add_argument(
        "--feed-forward",
        dest="attention_only",
        action="store_false",
        help="full blocks with feed-forward networks (the text task's default)",
    )
    le.add_argument("--out", metavar="DIR", help="a new or empty folder for the files")
    le.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads of the training (default 1: a model this small gains little from a "
        "second thread, and on a busy machine threads that wait for each other make a run "
        "several times slower)",
    )
    le.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnkit.learn import learn

    check_counts(args, ("steps", "layers", "heads", "dim", "threads"))
    if args.text is not None and args.task != "text":
        raise ValueError("--text is for --task text")
    result = learn(
        args.task,
        text=args.text,
        steps=args.steps,
        layers=args.layers,
        heads=args.heads,
        dim=args.dim,
        context=args.context,
        seed=args.seed,
        attention_only=args.attention_only,
        out=args.out,
        threads=args.threads,
    )
    for note in result.notes:
        print(note)
    if result.files:
        print("wrote " + ", ".join(str(p) for p in result.files))
    for line in result.summary():
        print(line)
    return 0
