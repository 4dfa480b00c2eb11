"""Casting collectives (communication_data_type) against fp64 references and the rounding bound."""

from __future__ import annotations

import pytest
import torch
from comm_cases import ODD_SIZES, over_worlds, run_on

from zero_comm import (
    CastAllGather,
    CastAllReduce,
    CastReduceScatter,
    CommLedger,
    FlatAllGather,
    Topology,
    partition_numel,
    reduce_scatter_coalesced_padded,
)
from zero_comm.row_exchange import interleave

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32_EPS = 2.0**-24
SUBNORMAL_STEP = {
    torch.bfloat16: 0.0,
    torch.float16: 2.0**-25,
}  # absolute rounding error below fp16's normals
SHAPES = [(n,) for n in ODD_SIZES] + [(3, 5), (1, 1, 7)]


def _grad(seed: int, rank: int, shape) -> torch.Tensor:
    """Gradient-like data: values over many magnitudes (1e-6 .. 1e2), differing per rank."""
    gen = torch.Generator().manual_seed(7919 * seed + rank)
    mag = 10.0 ** (torch.rand(shape, generator=gen) * 8 - 6)
    return torch.randn(shape, generator=gen) * mag


def _partition(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    part = partition_numel(full.numel(), world)
    padded = torch.zeros(world * part, dtype=full.dtype)
    padded[: full.numel()] = full.reshape(-1)
    return padded[rank * part : (rank + 1) * part]


def _bound(per_rank: list[torch.Tensor], dtype: torch.dtype, world: int) -> torch.Tensor:
    """|average through dtype - exact average| <= (u + W eps32) sum|g_r| / W + subnormal steps."""
    abs_sum = torch.stack([g.double().abs() for g in per_rank]).sum(0)
    u = UNIT_ROUNDOFF[dtype]
    return (u + world * FP32_EPS) * abs_sum / world + SUBNORMAL_STEP[dtype] + 1e-30


def _reduce_scatter(rank, dtype_name):
    dtype, world, r = HALF[dtype_name], rank.world_size, rank.rank
    strategy = CastReduceScatter(dtype)
    worst = 0.0
    with CommLedger(Topology()) as ledger:
        tensors = [_grad(i, r, s) for i, s in enumerate(SHAPES)]
        parts = strategy.reduce_scatter_coalesced(tensors, op="avg", async_op=True).wait()
        plain_parts = reduce_scatter_coalesced_padded(tensors, op="avg")
    for i, (s, part) in enumerate(zip(SHAPES, parts)):
        per_rank = [_partition(_grad(i, q, s), world, r) for q in range(world)]
        exact = torch.stack([g.double() for g in per_rank]).sum(0) / world
        assert part.dtype == torch.float32 and part.shape == plain_parts[i].shape
        err = (part.double() - exact).abs()
        bound = _bound(per_rank, dtype, world)
        assert bool((err <= bound).all()), f"tensor {i}: error {err.max()} beyond the rounding bound"
        rel = err / bound
        worst = max(worst, float(rel.max()) if rel.numel() else 0.0)
    cast_bytes, fp32_bytes = (rec.wire_bytes for rec in ledger.select("reduce_scatter"))
    payload = [rec.payload_bytes for rec in ledger.select("reduce_scatter")]
    assert 2 * cast_bytes == fp32_bytes and 2 * payload[0] == payload[1]
    return worst


@over_worlds
@pytest.mark.parametrize("dtype_name", list(HALF))
def test_reduce_scatter_through_half_is_within_the_rounding_bound_and_halves_the_bytes(
    dist, spec, dtype_name
):
    world, rpn = spec
    worst = dist.run(world, _reduce_scatter, dtype_name, ranks_per_node=rpn)
    assert max(worst) > 0.0 or world == 1 and dtype_name == "bf16"  # the cast rounds: not fp32 in disguise


def _all_gather(rank, dtype_name):
    dtype, world, r = HALF[dtype_name], rank.world_size, rank.rank
    fulls = [_grad(i, 99, (world * n,)) for i, n in enumerate(ODD_SIZES)]
    shards = [f[r * n : (r + 1) * n].clone() for f, n in zip(fulls, ODD_SIZES)]
    with CommLedger(Topology()) as ledger:
        # destinations shorter than the gathered tensor drop its padding (as parameters do)
        outs = [torch.full((max(world * n - 1, 0),), float("nan")) for n in ODD_SIZES]
        got = CastAllGather(dtype).all_gather_coalesced_into(shards, outs, async_op=True).wait()
        flat = CastAllGather(dtype).all_gather_coalesced(shards).wait()
        FlatAllGather().all_gather_coalesced(shards).wait()
    for f, o, g in zip(fulls, got, flat):
        rounded = f.to(dtype).float()  # every rank, the owner too, sees the same rounded value
        assert torch.equal(o, rounded[: o.numel()]) and torch.equal(g, rounded)
    cast, _, fp32 = (rec.wire_bytes for rec in ledger.select("all_gather"))
    assert 2 * cast == fp32
    return [float(o.sum()) for o in got]


@over_worlds
@pytest.mark.parametrize("dtype_name", list(HALF))
def test_all_gather_through_half_gives_every_rank_the_rounded_values(dist, spec, dtype_name):
    sums = run_on(dist, spec, _all_gather, dtype_name)
    assert all(s == sums[0] for s in sums)


def _all_reduce(rank, dtype_name):
    dtype, world, r = HALF[dtype_name], rank.world_size, rank.rank
    t = _grad(5, r, (3, 41))
    exact = torch.stack([_grad(5, q, (3, 41)).double() for q in range(world)]).sum(0) / world
    got = CastAllReduce(dtype).all_reduce(t.clone(), op="avg").wait()
    bound = _bound([_grad(5, q, (3, 41)) for q in range(world)], dtype, world)
    bound = bound + UNIT_ROUNDOFF[dtype] * exact.abs() * (1 + UNIT_ROUNDOFF[dtype]) + SUBNORMAL_STEP[dtype]
    assert bool(((got.double() - exact).abs() <= bound).all())
    return float(got.sum())


@over_worlds
@pytest.mark.parametrize("dtype_name", list(HALF))
def test_all_reduce_through_half_is_within_two_roundings(dist, spec, dtype_name):
    sums = run_on(dist, spec, _all_reduce, dtype_name)
    assert all(s == sums[0] for s in sums)


def test_an_unknown_communication_dtype_is_refused():
    with pytest.raises(ValueError, match="communication dtype must be"):
        CastReduceScatter(torch.int8)


def _interleave_one_copy_per_piece(tensors, parts, world, dtype):
    """The staging of the cast reduce-scatter as it was: one copy per rank and tensor."""
    flats = [t.view(-1) for t in tensors]
    send = torch.zeros(world, sum(parts), dtype=dtype)
    for r in range(world):
        offset = 0
        for f, p in zip(flats, parts):
            piece = f[min(r * p, f.numel()) : min((r + 1) * p, f.numel())]
            if piece.numel():
                send[r, offset : offset + piece.numel()].copy_(piece)
            offset += p
    return send


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staging_cast_in_one_cat_equals_a_copy_per_piece(world, dtype):
    gen = torch.Generator().manual_seed(world)
    tensors = [torch.randn(n, generator=gen) * 1e3 for n in ODD_SIZES + [world * 3]]
    tensors[1][0] = 1e9  # out of fp16's range: inf either way
    parts = [partition_numel(t.numel(), world) for t in tensors]
    got, _ = interleave(tensors, parts, world, None, dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, _interleave_one_copy_per_piece(tensors, parts, world, dtype))
