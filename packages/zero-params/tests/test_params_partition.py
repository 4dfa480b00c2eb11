"""partition / gather / release on random module trees, the state object, errors."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from params_cases import build_tree, held_bytes, reference_partition, run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, FlatAllGather, Topology

pytest_plugins = ("params_worlds",)

DIMS = [0, 1, 2, 3, 5, 7, 13, 31]
paths = st.sampled_from(["", "a", "b", "a.b", "a.c", "b.a.c"])
shapes = st.lists(st.sampled_from(DIMS), min_size=0, max_size=3).map(tuple)
trees = st.lists(st.tuples(paths, shapes), min_size=1, max_size=7)


def _partition_gather_release(spec, seed, threshold):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_tree(spec, seed)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    to_shard = [p for p in params if p.numel() > threshold]
    before_sharded = held_bytes(to_shard)
    states = zp.partition(model, persistence_threshold=threshold)
    assert [s.name for s in states] == list(ref)
    for (name, p), s in zip(model.named_parameters(), states):
        full = ref[name]
        assert zp.state_of(p) is s and s.shape == full.shape and zp.full_shape(p) == full.shape
        assert s.group_size == world and s.group_rank == rank and s.numel == full.numel()
        assert s.partition_numel == -(-full.numel() // world)
        assert torch.equal(s.shard, reference_partition(full, world, rank))
        if full.numel() <= threshold:
            assert s.persistent and s.status is zp.ParamStatus.AVAILABLE and type(p) is nn.Parameter
            assert torch.equal(p, full)
        else:
            assert not s.persistent and s.status is zp.ParamStatus.NOT_AVAILABLE
            assert type(p) is zp.PartitionedParameter and p.shape == (0,)
            assert f"shape={tuple(full.shape)}" in repr(p) and "NOT_AVAILABLE" in repr(p)
    partitioned = held_bytes(params)
    sharded_bytes = (before_sharded, held_bytes(to_shard))
    zp.gather(params).wait()
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and zp.state_of(p).status is zp.ParamStatus.AVAILABLE
        assert p.shape == ref[name].shape and torch.equal(p, ref[name]), name
    gathered = held_bytes(params)
    storages = [zp.state_of(p).unsharded for p in params if not zp.state_of(p).persistent]
    views = [p.detach() for p in params]  # like autograd's saved views: they must not keep the bytes
    zp.release(params)
    released = held_bytes(params)
    assert all(u.nbytes == 0 for u in storages), "a gathered storage kept its bytes after release"
    sharded = [v for v, p in zip(views, params) if not zp.state_of(p).persistent]
    assert all(v.untyped_storage().nbytes() == 0 for v in sharded), "a view kept a released storage's bytes"
    return partitioned, gathered, released, sharded_bytes


@settings(max_examples=15, deadline=None)
@given(spec=trees, seed=st.integers(0, 2**16), threshold=st.sampled_from([0, 1, 7, 40]))
@example(spec=[("", ())] * 4 + [("", (2,)), ("", (7,))], seed=0, threshold=1)  # padded scalars: totals equal
def test_partition_then_gather_reproduces_every_parameter(dist, world, spec, seed, threshold):
    results = run(dist, world, _partition_gather_release, spec, seed, threshold)
    numels = [torch.Size(s).numel() for _, s in spec]
    sharded = sum(n for n in numels if n > threshold)
    for partitioned, gathered, released, (sharded_before, sharded_after) in results:
        assert released == partitioned
        if sharded:
            assert gathered > partitioned
        if world > 1 and sharded > 4 * world:
            # the sharded parameters shrink; persistent ones keep their whole values (padded to the
            # group size), so the total alone may not (four scalars and two small vectors: 52 == 52)
            assert sharded_after < sharded_before


def _coalesced_and_deduplicated():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    zp.partition(model)
    with CommLedger(Topology()) as ledger:
        first = zp.gather(params, async_op=True)
        inflight = [zp.state_of(p).status for p in params]
        again = zp.gather(params + params[:2], async_op=True)  # joins the in-flight collective
        again.wait()
        zp.gather(params).wait()  # already AVAILABLE: nothing
        first.wait()
    assert all(torch.equal(p, r) for p, r in zip(params, ref))
    expected = [zp.state_of(p).padded_numel * p.element_size() for p in params]  # the gather's padded size
    held_all = [zp.state_of(p).unsharded.nbytes for p in params]
    fills = [zp.state_of(p).unsharded.fills for p in params]
    zp.release(params[:3])  # each parameter has its own storage: these three are freed now
    held_after = [zp.state_of(p).unsharded.nbytes for p in params]
    zp.release(params)
    return ledger.count(op="all_gather"), inflight, expected, held_all, held_after, fills


@pytest.mark.smoke
def test_gathering_twice_issues_one_collective(dist, world):
    results = run(dist, world, _coalesced_and_deduplicated)
    for count, inflight, expected, held_all, held_after, fills in results:
        assert count == 1
        assert inflight == [zp.ParamStatus.INFLIGHT] * 4
        assert held_all == expected and fills == [1] * 4
        assert held_after == [0, 0, 0, expected[3]]


def _one_collective_per_group():
    topo = Topology()
    world = dist.get_world_size()
    half = topo.shard_group(max(world // 2, 1))
    on_world, on_half = FlatAllGather(), FlatAllGather(half)
    torch.manual_seed(1)
    a, b, c = nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 5)
    ref = [p.detach().clone() for m in (a, b, c) for p in m.parameters()]
    zp.partition(a, gather_strategy=on_world)
    zp.partition(b, half, gather_strategy=on_half)
    zp.partition(c, gather_strategy=on_world)  # another call, same strategy: coalesced with a
    params = [p for m in (a, b, c) for p in m.parameters()]
    with CommLedger(topo) as ledger:
        zp.gather(params, async_op=False)
    same = all(torch.equal(p, r) for p, r in zip(params, ref))
    zp.release(params)
    try:
        zp.gather(list(b.parameters()), group=dist.group.WORLD)
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    return ledger.count(op="all_gather"), same, message, zp.state_of(b.weight).group_size


@pytest.mark.smoke
def test_gather_coalesces_per_strategy_and_rejects_another_group(dist, world):
    for count, same, message, bsize in run(dist, world, _one_collective_per_group):
        assert same and bsize == max(world // 2, 1)
        assert count == 2  # {a, c} share a strategy (and group), b has its own
        if world == 1:  # the "half" group is the world group itself: no mismatch
            assert message == ""
        else:
            assert "partitioned over ranks" in message and "gather was asked" in message


def _plain_use_errors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    zp.partition(model)
    weight = model[0].weight
    messages = {}
    for what, fn in {
        "linear": lambda: model(torch.randn(2, 6)),
        "data": lambda: weight.data,
        "sum": lambda: weight.sum(),
        "to": lambda: weight.to(torch.float64),
        "pickle": lambda: pickle.dumps(weight),
    }.items():
        try:
            fn()
        except zp.PartitionedParameterError as e:
            messages[what] = str(e)
    handle = zp.gather([weight], async_op=True)
    try:
        F.linear(torch.randn(2, 6), weight)
    except zp.PartitionedParameterError as e:
        messages["inflight"] = str(e)
    handle.wait()
    ok = F.linear(torch.randn(2, 6), weight).shape
    meta = (weight.requires_grad, weight.dtype, weight.is_leaf)
    return messages, tuple(ok), meta


def test_using_a_partitioned_parameter_outside_a_gather_names_it(dist, world):
    for messages, ok, meta in run(dist, world, _plain_use_errors):
        assert set(messages) == {"linear", "data", "sum", "to", "pickle", "inflight"}
        for what in ("linear", "data", "sum", "to"):
            assert "'0.weight'" in messages[what] and "(4, 6)" in messages[what]
            assert "GatheredParameters" in messages[what] and "zero_params.gather" in messages[what]
        assert "torch.nn.functional.linear" in messages["linear"]
        assert "INFLIGHT" in messages["inflight"] and ".wait()" in messages["inflight"]
        assert ok == (2, 4) and meta == (True, torch.float32, True)


def _remote_and_deepcopy():
    import copy

    torch.manual_seed(3)
    lin = nn.Linear(9, 5)
    ref = lin.weight.detach().clone()
    zp.partition(lin, remote_device="cpu", gather_strategy=FlatAllGather(), persistence_threshold=5)
    twin = copy.deepcopy(lin)
    zp.gather([twin.weight, lin.weight, twin.bias], async_op=False)
    same = torch.equal(twin.weight, ref) and torch.equal(lin.weight, ref)
    distinct = zp.state_of(twin.weight) is not zp.state_of(lin.weight)
    return same, distinct, zp.state_of(lin.bias).persistent


def test_deepcopy_copies_the_shard_state(dist, world):
    for same, distinct, persistent_bias in run(dist, world, _remote_and_deepcopy):
        assert same and distinct and persistent_bias


def test_partition_rejects_non_parameters(dist, world):
    msg = run(dist, world, _reject_tensor)[0]
    assert "nn.Parameter" in msg and "Tensor" in msg


def _reject_tensor():
    try:
        zp.partition([torch.zeros(3)])
    except TypeError as e:
        return str(e)
    return ""
