"""Backend selection shared by every op: Triton when it can run, the torch reference otherwise.

Triton is optional. It is imported once here, guarded, so ``import zero_kernels`` works without it;
the Triton half of each op module is only defined when ``HAS_TRITON`` is true.

Triton 3.x fixes interpreter-or-compiler per ``triton.jit`` function when the function is
decorated: triton's own library (``tl.max``, ``tl.cdiv``, ...) when triton is first imported, and
the kernels here when ``zero_kernels`` is imported. To run the kernels on CPU tensors, set
``TRITON_INTERPRET=1`` before either is imported (in the environment, or in ``os.environ`` at the
very top of a test module / conftest).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

try:
    import triton
except ImportError:  # the optional extra `zero-kernels[triton]` is not installed
    triton = None

HAS_TRITON: bool = triton is not None
"""True when ``import triton`` succeeds in this interpreter."""

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Floating dtypes accepted as quantization input and as dequantization output."""


def _interpret_env() -> bool:
    if triton is not None and hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


TRITON_INTERPRETED: bool = HAS_TRITON and _interpret_env()
"""True when the Triton kernels were defined for the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""


def triton_interpreting() -> bool:
    """Whether this process's Triton kernels run in the CPU interpreter (fixed when they were defined)."""
    return TRITON_INTERPRETED


def resolve_backend(backend: str, tensor: torch.Tensor) -> Literal["torch", "triton"]:
    """Pick the implementation for an op whose data lives on ``tensor.device``."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        use_triton = HAS_TRITON and tensor.device.type == "cuda" and not TRITON_INTERPRETED
        return "triton" if use_triton else "torch"
    if not HAS_TRITON:
        raise RuntimeError(
            "backend='triton' needs the optional dependency triton, which is not importable here: "
            "install it with `pip install 'zero-kernels[triton]'` or use backend='torch'"
        )
    if tensor.device.type != "cuda" and not TRITON_INTERPRETED:
        raise ValueError(
            f"backend='triton' got a tensor on {tensor.device}: Triton kernels run on CUDA tensors, or on "
            "CPU tensors only under the interpreter (set TRITON_INTERPRET=1 before triton and "
            "zero_kernels are imported)"
        )
    return "triton"


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch a ``triton.jit`` kernel on ``grid`` (nothing for an empty grid) without FMA contraction.

    FMA fusion would round ``acc + code * scale`` once instead of twice and break bit-equality
    with the torch reference, which multiplies and adds as separate ops.
    """
    if grid[0] == 0:
        return
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_float_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise ``TypeError`` naming ``what`` unless ``dtype`` is float32, bfloat16 or float16."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} must be one of float32, bfloat16, float16, got {dtype}")
