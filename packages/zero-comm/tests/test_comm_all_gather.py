"""all_gather_coalesced against per-tensor torch all-gathers, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as tdist
from comm_cases import DTYPES, ODD_SIZES, over_worlds, rank_tensor, result_of, run_on, same_buffer

from zero_comm import CommLedger, FlatAllGather, Topology, all_gather_coalesced
from zero_comm.coalesced import adjacent_flat_view
from zero_comm.torch_compat import all_gather_single


def _reference(shard: torch.Tensor, group=None) -> torch.Tensor:
    out = torch.empty(tdist.get_world_size(group) * shard.numel(), dtype=shard.dtype)
    all_gather_single(out, shard, group=group)
    return out


def _check_against_reference(shards, full, group=None) -> None:
    assert len(full) == len(shards)
    for i, (s, f) in enumerate(zip(shards, full)):
        ref = _reference(s, group)
        assert f.shape == ref.shape and f.dtype == s.dtype, (i, f.shape, ref.shape)
        assert torch.equal(f, ref), f"tensor {i} (numel {s.numel()}) differs from all_gather_single"


def _gather_cases(rank):
    world = rank.world_size
    calls = 0
    with CommLedger(Topology()) as ledger:
        for name, dtype in DTYPES.items():
            shards = [rank_tensor(i, rank.rank, (n,), dtype) for i, n in enumerate(ODD_SIZES)]
            for use_out in (False, True):
                for async_op in (False, True):
                    out = torch.full((world * sum(ODD_SIZES),), 7.0, dtype=dtype) if use_out else None
                    full = result_of(all_gather_coalesced(shards, async_op=async_op, out=out), async_op)
                    calls += 1
                    _check_against_reference(shards, full)
                    assert same_buffer(full, out.data_ptr() if use_out else None), name
    shard_bytes = sum(ODD_SIZES) * 4
    assert ledger.count("all_gather") == calls == 12
    fp32 = [r for r in ledger.records if r.payload_bytes == shard_bytes]
    assert len(fp32) == 4 and all(r.wire_bytes == (world - 1) * shard_bytes for r in fp32)
    return calls


@over_worlds
@pytest.mark.smoke
def test_matches_per_tensor_all_gather_for_odd_shapes_and_dtypes(dist, spec):
    assert set(run_on(dist, spec, _gather_cases)) == {12}


def _single_and_empty(rank):
    world = rank.world_size
    shard = rank_tensor(3, rank.rank, (4099,), torch.float32)
    out = torch.empty(world * 4099)
    (full,) = all_gather_coalesced([shard], out=out)
    assert full.data_ptr() == out.data_ptr() and torch.equal(full, _reference(shard))
    empties = all_gather_coalesced([torch.empty(0), torch.empty(0)])
    assert [e.numel() for e in empties] == [0, 0]
    mixed = [torch.empty(0), rank_tensor(4, rank.rank, (1,), torch.float32), torch.empty(0)]
    _check_against_reference(mixed, all_gather_coalesced(mixed))
    store = rank_tensor(5, rank.rank, (1023 + 7 + 131,), torch.float16)  # shards kept in one buffer
    adjacent = list(torch.split(store, [1023, 0, 7, 131]))
    assert adjacent_flat_view(adjacent) is not None
    _check_against_reference(adjacent, all_gather_coalesced(adjacent))
    return True


@over_worlds
def test_one_tensor_lands_in_out_and_empty_shards_work(dist, spec):
    assert all(run_on(dist, spec, _single_and_empty))


def _subgroup_gather(rank):
    topo = Topology()
    results = []
    for shard_size in (1, 2):
        if rank.world_size % shard_size:
            continue
        group = topo.shard_group(shard_size)
        shards = [rank_tensor(i, rank.rank, (n,), torch.bfloat16) for i, n in enumerate((131, 0, 7))]
        full = all_gather_coalesced(shards, group, async_op=True).wait()
        _check_against_reference(shards, full, group)
        results.append(full[0].numel())
    return results


@over_worlds
def test_gathers_over_a_shard_group(dist, spec):
    world, rpn = spec
    expected = [131, 262] if world % 2 == 0 else [131]
    assert dist.run(world, _subgroup_gather, ranks_per_node=rpn) == [expected] * world


def _bad_inputs(rank):
    world = rank.world_size
    ok = torch.ones(4)
    with pytest.raises(ValueError, match="empty list"):
        all_gather_coalesced([])
    with pytest.raises(ValueError, match="input 1 has dtype torch.float16 but input 0 has torch.float32"):
        all_gather_coalesced([ok, ok.half()])
    with pytest.raises(ValueError, match="input 1 is on meta but input 0 is on cpu"):
        all_gather_coalesced([ok, torch.empty(4, device="meta")])
    with pytest.raises(ValueError, match="input 2 is not contiguous"):
        all_gather_coalesced([ok, ok, torch.ones(8)[::2]])
    with pytest.raises(ValueError, match=r"input 1 has shape \(2, 2\); shards must be 1-D"):
        all_gather_coalesced([ok, torch.ones(2, 2)])
    with pytest.raises(ValueError, match=f"out has 7 elements but needs {world * 8}"):
        all_gather_coalesced([ok, ok], out=torch.empty(7))
    with pytest.raises(ValueError, match="out is torch.float16"):
        all_gather_coalesced([ok], out=torch.empty(world * 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="single tensor"):
        all_gather_coalesced(ok)
    return True


@over_worlds
def test_bad_inputs_are_named(dist, spec):
    assert all(run_on(dist, spec, _bad_inputs))


def test_adjacent_shards_are_recognised_as_one_buffer():
    buf = torch.arange(20.0)
    flat = adjacent_flat_view([buf[0:3], buf[3:3], buf[3:10], buf[10:11]])
    assert flat is not None and flat.data_ptr() == buf.data_ptr() and torch.equal(flat, buf[:11])
    assert adjacent_flat_view([buf[4:6], buf[6:7]]).data_ptr() == buf[4:].data_ptr()
    assert adjacent_flat_view([buf[0:3], buf[4:6]]) is None  # gap
    assert adjacent_flat_view([buf[3:5], buf[0:3]]) is None  # out of order
    assert adjacent_flat_view([torch.ones(2), torch.ones(2)]) is None  # two storages
    assert adjacent_flat_view([torch.empty(0)]) is None


def _gather_into_cases(rank):
    from zero_comm import all_gather_coalesced_into

    world = rank.world_size
    sizes = [n for n in ODD_SIZES if n]
    checked = 0
    with CommLedger(Topology()) as ledger:
        for dtype in DTYPES.values():
            shards = [rank_tensor(i, rank.rank, (n,), dtype) for i, n in enumerate(sizes)]
            # destinations of every length up to the gathered one, reshaped: padding is dropped
            lengths = [world * n - (i % world) for i, n in enumerate(sizes)]
            for async_op in (False, True):
                outs = [torch.full((k,), 7.0, dtype=dtype) for k in lengths]
                outs[-1] = outs[-1].view(1, -1)  # any shape, contiguous
                got = result_of(all_gather_coalesced_into(shards, outs, async_op=async_op), async_op)
                assert got == outs
                for s, out in zip(shards, outs):
                    ref = _reference(s)
                    assert torch.equal(out.view(-1), ref[: out.numel()])
                    checked += 1
        # shards lying back to back in one buffer (no concatenation on the way)
        flat = rank_tensor(9, rank.rank, (sum(sizes),), torch.float32)
        shards = list(torch.split(flat, sizes))
        outs = [torch.empty(world * n) for n in sizes]
        all_gather_coalesced_into(shards, outs)
        assert all(torch.equal(o, _reference(s)) for s, o in zip(shards, outs))
        # one tensor, no padding to drop: the collective fills the destination (through the strategy)
        one = rank_tensor(11, rank.rank, (7,), torch.float32)
        for async_op in (False, True):
            out = torch.full((world, 7), 7.0)
            FlatAllGather().all_gather_coalesced_into([one], [out], async_op=async_op).wait()
            assert torch.equal(out.view(-1), _reference(one))
    assert ledger.count("all_gather") == 9
    with pytest.raises(ValueError, match="more than"):
        all_gather_coalesced_into([shards[0]], [torch.empty(world * sizes[0] + 1)])
    with pytest.raises(ValueError, match="outputs for"):
        all_gather_coalesced_into(shards, outs[:1])
    with pytest.raises(ValueError, match="dtype|float64"):
        all_gather_coalesced_into([shards[0]], [torch.empty(1, dtype=torch.float64)])
    return checked


@over_worlds
def test_gather_into_destinations_matches_torch_and_drops_padding(dist, spec):
    world, rpn = spec
    assert dist.run(world, _gather_into_cases, ranks_per_node=rpn) == [30] * world


def _profiled_gather(shards, outs, async_op):
    """``all_gather_coalesced_into`` under the profiler: result, ops run, the fused copies' shapes."""
    from torch.profiler import ProfilerActivity, profile

    from zero_comm import all_gather_coalesced_into

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        got = result_of(all_gather_coalesced_into(shards, outs, async_op=async_op), async_op)
    events = prof.events()
    copied = [e.input_shapes[0] for e in events if e.name == "aten::split_with_sizes_copy"]
    return got, {e.name for e in events}, copied


def _adjacent_shards(world, me, sizes, dtype):
    """Shards back to back in one buffer (stage 3's windows) and whole outputs of their own."""
    flat = rank_tensor(13, me, (sum(sizes) + 3,), dtype)[3:]  # not at the storage's start
    return list(torch.split(flat, sizes)), [torch.full((world, n), 7.0, dtype=dtype) for n in sizes]


def _shards_beside_outputs(world, me, sizes, dtype):
    """Adjacent shards and whole outputs carved from one buffer: the outputs wait for the exchange."""
    total = sum(sizes)
    flat = torch.full((world * total + total,), 7.0, dtype=dtype)
    outs = [o.view(world, n) for o, n in zip(flat[: world * total].split([world * n for n in sizes]), sizes)]
    flat[world * total :].copy_(rank_tensor(13, me, (total,), dtype))
    return list(flat[world * total :].split(sizes)), outs


def _own_row_shards(world, me, sizes, dtype):
    """Shards that are their outputs' own rows (stage 1's parameters, padded regions back to back)."""
    flat = torch.full((world * sum(sizes),), 7.0, dtype=dtype)
    outs = list(flat.split([world * n for n in sizes]))
    shards = [out.view(world, n)[me] for out, n in zip(outs, sizes)]
    for i, s in enumerate(shards):
        s.copy_(rank_tensor(i, me, (s.numel(),), dtype))
    return shards, outs


def _expected_copies(kind, world, me, total):
    """The fused copies' input shapes: only other ranks' rows are staged where the layout allows."""
    if kind == "own_rows":  # one fused copy per block of other ranks' rows, before / after the own row
        return [[rows, total] for rows in (me, world - 1 - me) if rows]
    if world == 2 and kind == "adjacent":  # own row straight from the shards, the peer's from its buffer
        return [[1, total], [1, total]]
    return [[world, total]] if world > 1 else None  # every row staged (one rank: a copy per output)


def _whole_output_cases(rank, kind):
    world, me = rank.world_size, rank.rank
    sizes = [n for n in ODD_SIZES if n]
    layouts = {"adjacent": _adjacent_shards, "beside": _shards_beside_outputs, "own_rows": _own_row_shards}
    layout = layouts[kind]
    checked = 0
    for dtype, async_op in itertools.product(DTYPES.values(), (False, True)):
        shards, outs = layout(world, me, sizes, dtype)
        refs = [_reference(s.clone()) for s in shards]
        got, names, copied = _profiled_gather(shards, outs, async_op)
        assert got == outs
        assert all(torch.equal(o.view(-1), r) for o, r in zip(outs, refs)), (dtype, async_op)
        expected = _expected_copies(kind, world, me, sum(sizes))
        assert expected is None or copied == expected, copied
        assert kind != "adjacent" or world != 2 or "aten::cat" not in names  # no concatenation either
        checked += 1
    return checked


@over_worlds
@pytest.mark.parametrize("kind", ["adjacent", "beside", "own_rows"])
def test_gather_into_whole_outputs_stages_only_other_ranks_rows(dist, spec, kind):
    """Adjacent shards (two ranks) or the outputs' own rows: same result, own rows never staged.

    Shards in the outputs' buffer ("beside") are staged: no output is written before the exchange.
    """
    world, rpn = spec
    assert dist.run(world, _whole_output_cases, kind, ranks_per_node=rpn) == [len(DTYPES) * 2] * world


def _separate_shards(world, me, sizes, dtype):
    """Shards of their own (not back to back) and whole outputs: every row staged."""
    return [rank_tensor(20 + i, me, (n,), dtype) for i, n in enumerate(sizes)], [
        torch.full((world * n,), 7.0, dtype=dtype) for n in sizes
    ]


def _single_whole(world, me, sizes, dtype):
    """One unpadded tensor: the collective fills its output directly."""
    return [rank_tensor(30, me, (sizes[-1],), dtype)], [torch.full((world, sizes[-1]), 7.0, dtype=dtype)]


_PLAN_LAYOUTS = {
    "adjacent": (_adjacent_shards, "PEER"),
    "beside": (_shards_beside_outputs, "STAGED"),
    "own_rows": (_own_row_shards, "STAGED"),
    "separate": (_separate_shards, "STAGED"),
    "single": (_single_whole, "WHOLE"),
}


def _plan_cases(rank, kind):
    """One GatherIntoPlan issued three times: new shard values each time, own outputs emptied
    (storage resized to 0 bytes) and refilled in between; each issue against the reference."""
    from zero_comm import GatherIntoPlan

    world, me = rank.world_size, rank.rank
    layout, route = _PLAN_LAYOUTS[kind]
    if world == 1:
        route = "LOCAL"
    elif route == "PEER" and world != 2:
        route = "STAGED"
    sizes = [n for n in ODD_SIZES if n]
    issued = 0
    with CommLedger(Topology()) as ledger:
        for dtype in DTYPES.values():
            shards, outs = layout(world, me, sizes, dtype)
            plan = FlatAllGather().plan_gather_into(shards, outs)
            assert isinstance(plan, GatherIntoPlan) and f"route={route}" in repr(plan), repr(plan)
            owns_storage = kind in ("adjacent", "separate", "single")
            for turn in range(3):
                for s in shards:
                    s.add_(turn)  # new values, same tensors
                if owns_storage and turn:
                    for out in outs:  # emptied and refilled, as a released parameter's storage
                        nbytes = out.untyped_storage().nbytes()
                        out.untyped_storage().resize_(0)
                        out.untyped_storage().resize_(nbytes)
                        out.fill_(7.0)
                refs = [_reference(s.clone()) for s in shards]
                assert plan.issue(async_op=bool(turn % 2)).wait() == outs
                for i, (out, ref) in enumerate(zip(outs, refs)):
                    assert torch.equal(out.view(-1), ref[: out.numel()]), (kind, dtype, turn, i)
                issued += 1
    payload = [sum(s.numel() for s in layout(world, me, sizes, d)[0]) * d.itemsize for d in DTYPES.values()]
    assert [r.payload_bytes for r in ledger.records] == [b for b in payload for _ in range(3)]
    return issued


@over_worlds
@pytest.mark.parametrize("kind", list(_PLAN_LAYOUTS))
def test_a_planned_gather_issued_again_matches_torch_each_time(dist, spec, kind):
    """GatherIntoPlan: planned once (the route its layout allows), issued three times over changed
    shard values and outputs whose storage was emptied and refilled; every issue is in the ledger."""
    world, rpn = spec
    assert dist.run(world, _plan_cases, kind, ranks_per_node=rpn) == [len(DTYPES) * 3] * world


def _plan_refusals(rank):
    from zero_comm import GatherIntoPlan

    world = rank.world_size
    shard = torch.ones(5)
    with pytest.raises(ValueError, match="more than"):
        GatherIntoPlan([shard], [torch.empty(world * 5 + 1)])
    with pytest.raises(ValueError, match="outputs for"):
        GatherIntoPlan([shard, shard], [torch.empty(world * 5)])
    with pytest.raises(ValueError, match="contiguous"):
        GatherIntoPlan([shard], [torch.empty(world * 5, 2)[:, 0]])
    return True


@over_worlds
def test_a_gather_plan_refuses_what_the_gather_refuses(dist, spec):
    world, rpn = spec
    assert dist.run(world, _plan_refusals, ranks_per_node=rpn) == [True] * world
