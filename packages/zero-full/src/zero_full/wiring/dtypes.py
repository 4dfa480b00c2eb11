"""The one table from a config's precision names to torch dtypes."""

from __future__ import annotations

import torch

from zero_full.config.zero_config import Precision, ZeroConfig

__all__ = ["precision_dtype", "working_dtype"]

_DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def precision_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype of a precision (``fp32``, ``bf16``, ``fp16``)."""
    return _DTYPES[precision]


def working_dtype(config: ZeroConfig) -> torch.dtype:
    """The dtype the model computes in: fp32, or bf16 / fp16 when that section is enabled."""
    return precision_dtype(config.precision)
