"""The ZeRO-3 optimizer over zero_params shards, without the coordinator (parameters gathered by hand).

Shards and gradient partitions are views of the flat buffers; a step over the flat
partitions, with gradients reduce-scattered through the bucketed sink, trains to the same
numbers as a torch optimizer over the whole parameters in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_cases import (
    SHAPES,
    Odd,
    assert_same_results,
    batch,
    flat_state,
    make_optimizer,
    micro_step,
    reference_run,
    step_published,
)
from torch import nn

import zero_coord
import zero_params
from zero_optim import GradLayout, ReduceConfig, stage3_optimizer
from zero_testing import InjectedFailure, assert_state_close, failing_adamw


def _layout(rank, threshold):
    model = Odd()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero_params.partition(model, persistence_threshold=threshold)
    opt, sink = stage3_optimizer(model, make_optimizer("adamw"))
    assert [len(g.segments) for g in opt.groups] == [4, len(SHAPES) - 4 + 2]
    for group in opt.groups:
        assert group.working is group.master and group.master.grad is group.grad
        assert group.numel == sum(zero_params.state_of(s.param).partition_numel for s in group.segments)
        # held in chunks, released until a reduction needs them: no gradient is held or bound yet
        assert group.grad_layout is GradLayout.CHUNKS and group.grads_released
        assert list(group.owned_tensors()) == [group.master]
        for seg in group.segments:
            state = zero_params.state_of(seg.param)
            assert seg.numel == state.partition_numel
            assert state.shard.untyped_storage().data_ptr() == group.master.untyped_storage().data_ptr()
            assert state.shard.storage_offset() == seg.offset
            assert state.grad_partition is None and group.grad_view(seg).numel() == seg.numel
            start, stop = state.shard_range
            expected = values[seg.name].reshape(-1)[start:stop]
            assert torch.equal(group.master_view(seg)[: stop - start], expected)
            assert not group.master_view(seg)[stop - start :].any()  # padding
    assert len(sink.plan) == 1 and sink.plan.ordered == 1
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_and_gradient_partitions_are_views_of_the_flat_buffers(dist, world):
    assert dist.run(world, _layout, 0) == [True] * world
    assert dist.run(world, _layout, 7) == [True] * world


def _train(rank, kind, threshold, steps, accumulate, overlap):
    model = Odd()
    zero_params.partition(model, persistence_threshold=threshold)
    cfg = ReduceConfig(reduce_bucket_size=300, overlap_comm=overlap)
    opt, sink = stage3_optimizer(model, make_optimizer(kind), cfg)
    world, r = rank.world_size, rank.rank
    for step in range(steps):
        for micro in range(accumulate):
            x = batch(step, micro, world)
            micro_step(model, sink, x[4 * r : 4 * (r + 1)])
        opt.step()
        opt.zero_grad()
    whole = {n: p.detach().clone() for n, p in model.named_parameters() if zero_params.state_of(p).persistent}
    params = list(model.parameters())
    with zero_params.GatheredParameters(params):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    return full, whole


def _reference(kind, steps, accumulate, world):
    return reference_run(Odd(), kind, steps, accumulate, world, mean_micro=False)


@pytest.mark.parametrize(
    "world,kind,threshold,accumulate,overlap",
    [(1, "sgd", 0, 1, False), (2, "sgd", 0, 2, True), (2, "adamw", 7, 1, False), (2, "sgd", 7, 3, False)],
)
def test_flat_steps_train_like_the_torch_optimizer_on_whole_parameters(
    dist, world, kind, threshold, accumulate, overlap
):
    results = dist.run(world, _train, kind, threshold, 4, accumulate, overlap)
    ref = _reference(kind, 4, accumulate, world)
    rel = 1e-6 if kind == "sgd" else 1e-5
    for full, whole in results:
        assert_state_close(full, ref, rel=rel)
        for name, value in whole.items():  # persistent: the whole copy follows the updated shards
            assert torch.equal(value, full[name])
    assert sorted(results[0][1]) == (
        ["inner.bias", "ps.0", "ps.1", "ps.2", "ps.6"] if threshold else ["ps.0"]
    )


def _accumulated_partitions(rank):
    model = Odd()
    ref = copy.deepcopy(model)
    zero_params.partition(model)
    opt, sink = stage3_optimizer(model, make_optimizer("sgd"), ReduceConfig(reduce_bucket_size=64))
    world, r = rank.world_size, rank.rank
    ref_grads = dict(ref.named_parameters())
    for window, micros in enumerate((3, 2)):  # the second window starts from released partitions
        for micro in range(micros):
            x = batch(window, micro, world)
            micro_step(model, sink, x[4 * r : 4 * (r + 1)])
            (sum(ref(x[4 * q : 4 * (q + 1)]) for q in range(world)) / world).backward()
        for group, seg in opt.segments():
            start, stop = zero_params.state_of(seg.param).shard_range
            got = group.grad_view(seg)
            assert zero_params.state_of(seg.param).grad_partition is got  # what the reductions added into
            torch.testing.assert_close(got[: stop - start], ref_grads[seg.name].grad.reshape(-1)[start:stop])
            assert not got[stop - start :].any()
        opt.zero_grad()
        ref.zero_grad()
        # released: no gradient tensor is held (the master is all a group owns), none is bound
        assert all(g.grads_released and list(g.owned_tensors()) == [g.master] for g in opt.groups)
        assert all(zero_params.state_of(seg.param).grad_partition is None for _, seg in opt.segments())
    assert all(not grad.any() for group in opt.groups for grad in group.grads())  # reads as zeros
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_micro_steps_accumulate_averaged_gradients_into_the_flat_partition(dist, world):
    assert dist.run(world, _accumulated_partitions) == [True] * world


class WithLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        self.b = nn.Linear(3, 3)


def _leaf_plan():
    model = WithLeaf()
    zero_coord.set_leaf_modules(model, ["block"])
    zero_params.partition(model)
    _, sink = stage3_optimizer(model, None, ReduceConfig(reduce_bucket_size=10**6))
    plan = sink.plan
    return [sorted(plan.names[id(p)] for p in bucket) for bucket in plan.buckets], plan.ordered


def test_leaf_module_parameters_are_deferred_to_the_end_of_backward(dist):
    (buckets, ordered) = dist.run(1, _leaf_plan)[0]
    assert ordered == 1
    assert buckets == [
        ["a.bias", "a.weight", "b.bias", "b.weight"],
        ["block.0.bias", "block.0.weight", "block.1.bias", "block.1.weight"],
    ]


def _bf16_working_shards(rank):
    model = Odd().to(torch.bfloat16)
    zero_params.partition(model)
    opt, sink = stage3_optimizer(model, make_optimizer("sgd"), working_dtype=torch.bfloat16)
    x = batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)].to(torch.bfloat16)
    micro_step(model, sink, x)
    opt.step()
    for group, seg in opt.segments():
        state = zero_params.state_of(seg.param)
        assert group.master.dtype == torch.float32 and group.grad.dtype == torch.float32
        assert state.shard.dtype == torch.bfloat16
        assert state.shard.untyped_storage().data_ptr() == group.working.untyped_storage().data_ptr()
        assert state.grad_partition is group.grad_view(seg)
        # the 16-bit shard the next gather serves is the updated fp32 master, rounded
        assert torch.equal(state.shard, group.master_view(seg).to(torch.bfloat16))
    return any(bool(g.any()) for g in opt.groups[0].grads())


def test_a_16_bit_working_buffer_holds_the_shards_and_follows_the_fp32_master(dist):
    assert dist.run(2, _bf16_working_shards) == [True, True]


def _refusals():
    messages = []
    model = nn.Linear(3, 3)
    with pytest.raises(TypeError, match="not partitioned") as info:
        stage3_optimizer(model, None)
    messages.append(str(info.value))
    model = nn.Linear(3, 3).double()
    zero_params.partition(model)
    with pytest.raises(
        ValueError, match=r"'weight' is torch.float64, but training runs in torch.float32"
    ) as info:
        stage3_optimizer(model, None)
    messages.append(str(info.value))
    return messages


def test_unpartitioned_or_non_fp32_parameters_are_refused(dist):
    assert len(dist.run(1, _refusals)[0]) == 2


def _reduce_ops(rank):
    """aten ops per step under the gradient path's zero ranges (innermost ``zero.*`` range)."""
    model = Odd()
    zero_params.partition(model)
    opt, sink = stage3_optimizer(model, make_optimizer("adamw"), ReduceConfig(reduce_bucket_size=10**6))
    x = batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]
    micro_step(model, sink, x)  # warm-up: partitions allocated, optimizer state created
    opt.step()
    opt.zero_grad()
    with torch.profiler.profile() as prof:
        micro_step(model, sink, x)
    found = {}
    for e in prof.events():
        node = e.cpu_parent
        while node is not None and not node.name.startswith("zero."):
            node = node.cpu_parent
        if node is not None and e.name.startswith("aten::"):
            found.setdefault(node.name, []).append(e.name)
    return found, len(opt.groups)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_bucket_adds_its_reduced_partitions_with_one_add_per_flat_group(dist, world):
    """The bucket runs in reverse registration order, the flat gradients in registration order:
    the reduce-scatter is issued in the order whose gradient partitions lie back to back, and
    the reduced partitions are added with one ``add_`` per flat group, not one per parameter."""
    for found, groups in dist.run(world, _reduce_ops):
        assert groups == 2
        assert found["zero.params.reduce_scatter_grads.wait"].count("aten::add_") == groups, found


def _stepped(rank, published: bool, dtype: torch.dtype, sub_group: int) -> dict:
    """Four steps of threshold-7 stage 3 (persistent parameters in both groups), one gathered parameter.

    ``published``: ``opt.step()`` (the refresh of the persistent parameters issued while the
    rest is stepped); else the stepper, then :meth:`publish_updated_shards` (the reference).
    ``ps.5`` is gathered (not persistent) across every step: the step must refresh it too.
    """
    model = Odd().to(dtype)
    zero_params.partition(model, persistence_threshold=7)
    opt, sink = stage3_optimizer(
        model, make_optimizer("adamw"), working_dtype=dtype, sub_group_size=sub_group
    )
    world, r = rank.world_size, rank.rank
    held = model.ps[5]
    for step in range(4):
        micro_step(model, sink, batch(step, 0, world)[4 * r : 4 * (r + 1)].to(dtype))
        zero_params.gather(held).wait()
        step_published(opt, published)
        opt.zero_grad()
        assert torch.equal(held.detach().reshape(-1), _whole_from_shards(held))
        zero_params.release(held)
    whole = {n: p.detach().clone() for n, p in model.named_parameters() if zero_params.state_of(p).persistent}
    return {"whole": whole, **flat_state(opt)}


def _whole_from_shards(param: nn.Parameter) -> torch.Tensor:
    """The parameter's value assembled from every rank's shard (a plain all-gather)."""
    state = zero_params.state_of(param)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rows = [torch.empty_like(state.shard) for _ in range(world)]
    if world > 1:
        torch.distributed.all_gather(rows, state.shard.contiguous())
    else:
        rows = [state.shard]
    return torch.cat(rows)[: state.numel]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "dtype,sub_group", [(torch.float32, 10**9), (torch.float32, 37), (torch.bfloat16, 53)]
)
def test_refreshing_persistent_parameters_during_the_step_is_bit_identical_to_after_it(
    dist, world, dtype, sub_group
):
    """Whole persistent parameters, masters and AdamW moments equal bit for bit on every rank."""
    during = dist.run(world, _stepped, True, dtype, sub_group)
    after = dist.run(world, _stepped, False, dtype, sub_group)
    assert all(sorted(a["whole"]) == ["inner.bias", "ps.0", "ps.1", "ps.2", "ps.6"] for a in during)
    assert_same_results(during, after, ("whole",))


def _step_events(rank) -> tuple[list[str], list[list[int]], list[int]]:
    """The order of stepped ranges and refreshes in one step, the refresh's cuts, the group sizes."""
    model = Odd()
    zero_params.partition(model, persistence_threshold=7)
    opt, sink = stage3_optimizer(model, make_optimizer("adamw"))
    micro_step(model, sink, batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)])
    publisher = opt.partitioning.step_publisher(opt.groups)
    assert publisher is not None
    with torch.profiler.profile() as prof:
        opt.step()
    wanted = ("zero.optim.sub_group_step", "zero.params.commit_shards")
    events = sorted((e for e in prof.events() if e.name in wanted), key=lambda e: e.time_range.start)
    return [e.name for e in events], publisher.cuts, [g.numel for g in opt.groups]


@pytest.mark.parametrize("world", [1, 2])
def test_the_persistent_refresh_is_issued_before_the_rest_is_stepped(dist, world):
    """Persistent parameters lie first in each flat group; their refresh is issued as soon as
    they are stepped (one range per group ends there), then the group's other shards are stepped."""
    for events, cuts, numels in dist.run(world, _step_events):
        ends = [c[0] for c in cuts]
        assert len(ends) == 2 and all(0 < e < n for e, n in zip(ends, numels)), (cuts, numels)
        # group 0: range, refresh, range; group 1: the same; finish: the others' commit
        assert events == [
            "zero.optim.sub_group_step",
            "zero.params.commit_shards",
            "zero.optim.sub_group_step",
            "zero.optim.sub_group_step",
            "zero.params.commit_shards",
            "zero.optim.sub_group_step",
            "zero.params.commit_shards",
        ], events


def _plans(rank):
    model = Odd()
    zero_params.partition(model, persistence_threshold=7)
    opt, _ = stage3_optimizer(model, make_optimizer("adamw"))
    first = opt.partitioning.step_publisher(opt.groups)
    again = opt.partitioning.step_publisher(list(opt.groups))
    plan = first.plan
    persistent = [[zero_params.state_of(p).persistent for p in ps] for ps in plan.persistent]
    return (
        again.plan is plan,  # made once for the same groups, not every step
        persistent,
        [zero_params.state_of(p).persistent for p in plan.rest],
        [list(names) for names in plan.names],
        [sum(zero_params.state_of(p).partition_numel for p in ps) for ps in plan.persistent]
        == list(plan.ends),
    )


def test_the_refresh_plan_is_made_once_and_splits_persistent_from_gathered(dist):
    same, persistent, rest, names, ends = dist.run(2, _plans)[0]
    assert same and ends
    assert all(all(flags) for flags in persistent) and not any(rest)
    assert names == [["ps.0", "ps.1", "ps.2"], ["ps.6", "inner.bias"]]


def _failed_step(rank):
    """The optimizer raises right after the first group's persistent refresh was issued."""
    model = Odd()
    zero_params.partition(model, persistence_threshold=7)
    fail_at = [2]  # range 1: group 0's persistent parameters (their refresh issued), range 2: the rest
    opt, sink = stage3_optimizer(model, failing_adamw(fail_at))
    x = batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]
    micro_step(model, sink, x)
    refreshed = opt.partitioning.step_publisher(opt.groups).plan.persistent[0]
    with pytest.raises(InjectedFailure):
        opt.step()
    # The refresh issued before the failure was waited for: the whole values are the stepped shards.
    first = [torch.equal(p.detach().reshape(-1), _whole_from_shards(p)) for p in refreshed]
    fail_at[0] = 0
    opt.zero_grad()
    micro_step(model, sink, x)
    opt.step()  # the collectives of a full step still line up on every rank
    persistent = [p for p in model.parameters() if zero_params.state_of(p).persistent]
    after = [torch.equal(p.detach().reshape(-1), _whole_from_shards(p)) for p in persistent]
    return len(refreshed), first, after


@pytest.mark.parametrize("world", [1, 2])
def test_an_optimizer_failure_mid_step_leaves_no_refresh_in_flight(dist, world):
    for n, first, after in dist.run(world, _failed_step):
        assert n == 5 and all(first), first  # one flat group: every persistent parameter
        assert len(after) == 5 and all(after), after
