"""Quantize / dequantize kernels (int8, int4) and quantized reduction for ZeRO++.

Every op has a pure-torch reference and a Triton kernel in the same module; ``backend="auto"``
(the default) runs Triton on CUDA tensors when triton is importable and the torch reference
otherwise. Triton is optional: ``import zero_kernels`` works without it.
"""

from zero_kernels._backend import HAS_TRITON, Backend, resolve_backend, triton_interpreting
from zero_kernels.pack import pack_int4, unpack_int4
from zero_kernels.qgz import dequant_reduce, dequant_reduce_requant, swizzled_quantize
from zero_kernels.quantize import dequantize, quantize
from zero_kernels.types import QuantConfig, QuantizedTensor, SwizzleLayout

__version__ = "0.1.0"

__all__ = [
    "HAS_TRITON",
    "Backend",
    "QuantConfig",
    "QuantizedTensor",
    "SwizzleLayout",
    "dequant_reduce",
    "dequant_reduce_requant",
    "dequantize",
    "pack_int4",
    "quantize",
    "resolve_backend",
    "swizzled_quantize",
    "triton_interpreting",
    "unpack_int4",
]
