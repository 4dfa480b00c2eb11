"""int4 packing: two signed 4-bit codes per byte, low nibble first.

Byte ``i`` holds code ``2i`` in bits 0-3 and code ``2i+1`` in bits 4-7, each as a 4-bit two's
complement value (-8 is ``0b1000``, -1 is ``0b1111``). An odd number of codes is padded with one
zero code in the high nibble of the last byte.
"""

from __future__ import annotations

import torch

from zero_kernels._backend import HAS_TRITON, launch, resolve_backend

_BLOCK = 1024


def _pack_int4_ref(codes: torch.Tensor) -> torch.Tensor:
    """Reference: 1-D int8 codes in [-8, 7] -> 1-D uint8, ``ceil(n/2)`` bytes."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    lo = codes[0::2]
    hi = codes[1::2]
    return ((lo & 0x0F) | (hi << 4)).view(torch.uint8)


def _unpack_int4_ref(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Reference: 1-D uint8 -> 1-D int8 codes, the first ``numel`` of ``2 * len(packed)``."""
    signed = packed.view(torch.int8)
    out = torch.empty(2 * packed.numel(), dtype=torch.int8, device=packed.device)
    out[0::2] = (signed << 4) >> 4  # arithmetic shift sign-extends the low nibble
    out[1::2] = signed >> 4
    return out[:numel]


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_int4_kernel(codes_ptr, packed_ptr, n_codes, n_bytes, BLOCK: tl.constexpr):
        i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = i < n_bytes
        lo = tl.load(codes_ptr + 2 * i, mask=ok & (2 * i < n_codes), other=0).to(tl.int32)
        hi = tl.load(codes_ptr + 2 * i + 1, mask=ok & (2 * i + 1 < n_codes), other=0).to(tl.int32)
        tl.store(packed_ptr + i, ((lo & 15) | ((hi & 15) << 4)).to(tl.uint8), mask=ok)

    @triton.jit
    def _unpack_int4_kernel(packed_ptr, codes_ptr, n_codes, n_bytes, BLOCK: tl.constexpr):
        i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = i < n_bytes
        byte = tl.load(packed_ptr + i, mask=ok, other=0).to(tl.int32)
        tl.store(codes_ptr + 2 * i, ((byte << 28) >> 28).to(tl.int8), mask=ok & (2 * i < n_codes))
        tl.store(codes_ptr + 2 * i + 1, ((byte << 24) >> 28).to(tl.int8), mask=ok & (2 * i + 1 < n_codes))

    def _pack_int4_triton(codes: torch.Tensor) -> torch.Tensor:
        n_bytes = (codes.numel() + 1) // 2
        packed = torch.empty(n_bytes, dtype=torch.uint8, device=codes.device)
        launch(
            _pack_int4_kernel,
            (triton.cdiv(n_bytes, _BLOCK),),
            codes,
            packed,
            codes.numel(),
            n_bytes,
            BLOCK=_BLOCK,
        )
        return packed

    def _unpack_int4_triton(packed: torch.Tensor, numel: int) -> torch.Tensor:
        codes = torch.empty(numel, dtype=torch.int8, device=packed.device)
        launch(
            _unpack_int4_kernel,
            (triton.cdiv(packed.numel(), _BLOCK),),
            packed,
            codes,
            numel,
            packed.numel(),
            BLOCK=_BLOCK,
        )
        return codes


def pack_int4(codes: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Pack signed 4-bit codes two per byte, low nibble first."""
    if codes.dtype != torch.int8:
        raise TypeError(f"pack_int4 needs int8 codes, got {codes.dtype}")
    flat = codes.reshape(-1).contiguous()
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        if lo.item() < -8 or hi.item() > 7:
            raise ValueError(f"pack_int4 codes must lie in [-8, 7], got values in [{lo.item()}, {hi.item()}]")
    with torch.profiler.record_function("zero.kernels.pack_int4"):
        if resolve_backend(backend, flat) == "triton":
            return _pack_int4_triton(flat)
        return _pack_int4_ref(flat)


def unpack_int4(packed: torch.Tensor, numel: int | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 needs uint8 bytes, got {packed.dtype}")
    if packed.dim() != 1:
        raise ValueError(f"unpack_int4 needs a 1-D tensor, got shape {tuple(packed.shape)}")
    capacity = 2 * packed.numel()
    numel = capacity if numel is None else numel
    if not 0 <= numel <= capacity:
        raise ValueError(
            f"unpack_int4 numel must be in [0, {capacity}] for {packed.numel()} bytes, got {numel}"
        )
    packed = packed.contiguous()
    with torch.profiler.record_function("zero.kernels.unpack_int4"):
        if resolve_backend(backend, packed) == "triton":
            return _unpack_int4_triton(packed, numel)
        return _unpack_int4_ref(packed, numel)
