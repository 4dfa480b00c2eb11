"""reduce_scatter_coalesced (unpadded) and its padded form against all_reduce + slicing; bytes on the wire."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from comm_cases import (
    DTYPES,
    ODD_SIZES,
    one_storage,
    over_worlds,
    rank_tensor,
    result_of,
    run_on,
    same_buffer,
)

from zero_comm import (
    AllToAllReduceScatter,
    CommLedger,
    Topology,
    partition_numel,
    reduce_scatter_coalesced,
    reduce_scatter_coalesced_padded,
    shard_range,
)
from zero_comm.torch_compat import reduce_scatter_single
from zero_testing import assert_tensors_close, measure_wire_bytes

SHAPES = [(n,) for n in ODD_SIZES] + [(3, 5), (2, 0), (1, 1, 7)]
TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _reference(t: torch.Tensor, average: bool, group=None, padded: bool = True) -> torch.Tensor:
    """This rank's partition of the fp32 all-reduced tensor, zero-padded or only its real elements."""
    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    part = partition_numel(t.numel(), world)
    full = torch.zeros(world * part, dtype=torch.float32)
    full[: t.numel()] = t.reshape(-1).float()
    tdist.all_reduce(full, group=group)
    if average:
        full /= world
    if not padded:
        start, stop = shard_range(t.numel(), world, rank)
        return full[start:stop].to(t.dtype)
    return full[rank * part : (rank + 1) * part].to(t.dtype)


def _reduce_scatter_cases(rank):
    world = rank.world_size
    calls = 0
    with CommLedger(Topology()) as ledger:
        for name, dtype in DTYPES.items():
            integer = dtype == torch.float32  # integer-valued fp32 must come out exact
            tensors = [rank_tensor(i, rank.rank, s, dtype, integer=integer) for i, s in enumerate(SHAPES)]
            for op, padded in (("sum", False), ("avg", False), ("sum", True), ("avg", True)):
                call = reduce_scatter_coalesced_padded if padded else reduce_scatter_coalesced
                for async_op in (False, True):
                    parts = result_of(call(tensors, op=op, async_op=async_op), async_op)
                    calls += 1
                    assert same_buffer(parts) if padded else one_storage(parts)
                    for i, (t, p) in enumerate(zip(tensors, parts)):
                        ref = _reference(t, op == "avg", padded=padded)
                        assert p.shape == ref.shape and p.dtype == dtype, (i, p.shape, ref.shape)
                        if integer:
                            assert torch.equal(p, ref), f"{name} {op} tensor {i} {tuple(t.shape)}"
                        else:
                            assert_tensors_close(p, ref, TOLERANCE[dtype], f"{name} {op} tensor {i}")
    padded = sum(partition_numel(torch.Size(s).numel(), world) for s in SHAPES) * world
    fp32 = ledger.select(step=0)[:4]
    assert ledger.count("reduce_scatter") == calls == 24
    assert all(r.payload_bytes == sum(torch.Size(s).numel() for s in SHAPES) * 4 for r in fp32)
    assert all(r.wire_bytes == (world - 1) * padded * 4 // world for r in fp32)
    return calls


@over_worlds
@pytest.mark.smoke
def test_matches_all_reduce_then_slice(dist, spec):
    assert set(run_on(dist, spec, _reduce_scatter_cases)) == {24}


def _padding_and_accumulation(rank):
    world = rank.world_size
    # 7 elements over `world` ranks: the padded tail of the last partition must be zero.
    (part,) = reduce_scatter_coalesced_padded([torch.ones(7)], op="sum")
    start = rank.rank * partition_numel(7, world)
    expected = [float(world) if start + i < 7 else 0.0 for i in range(part.numel())]
    assert part.tolist() == expected
    # bf16: 1 + (world-1) * 2**-8 summed in fp32 and rounded once, not rounded after every add.
    value = 1.0 if rank.rank == 0 else 2.0**-8
    (got,) = reduce_scatter_coalesced_padded([torch.full((world,), value, dtype=torch.bfloat16)], op="sum")
    exact = torch.tensor(1.0 + (world - 1) * 2.0**-8).to(torch.bfloat16)
    assert torch.equal(got, exact.expand(1)), (got, exact)
    return got.item()


@over_worlds
def test_padding_is_zero_and_half_precision_accumulates_in_fp32(dist, spec):
    world, rpn = spec
    assert (
        dist.run(world, _padding_and_accumulation, ranks_per_node=rpn)
        == [{1: 1.0, 2: 1.0, 4: 1.015625}[world]] * world
    )


def _subgroup(rank):
    topo = Topology()
    group = topo.replicate_group(2) if rank.world_size % 2 == 0 else topo.shard_group(1)
    tensors = [rank_tensor(i, rank.rank, (n,), torch.float32, integer=True) for i, n in enumerate((131, 7))]
    parts = reduce_scatter_coalesced(tensors, group, op="avg")
    for t, p in zip(tensors, parts):
        assert torch.equal(p, _reference(t, True, group, padded=False))
    return [p.numel() for p in parts]


@over_worlds
def test_reduces_over_a_subgroup(dist, spec):
    world, rpn = spec
    groups = world // 2 if world % 2 == 0 else 1
    group_rank = [r // 2 if world % 2 == 0 else 0 for r in range(world)]
    expected = [[_real(n, groups, group_rank[r]) for n in (131, 7)] for r in range(world)]
    assert dist.run(world, _subgroup, ranks_per_node=rpn) == expected


def _real(numel: int, world: int, rank: int) -> int:
    start, stop = shard_range(numel, world, rank)
    return stop - start


def _wire_bytes(rank):
    world = rank.world_size
    tensors = [torch.ones(n) for n in (1_000_003, 524_287, 7)]
    padded = sum(partition_numel(t.numel(), world) for t in tensors) * world
    tdist.barrier()
    with measure_wire_bytes() as ours:
        reduce_scatter_coalesced(tensors, op="sum")
    flat, out = torch.ones(padded), torch.empty(padded // world)
    tdist.barrier()
    with measure_wire_bytes() as torch_rs:
        reduce_scatter_single(out, flat)
    return ours.written, torch_rs.written, (world - 1) * padded * 4 // world


@over_worlds
def test_wire_bytes_are_ring_ideal_and_half_of_gloo_reduce_scatter(dist, spec):
    world, rpn = spec
    for ours, theirs, ideal in dist.run(world, _wire_bytes, ranks_per_node=rpn):
        if world == 1:
            assert ours == 0 and ideal == 0
            continue
        assert 0.95 * ideal <= ours <= 1.1 * ideal + 65536, (ours, ideal)
        assert ours < 0.7 * theirs, f"ours {ours} vs dist.reduce_scatter_single {theirs}"


def _bad_inputs(rank):
    ok = torch.ones(4)
    with pytest.raises(ValueError, match="unsupported reduction 'max'; use one of 'sum', 'avg'"):
        reduce_scatter_coalesced([ok], op="max")
    with pytest.raises(ValueError, match="op='avg' needs a floating-point dtype, got torch.int64"):
        reduce_scatter_coalesced([torch.ones(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="input 1 is not contiguous"):
        reduce_scatter_coalesced([ok, torch.ones(4, 4).t()])
    with pytest.raises(ValueError, match="input 1 has dtype torch.bfloat16"):
        reduce_scatter_coalesced([ok, ok.bfloat16()])
    with pytest.raises(ValueError, match="empty list"):
        reduce_scatter_coalesced([])
    (summed,) = reduce_scatter_coalesced([torch.ones(3, dtype=torch.int64)], op=tdist.ReduceOp.SUM)
    return summed.tolist()


@over_worlds
def test_bad_inputs_are_named(dist, spec):
    world, rpn = spec
    expected = [[world] * _real(3, world, r) for r in range(world)]
    assert dist.run(world, _bad_inputs, ranks_per_node=rpn) == expected


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_local_sum_over_received_rows(rows, dtype):
    from zero_comm.row_exchange import sum_rows

    recv = torch.randint(-20, 20, (rows, 1023), generator=torch.Generator().manual_seed(rows)).to(dtype)
    for average in (False, True):
        out = torch.empty(1023, dtype=dtype)
        sum_rows(recv, out, average)
        want = recv.double().sum(0) / (rows if average else 1)
        assert torch.equal(out, want.to(dtype)), (rows, dtype, average)


def _deepspeed_partitions(rank):
    """The original's results: each rank's real elements, numel 3 over 2 ranks is 2 then 1."""
    world, me = rank.world_size, rank.rank
    numels = [3, 1, 0, 7, world - 1, 2 * world + 1]
    tensors = [rank_tensor(i, me, (n,), torch.float32, integer=True) for i, n in enumerate(numels)]
    tensors.append(rank_tensor(9, me, (3, 5), torch.float32, integer=True))
    sizes = []
    for async_op in (False, True):
        got = result_of(reduce_scatter_coalesced(tensors, op="sum", async_op=async_op), async_op)
        for t, g in zip(tensors, got):
            full = t.reshape(-1).clone()
            tdist.all_reduce(full)  # plain torch
            step = -(-t.numel() // world)  # DeepSpeed's partition size: ceil(numel / world)
            assert torch.equal(g, full[me * step : (me + 1) * step]), (t.shape, g, full)
        sizes.append([g.numel() for g in got])
    # the strategy the optimizers use keeps the padded partitions: same numbers, zero tail
    padded = AllToAllReduceScatter().reduce_scatter_coalesced(tensors, op="sum").wait()
    assert [p.numel() for p in padded] == [partition_numel(t.numel(), world) for t in tensors]
    for g, p in zip(got, padded):
        assert torch.equal(p[: g.numel()], g) and not p[g.numel() :].any()
    assert sizes[0] == sizes[1]
    return sizes[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_partitions_are_unpadded_as_the_original(dist, world):
    got = dist.run(world, _deepspeed_partitions)
    numels = [3, 1, 0, 7, world - 1, 2 * world + 1, 15]
    assert got == [[_real(n, world, r) for n in numels] for r in range(world)]
    if world == 2:
        assert [g[0] for g in got] == [2, 1]  # numel 3 over 2 ranks
        assert [g[1] for g in got] == [1, 0]  # smaller than the world: an empty partition


def _rank_order_sum(t: torch.Tensor, average: bool, group=None) -> torch.Tensor:
    """This rank's partition summed row by row in rank order (as ``sum_rows``), from an all-gather."""
    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    part = partition_numel(t.numel(), world)
    padded = torch.zeros(world * part, dtype=t.dtype)
    padded[: t.numel()] = t.reshape(-1)
    rows = [torch.empty_like(padded) for _ in range(world)]
    tdist.all_gather(rows, padded, group=group)
    mine = [r[rank * part : (rank + 1) * part] for r in rows]
    if t.dtype in (torch.float16, torch.bfloat16):
        acc = mine[0].float()
        for m in mine[1:]:
            acc.add_(m)
        return (acc.div_(world) if average else acc).to(t.dtype)
    out = torch.add(mine[0], mine[1])
    for m in mine[2:]:
        out.add_(m)
    return out.div_(world) if average else out


def _bit_exact_single_and_several(rank):
    """Random (non-integer) values: the sum order is rank order, bit for bit; inputs are left intact."""
    world = rank.world_size
    gen = torch.Generator().manual_seed(100 + rank.rank)
    checked = 0
    for dtype in DTYPES.values():
        for numels in ([world * 1023], [world * 5 + 1], [world * 64, 7, 0, 131], [3, world * 2]):
            tensors = [torch.randn(n, generator=gen).to(dtype) for n in numels]
            before = [t.clone() for t in tensors]
            for op in ("sum", "avg"):
                parts = reduce_scatter_coalesced_padded(tensors, op=op, async_op=True).wait()
                for t, b, p in zip(tensors, before, parts):
                    assert torch.equal(t, b), "reduce_scatter_coalesced wrote into its input"
                    ref = _rank_order_sum(t, op == "avg")
                    assert torch.equal(p, ref), (dtype, numels, op, (p - ref).abs().max())
                    checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sums_in_rank_order_bit_for_bit_without_touching_inputs(dist, world):
    """One unpadded tensor is sent as it is (edge and middle ranks), several are staged: same bits."""
    assert dist.run(world, _bit_exact_single_and_several) == [3 * 2 * 8] * world
