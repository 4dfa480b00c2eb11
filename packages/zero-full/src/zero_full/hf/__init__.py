"""Hugging Face checkpoints: load straight into shards, save in the Hugging Face layout."""

from typing import Any


def __getattr__(name: str) -> Any:
    """``zero_full.hf.ZeroTrainer``, imported on first use (``import zero_full`` needs no transformers)."""
    if name == "ZeroTrainer":
        from zero_full.hf.trainer import ZeroTrainer

        return ZeroTrainer
    raise AttributeError(f"module 'zero_full.hf' has no attribute {name!r}")
