"""Blockwise symmetric quantization to int8 / int4 and back: torch reference and Triton kernel.

Scheme (one fp32 scale per group of ``group_size`` consecutive elements, absmax ``A``)::

    scale = A / 2**(bits-1)                       # exact: a power-of-two division
    code  = clamp(round_half_even(x / scale), -2**(bits-1), 2**(bits-1) - 1)
    x'    = code * scale                          # in fp32, then cast to the output dtype
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from zero_kernels._backend import HAS_TRITON, check_float_dtype, launch, next_power_of_2, resolve_backend
from zero_kernels.pack import _pack_int4_ref, _unpack_int4_ref
from zero_kernels.types import QuantConfig, QuantizedTensor

# ----------------------------------------------------------------------------- torch reference

_BLOCK_ELEMS = 1 << 18
"""Elements per reference block (1 MiB of fp32): blocks of whole groups keep temporaries in cache."""


def _row_blocks(n_rows: int, group_size: int) -> Iterator[tuple[int, int]]:
    """``(first, stop)`` group ranges of about ``_BLOCK_ELEMS`` elements covering ``n_rows`` groups."""
    step = max(1, _BLOCK_ELEMS // group_size)
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def _rows_of(flat: torch.Tensor, r0: int, r1: int, group_size: int) -> torch.Tensor:
    """Groups ``[r0, r1)`` of ``flat`` as ``(r1 - r0, group_size)``, zero-padded past its end."""
    e0, e1 = r0 * group_size, min(r1 * group_size, flat.numel())
    block = flat[e0:e1]
    if e1 - e0 < (r1 - r0) * group_size:
        padded = block.new_zeros((r1 - r0) * group_size)
        padded[: e1 - e0] = block
        block = padded
    return block.view(r1 - r0, group_size)


def _quantize_rows_ref(
    rows_fn: Callable[[int, int], torch.Tensor],
    n_rows: int,
    bits: int,
    group_size: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Quantize ``n_rows`` groups, fetched blockwise as ``rows_fn(r0, r1)``, into ``codes`` / ``scales``."""
    qmax = (1 << (bits - 1)) - 1
    row_bytes = group_size * bits // 8
    for r0, r1 in _row_blocks(n_rows, group_size):
        xg = rows_fn(r0, r1)
        # absmax without an |x| temporary; "+ 0.0" turns a -0.0 absmax of an all-zero group into +0.0
        absmax = torch.maximum(xg.amax(dim=1), xg.amin(dim=1).neg_()).to(torch.float32)
        scale = absmax.mul_(1.0 / (qmax + 1)).add_(0.0)
        scales[r0:r1] = scale
        y = torch.div(xg, torch.where(scale == 0, 1.0, scale).unsqueeze(1))  # fp32 for every input dtype
        y.clamp_(-qmax - 1, qmax).round_()  # clamp first: the same codes, the bounds being integers
        dst = codes[r0 * row_bytes : r1 * row_bytes]
        if bits == 4:
            dst.copy_(_pack_int4_ref(y.view(-1).to(torch.int8)))
        else:
            dst.copy_(y.view(-1))


def _dequantize_rows_ref(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, r0: int, r1: int
) -> torch.Tensor:
    """Groups ``[r0, r1)`` decoded to fp32 ``(r1 - r0, group_size)``: ``code * scale``."""
    row_bytes = group_size * bits // 8
    block = codes[r0 * row_bytes : r1 * row_bytes]
    if bits == 4:
        block = _unpack_int4_ref(block, 2 * block.numel())
    return block.view(r1 - r0, group_size).to(torch.float32).mul_(scales[r0:r1].unsqueeze(1))


def _empty_codes(n_rows: int, config: QuantConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised codes and scales for ``n_rows`` groups."""
    dtype = torch.int8 if config.bits == 8 else torch.uint8
    codes = torch.empty(n_rows * config.group_size * config.bits // 8, dtype=dtype, device=device)
    return codes, torch.empty(n_rows, dtype=torch.float32, device=device)


def _quantize_ref(x: torch.Tensor, config: QuantConfig) -> QuantizedTensor:
    """Reference twin of :func:`quantize`."""
    flat = x.reshape(-1)
    n_rows = config.n_groups(flat.numel())
    codes, scales = _empty_codes(n_rows, config, x.device)
    gs = config.group_size
    _quantize_rows_ref(lambda r0, r1: _rows_of(flat, r0, r1, gs), n_rows, config.bits, gs, codes, scales)
    return QuantizedTensor(codes, scales, flat.numel(), config.bits, gs)


def _dequantize_ref(q: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """Reference twin of :func:`dequantize`: writes into the flat contiguous ``out``."""
    gs = q.group_size
    for r0, r1 in _row_blocks(q.n_groups, gs):
        values = _dequantize_rows_ref(q.codes, q.scales, q.bits, gs, r0, r1).view(-1)
        e0, e1 = r0 * gs, min(r1 * gs, q.numel)
        out[e0:e1].copy_(values[: e1 - e0])
    return out


# ----------------------------------------------------------------------------- Triton
#
# One program handles ROWS groups as a (ROWS, LANES) tile per lane: lane 0 holds the even elements
# of each group, lane 1 the odd ones (the two codes an int4 byte packs). LANES is the next power of
# two >= ceil(GROUP / 2); masks cut the tile to the real group and the real number of groups.

_TILE_PAIRS = 2048
"""Element pairs per Triton program (4096 elements): ROWS = max(1, _TILE_PAIRS // LANES)."""


def _tile(group_size: int) -> tuple[int, int, int]:
    """``(LANES, ROWS, num_warps)`` for a group size."""
    lanes = next_power_of_2((group_size + 1) // 2)
    rows = max(1, _TILE_PAIRS // lanes)
    return lanes, rows, 4 if rows * lanes <= _TILE_PAIRS else 8


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile_index(n_rows, GROUP: tl.constexpr, LANES: tl.constexpr, ROWS: tl.constexpr):
        """Group indices of this program, lane indices, and the masks of the even / odd elements."""
        row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        lane = tl.arange(0, LANES).to(tl.int64)
        row_ok = row < n_rows
        ok0 = row_ok[:, None] & (2 * lane < GROUP)[None, :]
        ok1 = row_ok[:, None] & (2 * lane + 1 < GROUP)[None, :]
        return row, lane, row_ok, ok0, ok1

    @triton.jit
    def _round_half_even(y):
        """Round to nearest, ties to even (as torch.round), exact for |y| <= 2**22.

        ``libdevice.rint`` would do, but the interpreter has no libdevice.
        """
        f = tl.floor(y)
        d = y - f
        odd = tl.floor(f * 0.5) != f * 0.5
        return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)

    @triton.jit
    def _quantize_store(
        x0, x1, row, lane, row_ok, ok0, ok1, codes_ptr, scales_ptr, GROUP: tl.constexpr, BITS: tl.constexpr
    ):
        """Quantize the groups held as even / odd lanes ``x0`` / ``x1`` (fp32); store codes and scales."""
        absmax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
        scale = absmax * (1.0 / (1 << (BITS - 1)))  # exact: a power of two
        tl.store(scales_ptr + row, scale, mask=row_ok)
        safe = tl.where(scale == 0.0, 1.0, scale)[:, None]
        lo = -1.0 * (1 << (BITS - 1))
        hi = 1.0 * ((1 << (BITS - 1)) - 1)
        # clamp, then round: the same codes as the other order, the bounds being integers
        q0 = _round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(x0, safe), lo), hi)).to(tl.int32)
        q1 = _round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(x1, safe), lo), hi)).to(tl.int32)
        if BITS == 4:
            packed = ((q0 & 15) | ((q1 & 15) << 4)).to(tl.uint8)  # even element in the low nibble
            tl.store(codes_ptr + row[:, None] * (GROUP // 2) + lane[None, :], packed, mask=ok0)
        else:
            base = row[:, None] * GROUP + 2 * lane[None, :]
            tl.store(codes_ptr + base, q0.to(tl.int8), mask=ok0)
            tl.store(codes_ptr + base + 1, q1.to(tl.int8), mask=ok1)

    @triton.jit
    def _load_dequant_sum(
        codes_ptr,
        scales_ptr,
        n_rows,
        n_sources,
        GROUP: tl.constexpr,
        LANES: tl.constexpr,
        ROWS: tl.constexpr,
        BITS: tl.constexpr,
    ):
        """This program's tile (:func:`_tile_index`) and, as even / odd lanes ``x0`` / ``x1``, the fp32
        sum over ``n_sources`` chunks of ``n_rows`` groups of ``code * scale``, source 0 first."""
        row, lane, row_ok, ok0, ok1 = _tile_index(n_rows, GROUP, LANES, ROWS)
        x0 = tl.zeros((ROWS, LANES), dtype=tl.float32)
        x1 = tl.zeros((ROWS, LANES), dtype=tl.float32)
        for s in range(n_sources):
            src = s * n_rows + row
            sc = tl.load(scales_ptr + src, mask=row_ok, other=0.0)[:, None]
            if BITS == 4:
                byte_ptr = codes_ptr + src[:, None] * (GROUP // 2) + lane[None, :]
                byte = tl.load(byte_ptr, mask=ok0, other=0).to(tl.int32)
                c0 = (byte << 28) >> 28  # sign-extend the low nibble
                c1 = (byte << 24) >> 28  # and the high one
            else:
                base = src[:, None] * GROUP + 2 * lane[None, :]
                c0 = tl.load(codes_ptr + base, mask=ok0, other=0).to(tl.int32)
                c1 = tl.load(codes_ptr + base + 1, mask=ok1, other=0).to(tl.int32)
            x0 += c0.to(tl.float32) * sc
            x1 += c1.to(tl.float32) * sc
        return row, lane, row_ok, ok0, ok1, x0, x1

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        codes_ptr,
        scales_ptr,
        n_rows,
        part_numel,
        rows_per_part,
        num_nodes,
        ranks_per_node,
        GROUP: tl.constexpr,
        LANES: tl.constexpr,
        ROWS: tl.constexpr,
        BITS: tl.constexpr,
    ):
        """Quantize ``n_rows`` groups. Group ``row`` is group ``row % rows_per_part`` of partition
        ``(slot % num_nodes) * ranks_per_node + slot // num_nodes``, ``slot = row // rows_per_part``,
        each partition being ``part_numel`` elements of ``x`` zero-padded to whole groups (the plain
        order is one partition: ``num_nodes = ranks_per_node = 1``)."""
        row, lane, row_ok, ok0, ok1 = _tile_index(n_rows, GROUP, LANES, ROWS)
        slot = row // rows_per_part
        part = (slot % num_nodes) * ranks_per_node + slot // num_nodes
        i0 = (row % rows_per_part)[:, None] * GROUP + 2 * lane[None, :]  # index within the partition
        base = x_ptr + part[:, None] * part_numel
        x0 = tl.load(base + i0, mask=ok0 & (i0 < part_numel), other=0.0).to(tl.float32)
        x1 = tl.load(base + i0 + 1, mask=ok1 & (i0 + 1 < part_numel), other=0.0).to(tl.float32)
        _quantize_store(x0, x1, row, lane, row_ok, ok0, ok1, codes_ptr, scales_ptr, GROUP, BITS)

    @triton.jit
    def _dequant_reduce_kernel(
        codes_ptr,
        scales_ptr,
        out_ptr,
        n_rows,
        n_sources,
        out_numel,
        GROUP: tl.constexpr,
        LANES: tl.constexpr,
        ROWS: tl.constexpr,
        BITS: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        """Write the first ``out_numel`` elements of the sum over ``n_sources`` chunks to ``out``."""
        row, lane, _, ok0, ok1, x0, x1 = _load_dequant_sum(
            codes_ptr, scales_ptr, n_rows, n_sources, GROUP, LANES, ROWS, BITS
        )
        if OUT_BF16:
            # round to bfloat16 by hand, half to even, as torch does: the interpreter's own
            # fp32 -> bf16 cast truncates; the rounded value then converts exactly in either mode
            u0 = x0.to(tl.uint32, bitcast=True)
            u1 = x1.to(tl.uint32, bitcast=True)
            x0 = (((u0 + (((u0 >> 16) & 1) + 0x7FFF)) >> 16) << 16).to(tl.float32, bitcast=True)
            x1 = (((u1 + (((u1 >> 16) & 1) + 0x7FFF)) >> 16) << 16).to(tl.float32, bitcast=True)
        o0 = row[:, None] * GROUP + 2 * lane[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + o0, x0.to(ty), mask=ok0 & (o0 < out_numel))
        tl.store(out_ptr + o0 + 1, x1.to(ty), mask=ok1 & (o0 + 1 < out_numel))

    def _launch_tiles(kernel: Any, n_rows: int, group_size: int, *args: Any, **meta: Any) -> None:
        """Launch a kernel over ``n_rows`` groups of ``group_size``, ``ROWS`` groups per program.

        Passes the tile's ``GROUP``, ``LANES`` and ``ROWS`` (see :func:`_tile`) and its warps;
        ``meta`` holds the kernel's other compile-time constants.
        """
        lanes, rows, warps = _tile(group_size)
        launch(
            kernel,
            (triton.cdiv(n_rows, rows),),
            *args,
            GROUP=group_size,
            LANES=lanes,
            ROWS=rows,
            num_warps=warps,
            **meta,
        )

    def _launch_quantize(
        x: torch.Tensor,
        config: QuantConfig,
        n_rows: int,
        part_numel: int,
        rows_per_part: int,
        num_nodes: int,
        ranks_per_node: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New codes and scales of ``n_rows`` groups read from ``x`` in slot order (see the kernel)."""
        codes, scales = _empty_codes(n_rows, config, x.device)
        _launch_tiles(
            _quantize_kernel,
            n_rows,
            config.group_size,
            x,
            codes,
            scales,
            n_rows,
            part_numel,
            max(rows_per_part, 1),
            num_nodes,
            ranks_per_node,
            BITS=config.bits,
        )
        return codes, scales

    def _launch_over_sources(
        kernel: Any, q: QuantizedTensor, n_sources: int, outputs: tuple[Any, ...], *args: Any, **meta: Any
    ) -> None:
        """Launch a kernel summing the ``n_sources`` chunks of ``q`` (see :func:`_load_dequant_sum`).

        Its arguments: ``q``'s codes and scales, ``outputs``, the groups per chunk, ``n_sources``,
        then ``args``; ``meta`` as for :func:`_launch_tiles`.
        """
        n_rows = q.n_groups // n_sources
        _launch_tiles(
            kernel, n_rows, q.group_size, q.codes, q.scales, *outputs, n_rows, n_sources, *args, **meta
        )

    def _launch_dequant_reduce(q: QuantizedTensor, n_sources: int, out: torch.Tensor) -> None:
        """Sum of the ``n_sources`` chunks of ``q``, dequantized, into the flat contiguous ``out``."""
        _launch_over_sources(
            _dequant_reduce_kernel,
            q,
            n_sources,
            (out,),
            out.numel(),
            BITS=q.bits,
            OUT_BF16=out.dtype == torch.bfloat16,
        )

    def _quantize_triton(x: torch.Tensor, config: QuantConfig) -> QuantizedTensor:
        """Triton twin of :func:`quantize` (``x`` flat and contiguous)."""
        n_rows = config.n_groups(x.numel())
        codes, scales = _launch_quantize(x, config, n_rows, x.numel(), n_rows, 1, 1)
        return QuantizedTensor(codes, scales, x.numel(), config.bits, config.group_size)

    def _dequantize_triton(q: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
        """Triton twin of :func:`dequantize`: writes into the flat contiguous ``out``."""
        _launch_dequant_reduce(q, 1, out)
        return out


# ----------------------------------------------------------------------------- public API


def _check_input(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype(x.dtype, f"{what}.dtype")


def _check_config(config: QuantConfig) -> None:
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a zero_kernels.QuantConfig, got {type(config).__name__}")


def quantize(x: torch.Tensor, config: QuantConfig, *, backend: str = "auto") -> QuantizedTensor:
    """Quantize ``x`` blockwise to ``config.bits`` bits, one fp32 scale per ``config.group_size`` elements."""
    _check_input(x, "x")
    _check_config(config)
    with torch.profiler.record_function("zero.kernels.quantize"):
        if resolve_backend(backend, x) == "triton":
            return _quantize_triton(x.reshape(-1).contiguous(), config)
        return _quantize_ref(x, config)


def _output_for(
    numel: int, device: torch.device, out_dtype: torch.dtype | None, out: torch.Tensor | None, what: str
) -> torch.Tensor:
    """Validate ``out`` / ``out_dtype``; return the flat contiguous tensor to write ``numel`` values into."""
    if out is None:
        dtype = torch.float32 if out_dtype is None else out_dtype
        check_float_dtype(dtype, f"{what} out_dtype")
        return torch.empty(numel, dtype=dtype, device=device)
    check_float_dtype(out.dtype, f"{what} out.dtype")
    if out_dtype is not None and out_dtype != out.dtype:
        raise ValueError(
            f"{what}: out_dtype={out_dtype} disagrees with out.dtype={out.dtype}; pass only one of them"
        )
    if out.numel() != numel or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"{what}: out must be a contiguous tensor of {numel} elements on {device}, got shape "
            f"{tuple(out.shape)} (contiguous={out.is_contiguous()}) on {out.device}"
        )
    return out.view(-1)


def dequantize(
    q: QuantizedTensor,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode a :class:`QuantizedTensor`: ``code * scale`` in fp32, cast to the output dtype."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a zero_kernels.QuantizedTensor, got {type(q).__name__}")
    flat = _output_for(q.numel, q.codes.device, out_dtype, out, "dequantize")
    with torch.profiler.record_function("zero.kernels.dequantize"):
        if resolve_backend(backend, q.codes) == "triton":
            _dequantize_triton(q, flat)
        else:
            _dequantize_ref(q, flat)
    return flat if out is None else out
