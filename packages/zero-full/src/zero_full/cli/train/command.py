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
    ints = (
        ("--world", 2, "local ranks (default 2)"),
        ("--stage", None, "ZeRO stage (default: the config's, else 3)"),
        ("--steps", 30, "optimizer steps (default 30)"),
        ("--layers", 2, "transformer blocks (default 2)"),
        ("--hidden", 128, "hidden size (default 128)"),
        ("--heads", 4, "attention heads (default 4)"),
        ("--vocab", 1024, "vocabulary size (default 1024)"),
        ("--seq", 64, "tokens per sequence (default 64)"),
        ("--micro-batch", None, "sequences per rank per micro-step (default: the config's, else 4)"),
        ("--ranks-per-node", None, "simulated ranks per node (default: --world)"),
        ("--seed", 0, "seed of the weights and the data (default 0)"),
    )
    for flag, default, text in ints:
        p.add_argument(flag, type=int, default=default, metavar="N", help=text)
    p.add_argument("--config", metavar="DS.JSON", help="DeepSpeed-style JSON config (flags override it)")
    p.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="limit on every distributed wait (300)"
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
