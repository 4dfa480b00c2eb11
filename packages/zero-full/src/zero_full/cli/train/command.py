"""The ``zero train`` command: its flags and its entry point (``zero train``, ``python -m zero_full``)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from zero_full.cli.train.options import TrainOptions
from zero_full.cli.train.run import TrainError, run_training
from zero_full.cli.train.summary import format_summary

__all__ = ["add_train_parser"]


def add_train_parser(sub: Any) -> None:
    """Add ``train`` to the ``zero`` subcommands (``sub`` from ``add_subparsers``)."""
    p = sub.add_parser(
        "train",
        help="the demo: train a GPT-2-style model with ZeRO on local gloo processes",
        description="Train a small GPT-2 (transformers, random init) with ZeRO on local gloo processes "
        "and print memory per rank vs DDP, bytes communicated per step and parameter traffic. "
        "Needs pip install zero-full[demo].",
    )
    d = TrainOptions()  # the defaults
    ints = (
        ("--world", d.world, "local ranks"),
        ("--stage", d.stage, "ZeRO stage (default: the config's, else 3)"),
        ("--steps", d.steps, "optimizer steps"),
        ("--layers", d.layers, "transformer blocks"),
        ("--hidden", d.hidden, "hidden size"),
        ("--heads", d.heads, "attention heads"),
        ("--vocab", d.vocab, "vocabulary size"),
        ("--seq", d.seq, "tokens per sequence"),
        ("--micro-batch", d.micro_batch, "sequences per rank per micro-step (default: the config's, else 4)"),
        ("--ranks-per-node", d.ranks_per_node, "simulated ranks per node (default: --world)"),
        ("--seed", d.seed, "seed of the weights and the data"),
    )
    for flag, default, text in ints:
        shown = text if default is None else f"{text} (default {default})"
        p.add_argument(flag, type=int, default=default, metavar="N", help=shown)
    p.add_argument("--config", metavar="DS.JSON", help="DeepSpeed-style JSON config (flags override it)")
    p.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        metavar="S",
        help=f"limit on every distributed wait ({d.timeout:g})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--crash-rank", type=int, default=None, help=argparse.SUPPRESS)  # failure-path check
    p.set_defaults(handler=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    values = {k: v for k, v in vars(args).items() if k in names}
    opts = TrainOptions(**values, progress=not args.no_progress)
    try:
        summary = run_training(opts)
    except TrainError as exc:
        if exc.traceback:
            print(f"traceback of rank {exc.rank}:\n{exc.traceback}", file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return 1
    except (ValueError, OSError, ImportError) as exc:  # bad flags, config file, missing transformers
        print(f"zero train: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0 if math.isfinite(summary.losses[-1]) else 1
