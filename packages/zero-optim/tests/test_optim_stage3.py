"""The ZeRO-3 optimizer over zero_params shards, without the coordinator (parameters gathered by hand).

Shards and gradient partitions are views of the flat buffers; a step over the flat
partitions, with gradients reduce-scattered through the bucketed sink, trains to the same
numbers as a torch optimizer over the whole parameters in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_cases import SHAPES, Odd, batch, make_optimizer, micro_step, reference_run
from torch import nn

import zero_coord
import zero_params
from zero_optim import ReduceConfig, stage3_optimizer
from zero_testing import assert_state_close


def _layout(rank, threshold):
    model = Odd()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero_params.partition(model, persistence_threshold=threshold)
    opt, sink = stage3_optimizer(model, make_optimizer("adamw"))
    assert [len(g.segments) for g in opt.groups] == [4, len(SHAPES) - 4 + 2]
    for group in opt.groups:
        assert group.working is group.master and group.master.grad is group.grad
        assert group.numel == sum(zero_params.state_of(s.param).partition_numel for s in group.segments)
        for seg in group.segments:
            state = zero_params.state_of(seg.param)
            assert seg.numel == state.partition_numel
            assert state.shard.untyped_storage().data_ptr() == group.master.untyped_storage().data_ptr()
            assert state.shard.storage_offset() == seg.offset
            assert (
                state.grad_partition.untyped_storage().data_ptr() == group.grad.untyped_storage().data_ptr()
            )
            assert state.grad_partition.storage_offset() == seg.offset
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
    for micro in range(3):
        x = batch(0, micro, world)
        micro_step(model, sink, x[4 * r : 4 * (r + 1)])
        (sum(ref(x[4 * q : 4 * (q + 1)]) for q in range(world)) / world).backward()
    ref_grads = dict(ref.named_parameters())
    for group, seg in opt.segments():
        start, stop = zero_params.state_of(seg.param).shard_range
        got = group.grad_view(seg)
        torch.testing.assert_close(got[: stop - start], ref_grads[seg.name].grad.reshape(-1)[start:stop])
        assert not got[stop - start :].any()
    opt.zero_grad()
    assert all(not group.grad.any() for group in opt.groups)
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
        assert state.grad_partition.untyped_storage().data_ptr() == group.grad.untyped_storage().data_ptr()
        # the 16-bit shard the next gather serves is the updated fp32 master, rounded
        assert torch.equal(state.shard, group.master_view(seg).to(torch.bfloat16))
    return bool(opt.groups[0].grad.any())


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
