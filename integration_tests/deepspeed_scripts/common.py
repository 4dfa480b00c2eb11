"""What the DeepSpeed-style scripts share: the import switch, the result file, synthetic data.

Each script picks its ``deepspeed`` module with ``DS_IMPL`` (``deepspeed``: the real
DeepSpeed; ``zero``: ``zero_full.deepspeed``); nothing else differs between the two runs.
Each rank writes ``OUT/<impl>-rank<r>.json``.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from zero_testing.peers import deepspeed_for_training


def deepspeed_module() -> Any:
    """``import deepspeed`` or ``import zero_full.deepspeed as deepspeed``, by ``DS_IMPL``.

    DeepSpeed comes without its shared-memory all-reduce, an inference-only op that is not
    part of the training these scripts compare (``zero_testing.peers``).
    """
    if os.environ.get("DS_IMPL", "zero") == "deepspeed":
        return deepspeed_for_training()
    return importlib.import_module("zero_full.deepspeed")


def write_result(out: str | os.PathLike[str], rank: int, result: dict[str, Any]) -> None:
    """The rank's result as JSON (losses, learning rates, ...)."""
    impl = os.environ.get("DS_IMPL", "zero")
    path = Path(out) / f"{impl}-rank{rank}.json"
    path.write_text(json.dumps(result, default=_plain))


def _plain(value: Any) -> Any:
    """Tensors (DeepSpeed returns some numbers as 0-d tensors) as numbers / lists."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} in a script result")


def images(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` random 3x32x32 images with labels 0..9 (CIFAR-10's shapes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def tokens(n: int, seq: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``n`` masked-LM examples ``(token ids, labels)``: 15% of the positions masked, pad label 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        mask = torch.rand(seq, generator=g) < 0.15
        mask[1] = True
        labels = torch.where(mask, ids, torch.ones_like(ids))
        ids = torch.where(mask, torch.full_like(ids, 2), ids)
        out.append((ids.tolist(), labels.tolist()))
    return out
