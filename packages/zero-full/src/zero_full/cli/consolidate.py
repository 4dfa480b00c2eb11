"""``zero consolidate``: a sharded checkpoint -> one safetensors file or a Hugging Face directory, offline.

The command parses arguments and prints the result; the work is done by
:func:`zero_full.checkpoint.safetensors.consolidate_checkpoint` and
:func:`zero_full.hf.save.consolidate_checkpoint_hf`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_comm.units import format_bytes
from zero_full.checkpoint.io import CheckpointError
from zero_full.checkpoint.safetensors import consolidate_checkpoint
from zero_full.hf.save import consolidate_checkpoint_hf

__all__ = ["add_consolidate_parser"]


def add_consolidate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``zero consolidate CKPT_DIR OUT.safetensors [--tag T]`` on the ``zero`` parser."""
    p = sub.add_parser(
        "consolidate",
        help="sharded checkpoint -> one safetensors file (offline, parameter by parameter)",
        description="Read a checkpoint written by engine.save_checkpoint (manifest + shard files, "
        "any world size or stage) and write the full fp32 weights and buffers, keyed like "
        "model.state_dict(), to one safetensors file. No process group is needed; peak memory is "
        "one parameter.",
    )
    p.add_argument(
        "checkpoint", type=Path, metavar="CKPT_DIR", help="the directory passed to save_checkpoint"
    )
    p.add_argument("out", type=Path, metavar="OUT", help="the .safetensors file to write")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one CKPT_DIR/latest names)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shard files")
    p.add_argument(
        "--hf",
        action="store_true",
        help="write OUT as a Hugging Face model directory (sharded model-0000x-of-0000y.safetensors + "
        "index, tied weights once) instead of one file",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="with --hf: the model's config.json (or a directory holding it) to copy into OUT",
    )
    p.add_argument("--max-shard-size", default="5GB", help="with --hf: bytes per weight file (default 5GB)")
    p.set_defaults(handler=_cmd_consolidate)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    if args.hf:
        return _cmd_consolidate_hf(args)
    try:
        res = consolidate_checkpoint(args.checkpoint, args.out, args.tag, verify=not args.no_verify)
    except (CheckpointError, OSError) as exc:
        print(f"zero consolidate: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {res.path}: {res.tensors} tensors, {format_bytes(res.nbytes)} from checkpoint tag "
        f"{res.tag!r} (largest tensor {format_bytes(res.max_tensor_bytes)})"
    )
    return 0


def _cmd_consolidate_hf(args: argparse.Namespace) -> int:
    try:
        res = consolidate_checkpoint_hf(
            args.checkpoint,
            args.out,
            args.tag,
            config=args.config,
            max_shard_size=args.max_shard_size,
            verify=not args.no_verify,
        )
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"zero consolidate: {exc}", file=sys.stderr)
        return 1
    note = "" if args.config is not None else " (no --config: add the model's config.json to load it)"
    largest = format_bytes(res.max_tensor_bytes, binary=True)
    print(
        f"wrote {res.directory}: {res.tensors} tensors in {len(res.files)} file(s), "
        f"{format_bytes(res.nbytes, binary=True)} (largest tensor {largest}){note}"
    )
    return 0
