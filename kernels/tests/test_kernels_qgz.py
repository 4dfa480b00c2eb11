"""qgZ kernels: swizzled layout, fused dequantize-reduce(-requantize), and the two-hop algorithm
(``simulate_qgz`` in kernels_cases runs it in one process)."""

from __future__ import annotations

import pytest
import torch
from kernels_cases import group_absmax, relative_rmse, sample, simulate_qgz, split, stack

from zero_kernels import (
    QuantConfig,
    SwizzleLayout,
    dequant_reduce,
    dequant_reduce_requant,
    dequantize,
    quantize,
    swizzled_quantize,
)

# (num_nodes, ranks_per_node): world sizes 1, 2, 4, 2 nodes x 2 ranks, and lopsided topologies.
TOPOLOGIES = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (2, 3), (3, 2)]
over_topologies = pytest.mark.parametrize(
    ("num_nodes", "rpn"), TOPOLOGIES, ids=[f"{n}x{r}" for n, r in TOPOLOGIES]
)
PARTITION_SIZES = [0, 1, 7, 131, 1023]


def rank_grads(world: int, partition: int, seed: int = 0) -> list[torch.Tensor]:
    return [sample(world * partition, torch.float32, seed=seed * 100 + r) for r in range(world)]


# ----------------------------------------------------------------------------- layout


def test_layout_order_and_slots():
    layout = SwizzleLayout(num_nodes=2, ranks_per_node=3, partition_numel=100, group_size=64)
    # chunk j (to local rank j) = partitions of ranks j, R + j; sub-chunk n = partition n*R + j
    assert layout.partition_order() == [0, 3, 1, 4, 2, 5]
    assert [layout.slot(p) for p in layout.partition_order()] == list(range(6))
    assert layout.padded_partition_numel == 128 and layout.groups_per_partition == 2
    assert layout.chunk_numel == 256 and layout.numel == 768 and layout.world_size == 6
    with pytest.raises(ValueError, match=r"partition must be in \[0, 6\), got 6"):
        layout.slot(6)
    with pytest.raises(ValueError, match="num_nodes must be a positive int, got 0"):
        SwizzleLayout(0, 1, 10, 4)
    with pytest.raises(ValueError, match="numel=10 must be divisible by world size num_nodes"):
        SwizzleLayout.for_numel(10, 2, 2, 4)


@over_topologies
@pytest.mark.parametrize("partition", PARTITION_SIZES)
@pytest.mark.parametrize("bits", [8, 4])
def test_swizzled_equals_quantize_of_explicit_layout(num_nodes, rpn, partition, bits):
    world = num_nodes * rpn
    cfg = QuantConfig(bits, 64)
    x = sample(world * partition, torch.bfloat16, seed=partition)
    q = swizzled_quantize(x, cfg, num_nodes, rpn)
    padded = -(-partition // 64) * 64
    # the documented layout, built by hand: for j, for n: partition n*R + j, zero-padded
    parts = []
    for j in range(rpn):
        for n in range(num_nodes):
            p = n * rpn + j
            parts.append(
                torch.cat([x[p * partition : (p + 1) * partition].float(), torch.zeros(padded - partition)])
            )
    expected = quantize(torch.cat(parts) if parts else torch.zeros(0), cfg)
    assert q.numel == world * padded
    assert torch.equal(q.codes, expected.codes) and torch.equal(q.scales, expected.scales)


@pytest.mark.parametrize("bits", [8, 4])
def test_chunks_and_subchunks_are_contiguous_whole_groups(bits):
    num_nodes, rpn, partition, gs = 2, 2, 100, 32
    x = sample(4 * partition)
    q = swizzled_quantize(x, QuantConfig(bits, gs), num_nodes, rpn)
    for j, chunk in enumerate(split(q, rpn)):
        for n, sub in enumerate(split(chunk, num_nodes)):
            p = n * rpn + j
            got = dequantize(sub)[:partition]
            assert torch.equal(
                got, dequantize(quantize(x[p * partition : (p + 1) * partition], QuantConfig(bits, gs)))
            )


def test_swizzled_rejects_bad_arguments():
    cfg = QuantConfig(8, 64)
    with pytest.raises(
        ValueError, match="numel=10 must be divisible by world size num_nodes.ranks_per_node=2.2=4"
    ):
        swizzled_quantize(torch.zeros(10), cfg, 2, 2)
    with pytest.raises(ValueError, match="num_nodes must be a positive int, got 0"):
        swizzled_quantize(torch.zeros(8), cfg, 0, 2)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int, got 1.5"):
        swizzled_quantize(torch.zeros(8), cfg, 1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x.dtype must be one of"):
        swizzled_quantize(torch.zeros(8, dtype=torch.int64), cfg, 1, 1)


# ----------------------------------------------------------------------------- fused reductions


@pytest.mark.parametrize("bits_in", [8, 4])
@pytest.mark.parametrize("bits_out", [8, 4])
@pytest.mark.parametrize("n_sources", [1, 2, 3, 4])
def test_dequant_reduce_requant_is_quantize_of_the_fp32_sum(bits_in, bits_out, n_sources):
    gs, chunk = 64, 64 * 5
    chunks = [sample(chunk, seed=s) for s in range(n_sources)]
    stacked = stack([quantize(c, QuantConfig(bits_in, gs)) for c in chunks])
    total = torch.zeros(chunk)
    for c in chunks:  # sources added in order, in fp32
        total += dequantize(quantize(c, QuantConfig(bits_in, gs)))
    assert torch.equal(dequant_reduce(stacked, n_sources), total)
    requant = dequant_reduce_requant(stacked, n_sources, QuantConfig(bits_out, gs))
    expected = quantize(total, QuantConfig(bits_out, gs))
    assert requant.numel == chunk and requant.bits == bits_out
    assert torch.equal(requant.codes, expected.codes) and torch.equal(requant.scales, expected.scales)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequant_reduce_output_dtype_and_out(out_dtype):
    stacked = stack([quantize(sample(128, seed=s), QuantConfig(8, 64)) for s in range(3)])
    full = dequant_reduce(stacked, 3)
    got = dequant_reduce(stacked, 3, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, full.to(out_dtype))
    out = torch.empty(2, 64, dtype=out_dtype)
    assert dequant_reduce(stacked, 3, out=out) is out and torch.equal(out.view(-1), got)


def test_single_source_reduce_is_dequantize_of_any_size():
    q = quantize(sample(131), QuantConfig(4, 64))
    assert torch.equal(dequant_reduce(q, 1), dequantize(q))


def test_reductions_reject_bad_arguments():
    aligned = stack([quantize(sample(128, seed=s), QuantConfig(8, 64)) for s in range(3)])  # 3 x 2 groups
    with pytest.raises(ValueError, match="q.numel=384 is not divisible by n_sources=5"):
        dequant_reduce(aligned, 5)
    with pytest.raises(
        ValueError, match="each of the 4 source chunks has 96 elements, not a multiple of group_size=64"
    ):
        dequant_reduce(aligned, 4)
    with pytest.raises(ValueError, match="n_sources must be a positive int, got 0"):
        dequant_reduce_requant(aligned, 0, QuantConfig(8, 64))
    with pytest.raises(ValueError, match="config.group_size=32 must equal the input's group_size=64"):
        dequant_reduce_requant(aligned, 3, QuantConfig(8, 32))
    with pytest.raises(TypeError, match="config must be a zero_kernels.QuantConfig"):
        dequant_reduce_requant(aligned, 3, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be a contiguous tensor of 128 elements"):
        dequant_reduce(aligned, 3, out=torch.empty(384))
    with pytest.raises(TypeError, match="q must be a zero_kernels.QuantizedTensor"):
        dequant_reduce(aligned.codes, 3)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- two-hop algorithm


def two_hop_bound(grads: list[torch.Tensor], p: int, partition: int, bits: int, gs: int) -> torch.Tensor:
    """Per element of partition ``p``: 2**-(b-1) * (2 + 2**-(b-1)) * sum over ranks of the group absmax.

    Each rank's quantization errs by at most A_r / 2**(b-1) (the clamp bound); a node's partial sum
    has absmax B_m <= (1 + 2**-(b-1)) * sum of its ranks' A_r; requantizing it errs by at most
    B_m / 2**(b-1); the final sum adds all of these errors.
    """
    step = 2.0 ** -(bits - 1)
    total = torch.zeros(partition, dtype=torch.float64)
    for g in grads:
        total += group_absmax(g[p * partition : (p + 1) * partition], gs)
    return step * (2 + step) * total + 1e-6 * total


@over_topologies
@pytest.mark.parametrize("partition", PARTITION_SIZES)
@pytest.mark.parametrize("bits", [8, 4])
def test_two_hop_reduces_every_partition_within_bound(num_nodes, rpn, partition, bits):
    world, gs = num_nodes * rpn, 64
    grads = rank_grads(world, partition, seed=partition + bits)
    reduced, _ = simulate_qgz(grads, QuantConfig(bits, gs), num_nodes, rpn)
    for p in range(world):
        exact = sum(g[p * partition : (p + 1) * partition].double() for g in grads)
        err = (reduced[p].double() - exact).abs()
        bound = two_hop_bound(grads, p, partition, bits, gs)
        assert reduced[p].shape == (partition,)
        assert (err <= bound).all(), f"rank {p}: error exceeds the bound by {(err - bound).max().item():.3e}"


def test_two_hop_routes_exactly_when_quantization_is_exact():
    """Routing alone, with no tolerance: every group of every rank holds -128 (int8 scale 1) and even
    integers, so each rank quantizes exactly; a node's partial sums then hold -256 (scale 2) and even
    integers, so requantizing them is exact too, and each rank must get exactly its partition's sum."""
    num_nodes, rpn, partition, gs = 2, 2, 32, 16
    world = num_nodes * rpn
    grads = []
    for r in range(world):
        gen = torch.Generator().manual_seed(r)
        g = 2.0 * torch.randint(-63, 64, (world * partition,), generator=gen).float()
        g[::gs] = -128.0
        grads.append(g)
    reduced, middle = simulate_qgz(grads, QuantConfig(8, gs), num_nodes, rpn)
    assert all((m.scales == 2.0).all() for m in middle.values())
    for p in range(world):
        exact = sum(g[p * partition : (p + 1) * partition] for g in grads)
        assert torch.equal(reduced[p], exact), f"rank {p} did not get the sum of partition {p}"


@pytest.mark.parametrize(
    ("bits", "group_size", "single_low", "single_high"),
    [(8, 4096, 0.008, 0.0095), (4, 2048, 0.12, 0.14)],
    ids=["int8-g4096", "int4-g2048"],
)
def test_two_hop_relative_rmse_on_gaussian_data(bits, group_size, single_low, single_high):
    """One quantization: REFERENCES' 0.9% (int8, g4096) / 13% (int4, g2048). Two hops quantize twice
    with independent errors of about the same relative size: sqrt(2) times that."""
    num_nodes, rpn, partition = 2, 2, 1 << 16
    world = num_nodes * rpn
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(world * partition, generator=gen) for _ in range(world)]
    cfg = QuantConfig(bits, group_size)
    single = relative_rmse(dequantize(quantize(grads[0], cfg)), grads[0])
    assert single_low <= single <= single_high, f"one quantization: relative RMSE {single:.4f}"
    reduced, _ = simulate_qgz(grads, cfg, num_nodes, rpn)
    exact = torch.stack(grads).double().sum(0)
    two_hop = relative_rmse(torch.cat(reduced), exact)
    assert 1.3 * single <= two_hop <= 1.5 * single, (
        f"two hops: {two_hop:.4f} vs one quantization {single:.4f}"
    )
