"""Kernels of qgZ (ZeRO++ quantized gradients): swizzled quantize and fused dequantize-reduce(-requantize)."""

from __future__ import annotations

import torch

from zero_kernels._backend import HAS_TRITON, resolve_backend
from zero_kernels.quantize import (
    _check_config,
    _check_input,
    _dequantize_rows_ref,
    _empty_codes,
    _output_for,
    _quantize_rows_ref,
    _row_blocks,
    _rows_of,
)
from zero_kernels.types import QuantConfig, QuantizedTensor, SwizzleLayout

# ----------------------------------------------------------------------------- torch reference


def _swizzled_quantize_ref(x: torch.Tensor, config: QuantConfig, layout: SwizzleLayout) -> QuantizedTensor:
    """Reference twin of :func:`swizzled_quantize`: each partition quantized into its slot."""
    flat = x.reshape(-1)
    gs, rows = config.group_size, layout.groups_per_partition
    codes, scales = _empty_codes(layout.world_size * rows, config, x.device)
    slot_bytes = rows * gs * config.bits // 8
    p_numel = layout.partition_numel
    for slot, p in enumerate(layout.partition_order()):  # world size iterations
        part = flat[p * p_numel : (p + 1) * p_numel]
        _quantize_rows_ref(
            lambda r0, r1, part=part: _rows_of(part, r0, r1, gs),
            rows,
            config.bits,
            gs,
            codes[slot * slot_bytes : (slot + 1) * slot_bytes],
            scales[slot * rows : (slot + 1) * rows],
        )
    return QuantizedTensor(codes, scales, layout.numel, config.bits, gs)


def _sum_sources_ref(q: QuantizedTensor, n_sources: int, r0: int, r1: int) -> torch.Tensor:
    """fp32 sum over the sources of their groups ``[r0, r1)``, accumulated from 0 in source order."""
    chunk_rows = q.n_groups // n_sources
    acc = torch.zeros(r1 - r0, q.group_size, dtype=torch.float32, device=q.codes.device)
    for s in range(n_sources):  # a handful of sources; each step is vectorised over the block
        base = s * chunk_rows
        acc += _dequantize_rows_ref(q.codes, q.scales, q.bits, q.group_size, base + r0, base + r1)
    return acc


def _dequant_reduce_ref(q: QuantizedTensor, n_sources: int, out: torch.Tensor) -> torch.Tensor:
    """Reference twin of :func:`dequant_reduce`: writes into the flat contiguous ``out``."""
    gs = q.group_size
    for r0, r1 in _row_blocks(q.n_groups // n_sources, gs):
        e0, e1 = r0 * gs, min(r1 * gs, out.numel())
        out[e0:e1].copy_(_sum_sources_ref(q, n_sources, r0, r1).view(-1)[: e1 - e0])
    return out


def _dequant_reduce_requant_ref(q: QuantizedTensor, n_sources: int, config: QuantConfig) -> QuantizedTensor:
    """Reference twin of :func:`dequant_reduce_requant`."""
    n_rows = q.n_groups // n_sources
    codes, scales = _empty_codes(n_rows, config, q.codes.device)
    _quantize_rows_ref(
        lambda r0, r1: _sum_sources_ref(q, n_sources, r0, r1),
        n_rows,
        config.bits,
        config.group_size,
        codes,
        scales,
    )
    return QuantizedTensor(codes, scales, q.numel // n_sources, config.bits, config.group_size)


# ----------------------------------------------------------------------------- Triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from zero_kernels.quantize import (
        _launch_dequant_reduce,
        _launch_over_sources,
        _launch_quantize,
        _load_dequant_sum,
        _quantize_store,
    )

    @triton.jit
    def _dequant_reduce_requant_kernel(
        src_codes_ptr,
        src_scales_ptr,
        codes_ptr,
        scales_ptr,
        n_rows,
        n_sources,
        GROUP: tl.constexpr,
        LANES: tl.constexpr,
        ROWS: tl.constexpr,
        BITS_IN: tl.constexpr,
        BITS_OUT: tl.constexpr,
    ):
        """Requantize, group by group, the fp32 sum over ``n_sources`` chunks of ``n_rows`` groups."""
        row, lane, row_ok, ok0, ok1, x0, x1 = _load_dequant_sum(
            src_codes_ptr, src_scales_ptr, n_rows, n_sources, GROUP, LANES, ROWS, BITS_IN
        )
        _quantize_store(x0, x1, row, lane, row_ok, ok0, ok1, codes_ptr, scales_ptr, GROUP, BITS_OUT)

    def _swizzled_quantize_triton(
        x: torch.Tensor, config: QuantConfig, layout: SwizzleLayout
    ) -> QuantizedTensor:
        """Triton twin of :func:`swizzled_quantize` (``x`` flat and contiguous)."""
        rows = layout.groups_per_partition
        codes, scales = _launch_quantize(
            x,
            config,
            layout.world_size * rows,
            layout.partition_numel,
            rows,
            layout.num_nodes,
            layout.ranks_per_node,
        )
        return QuantizedTensor(codes, scales, layout.numel, config.bits, config.group_size)

    def _dequant_reduce_triton(q: QuantizedTensor, n_sources: int, out: torch.Tensor) -> torch.Tensor:
        """Triton twin of :func:`dequant_reduce`."""
        _launch_dequant_reduce(q, n_sources, out)
        return out

    def _dequant_reduce_requant_triton(
        q: QuantizedTensor, n_sources: int, config: QuantConfig
    ) -> QuantizedTensor:
        """Triton twin of :func:`dequant_reduce_requant`."""
        codes, scales = _empty_codes(q.n_groups // n_sources, config, q.codes.device)
        _launch_over_sources(
            _dequant_reduce_requant_kernel,
            q,
            n_sources,
            (codes, scales),
            BITS_IN=q.bits,
            BITS_OUT=config.bits,
        )
        return QuantizedTensor(codes, scales, q.numel // n_sources, config.bits, config.group_size)


# ----------------------------------------------------------------------------- public API


def swizzled_quantize(
    x: torch.Tensor, config: QuantConfig, num_nodes: int, ranks_per_node: int, *, backend: str = "auto"
) -> QuantizedTensor:
    """Quantize a flat gradient in the order of qgZ's hierarchical all-to-all."""
    _check_input(x, "x")
    _check_config(config)
    for name, value in (("num_nodes", num_nodes), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"swizzled_quantize {name} must be a positive int, got {value!r}")
    layout = SwizzleLayout.for_numel(x.numel(), num_nodes, ranks_per_node, config.group_size)
    with torch.profiler.record_function("zero.kernels.swizzled_quantize"):
        if resolve_backend(backend, x) == "triton":
            return _swizzled_quantize_triton(x.reshape(-1).contiguous(), config, layout)
        return _swizzled_quantize_ref(x, config, layout)


def _check_sources(q: QuantizedTensor, n_sources: int, what: str) -> None:
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"{what}: q must be a zero_kernels.QuantizedTensor, got {type(q).__name__}")
    if isinstance(n_sources, bool) or not isinstance(n_sources, int) or n_sources < 1:
        raise ValueError(f"{what}: n_sources must be a positive int, got {n_sources!r}")
    if q.numel % n_sources:
        raise ValueError(f"{what}: q.numel={q.numel} is not divisible by n_sources={n_sources}")
    if n_sources > 1 and (q.numel // n_sources) % q.group_size:
        raise ValueError(
            f"{what}: each of the {n_sources} source chunks has {q.numel // n_sources} elements, not a "
            f"multiple of group_size={q.group_size}, so groups would straddle sources; pad chunks to whole "
            "groups (swizzled_quantize does)"
        )


def dequant_reduce_requant(
    q_chunks: QuantizedTensor, n_sources: int, config: QuantConfig, *, backend: str = "auto"
) -> QuantizedTensor:
    """Middle hop of qgZ: dequantize ``n_sources`` stacked chunks, sum them in fp32, requantize."""
    _check_sources(q_chunks, n_sources, "dequant_reduce_requant")
    _check_config(config)
    if config.group_size != q_chunks.group_size:
        raise ValueError(
            f"dequant_reduce_requant: config.group_size={config.group_size} must equal the input's "
            f"group_size={q_chunks.group_size}"
        )
    with torch.profiler.record_function("zero.kernels.dequant_reduce_requant"):
        if resolve_backend(backend, q_chunks.codes) == "triton":
            return _dequant_reduce_requant_triton(q_chunks, n_sources, config)
        return _dequant_reduce_requant_ref(q_chunks, n_sources, config)


def dequant_reduce(
    q: QuantizedTensor,
    n_sources: int,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Last hop of qgZ: dequantize ``n_sources`` stacked chunks and sum them in fp32 (no averaging)."""
    _check_sources(q, n_sources, "dequant_reduce")
    flat = _output_for(q.numel // n_sources, q.codes.device, out_dtype, out, "dequant_reduce")
    with torch.profiler.record_function("zero.kernels.dequant_reduce"):
        if resolve_backend(backend, q.codes) == "triton":
            _dequant_reduce_triton(q, n_sources, flat)
        else:
            _dequant_reduce_ref(q, n_sources, flat)
    return flat if out is None else out
