"""Quantize / dequantize kernels (int8, int4) and quantized reduction: Triton kernels with pure-torch reference twins."""
