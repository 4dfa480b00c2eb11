"""Shared cases and checks of the zero-kernels tests.

``simulate_qgz`` runs qgZ's hierarchical reduce-scatter in one process (no torch.distributed):
the all-to-alls are slicing and concatenation, exactly as ``all_to_all_single`` with equal splits
lays the received chunks out.
"""

from __future__ import annotations

import pytest
import torch

from zero_kernels import (
    QuantConfig,
    QuantizedTensor,
    dequant_reduce,
    dequant_reduce_requant,
    dequantize,
    swizzled_quantize,
)

# Sizes: empty, one, small odd, primes, one below / above the default group, odd multi-group.
ODD_SIZES = [0, 1, 7, 131, 2047, 2049, 4099, 10007]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
over_sizes = pytest.mark.parametrize("numel", ODD_SIZES)
over_dtypes = pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
over_bits = pytest.mark.parametrize("bits", [8, 4])


def sample(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Gaussian data whose magnitude varies along the tensor (groups get different absmax).

    Every 97th value is exactly zero and the scale spans 1e-3 .. 1e3, inside fp16's range.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    x *= torch.logspace(-3, 3, max(numel, 1), dtype=torch.float64)[:numel].flip(0)
    x[::97] = 0.0
    return x.to(dtype)


def group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per element, in float64: the absmax of the (zero-padded) group it belongs to."""
    x64 = x.reshape(-1).to(torch.float64)
    n_groups = -(-x64.numel() // group_size)
    padded = torch.zeros(n_groups * group_size, dtype=torch.float64)
    padded[: x64.numel()] = x64
    amax = padded.view(n_groups, group_size).abs().amax(dim=1)
    return amax.repeat_interleave(group_size)[: x64.numel()]


def codes_of(q: QuantizedTensor) -> torch.Tensor:
    """Integer codes of every padded element (int4 unpacked), as int64."""
    if q.bits == 8:
        return q.codes.to(torch.int64)
    b = q.codes.view(torch.int8).to(torch.int64)
    lo = ((b & 0xF) ^ 8) - 8
    hi = (((b >> 4) & 0xF) ^ 8) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)


def assert_reference_bound(x: torch.Tensor, q: QuantizedTensor) -> None:
    """The REFERENCES bound, per group of absmax A: |x - deq(q(x))| <= A / 2**b, and <= A / 2**(b-1)
    for a value on the top code (where clamping happens). Checked on the fp32 dequantization."""
    b, gs = q.bits, q.group_size
    x64 = x.reshape(-1).to(torch.float64)
    deq = dequantize(q, torch.float32, backend="torch").to(torch.float64)
    err = (x64 - deq).abs()
    amax = group_absmax(x, gs)
    top = codes_of(q)[: q.numel] == (1 << (b - 1)) - 1
    slack = amax * 2.0**-22  # fp32 rounding of x / scale and of code * scale
    bound = torch.where(top, amax / 2 ** (b - 1), amax / 2**b) + slack
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0.0, f"round-trip error exceeds the bound by {worst:.3e} (bits={b}, group={gs})"
    assert (err <= amax / 2 ** (b - 1) + slack).all()


def relative_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    return ((a - e).norm() / e.norm()).item()


def split(q: QuantizedTensor, pieces: int) -> list[QuantizedTensor]:
    """``q`` cut into ``pieces`` equal, contiguous pieces of codes and scales (what an all-to-all sends)."""
    cb, sb, n = q.codes.numel() // pieces, q.n_groups // pieces, q.numel // pieces
    return [
        QuantizedTensor(
            q.codes[i * cb : (i + 1) * cb], q.scales[i * sb : (i + 1) * sb], n, q.bits, q.group_size
        )
        for i in range(pieces)
    ]


def stack(received: list[QuantizedTensor]) -> QuantizedTensor:
    """Received pieces in source order, concatenated (the receive buffer of an all-to-all)."""
    first = received[0]
    return QuantizedTensor(
        torch.cat([r.codes for r in received]),
        torch.cat([r.scales for r in received]),
        sum(r.numel for r in received),
        first.bits,
        first.group_size,
    )


def simulate_qgz(
    grads: list[torch.Tensor], config: QuantConfig, num_nodes: int, rpn: int, backend: str = "torch"
) -> tuple[list[torch.Tensor], dict[int, QuantizedTensor]]:
    """qgZ on ``W = num_nodes * rpn`` in-process ranks (rank ``node * rpn + local``).

    Returns each rank's reduced partition (the sum over ranks, not averaged) and the intermediate
    (node-partial, requantized) tensors by rank.
    """
    world = num_nodes * rpn
    partition = grads[0].numel() // world
    sent = [split(swizzled_quantize(g, config, num_nodes, rpn, backend=backend), rpn) for g in grads]
    # hop 1, intra-node all-to-all: local rank j of node m receives chunk j from every local rank i
    middle = {}
    for m in range(num_nodes):
        for j in range(rpn):
            received = stack([sent[m * rpn + i][j] for i in range(rpn)])
            middle[m * rpn + j] = dequant_reduce_requant(received, rpn, config, backend=backend)
    # hop 2, inter-node all-to-all among the ranks of local index j: rank n*rpn + j gets sub-chunk n
    reduced = []
    for p in range(world):
        n, j = divmod(p, rpn)
        received = stack([split(middle[m * rpn + j], num_nodes)[n] for m in range(num_nodes)])
        reduced.append(dequant_reduce(received, num_nodes, backend=backend)[:partition])
    return reduced, middle
