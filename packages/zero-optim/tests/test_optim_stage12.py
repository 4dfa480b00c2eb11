"""Stages 0, 1 and 2 on the partitioned-optimizer core: whole parameters, partitioned fp32 state.

Each rank trains on its slice of the batch with ``replicated_optimizer``; after every
step all ranks hold the same whole parameters, equal to a torch optimizer stepping the
whole model on the whole batch in one process. The flat layout (per-parameter partitions,
padding to the world size) is the stage-3 one, so state dicts are stage-independent.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_cases import Odd, batch, make_optimizer, reference_run

import zero_comm
import zero_params
from zero_optim import (
    BackwardReduction,
    BoundaryReduction,
    HookedReduction,
    ReduceConfig,
    ReplicaPartitioning,
    replicated_optimizer,
    stage3_optimizer,
)
from zero_testing import InjectedFailure, assert_state_close, failing_adamw


def _train(rank, stage, kind, steps, accumulate, bucket, overlap):
    model = Odd(unused=True)
    cfg = ReduceConfig(reduce_bucket_size=bucket, overlap_comm=overlap)
    opt, reduction = replicated_optimizer(
        model,
        make_optimizer(kind),
        stage,
        cfg,
        allgather_bucket_size=bucket,
        sub_group_size=max(bucket // 7, 1),
    )
    world, r = rank.world_size, rank.rank
    for step in range(steps):
        for micro in range(accumulate):
            x = batch(step, micro, world)
            (model(x[4 * r : 4 * (r + 1)]) / accumulate).backward()
            if stage == 2:  # gradients were reduced during backward and freed
                assert all(p.grad is None for p in model.parameters())
        reduction.at_boundary()
        if stage != 1:  # stage 1 (fp32) keeps .grad bound to its flat buffer, reduced in place
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    reduction.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(kind, steps, accumulate, world):
    return reference_run(Odd(unused=True), kind, steps, accumulate, world, mean_micro=True)


CASES = [
    (1, 1, "sgd", 1, 10**6, False),
    (2, 0, "sgd", 2, 300, False),
    (2, 1, "sgd", 2, 300, False),
    (2, 2, "sgd", 3, 300, True),
    (2, 2, "adamw", 1, 10**6, False),
    (4, 0, "adamw", 2, 64, False),
    (4, 1, "adamw", 1, 64, False),
    (4, 2, "sgd", 2, 64, False),
]


@pytest.mark.parametrize("world,stage,kind,accumulate,bucket,overlap", CASES)
def test_stages_0_1_2_train_like_the_torch_optimizer_on_the_whole_batch(
    dist, world, stage, kind, accumulate, bucket, overlap
):
    results = dist.run(world, _train, stage, kind, 3, accumulate, bucket, overlap)
    ref = _reference(kind, 3, accumulate, world)
    rel = 1e-6 if kind == "sgd" else 1e-5
    for r, full in enumerate(results):
        assert_state_close(full, ref, rel=rel)
        for n, p in full.items():
            assert torch.equal(p, results[0][n]), f"rank {r} holds another {n} than rank 0"


def _layout(rank, stage):
    model = Odd(unused=True)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, reduction = replicated_optimizer(model, make_optimizer("adamw"), stage)
    world = 1 if stage == 0 else rank.world_size
    r = 0 if stage == 0 else rank.rank
    for group, seg in opt.segments():
        part = zero_comm.partition_numel(seg.param.numel(), world)
        assert seg.numel == part
        flat = values[seg.name].reshape(-1)
        start = min(r * part, flat.numel())
        stop = min(start + part, flat.numel())
        assert torch.equal(group.master_view(seg)[: stop - start], flat[start:stop])
        assert not group.master_view(seg)[stop - start :].any()
        assert seg.param.shape == values[seg.name].shape  # parameters stay whole
    kind = {0: BoundaryReduction, 1: BackwardReduction, 2: HookedReduction}[stage]
    assert isinstance(reduction, kind)
    reduction.remove()
    return opt.state_dict()["layout"]


def _stage3_layout(rank, persistent_first=True):
    model = Odd(unused=True)
    zero_params.partition(model, persistence_threshold=7)
    opt, _ = stage3_optimizer(model, make_optimizer("adamw"))
    layout = opt.state_dict()["layout"]
    if persistent_first:
        return layout
    # back to the model's order: the same segments as stages 0-2
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return [sorted(group, key=lambda seg: order[seg[0]]) for group in layout]


def _persistent_first(layout, persistent):
    return [[s for s in g if s[0] in persistent] + [s for s in g if s[0] not in persistent] for g in layout]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_flat_layout_and_state_dict_layout_are_those_of_stage_3(dist, world):
    """Every stage splits each parameter alike; stage 3 lays its persistent parameters out first."""
    s1 = dist.run(world, _layout, 1)
    s2 = dist.run(world, _layout, 2)
    assert s1 == s2 == dist.run(world, _stage3_layout, False)
    # parameters of at most 7 elements stay whole at stage 3 (persistent): their segments move to the front
    s3 = dist.run(world, _stage3_layout)
    persistent = {"ps.0", "ps.1", "ps.2", "ps.6", "inner.bias", "unused.weight", "unused.bias"}
    assert s3 == [_persistent_first(layout, persistent) for layout in s1] != s1
    s0 = dist.run(world, _layout, 0)
    assert s0 == dist.run(1, _stage3_layout, False) * world  # stage 0: a one-rank partition world


def _state_dict_round_trip(rank, stage):
    model = Odd(unused=True)
    opt, reduction = replicated_optimizer(model, make_optimizer("adamw"), stage)
    x = batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]
    model(x).backward()
    reduction.at_boundary()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = Odd(unused=True)
    opt2, red2 = replicated_optimizer(fresh, make_optimizer("adamw"), 3 - stage)  # stage 1 <-> stage 2
    opt2.load_state_dict(saved)  # all-gathers the loaded partitions into the whole parameters
    reduction.remove()
    red2.remove()
    return all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters())


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.smoke
def test_a_stage_1_state_dict_loads_into_stage_2_and_back(dist, stage):
    assert dist.run(2, _state_dict_round_trip, stage) == [True, True]


def _bf16(rank, stage):
    model = Odd(unused=True).to(torch.bfloat16)
    opt, reduction = replicated_optimizer(model, make_optimizer("sgd"), stage, working_dtype=torch.bfloat16)
    x = batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)].to(torch.bfloat16)
    model(x).backward()
    reduction.at_boundary()
    assert all(g.grad.dtype == torch.float32 and g.master.dtype == torch.float32 for g in opt.groups)
    assert any(g.grad.any() for g in opt.groups)
    opt.step()
    reduction.remove()
    part = opt.partitioning
    for group, seg in opt.segments():
        assert seg.param.dtype == torch.bfloat16
        n = seg.param.numel()
        start = min(part.rank * seg.numel, n)
        stop = min(start + seg.numel, n)
        # the whole bf16 parameter holds the updated fp32 master, rounded, at this rank's partition
        expected = group.master_view(seg)[: stop - start].to(torch.bfloat16)
        assert torch.equal(seg.param.detach().reshape(-1)[start:stop], expected)
    return True


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_parameters_follow_the_fp32_master(dist, stage):
    assert dist.run(2, _bf16, stage) == [True, True]


def _hooks_removed(rank):
    model = Odd(unused=True)
    _, reduction = replicated_optimizer(model, make_optimizer("sgd"), 2)
    reduction.remove()
    model(batch(0, 0, 1)).backward()
    return all(p.grad is not None for p in model.ps)  # no hook took the gradients away


def test_stage_2_hooks_are_removable(dist):
    assert dist.run(2, _hooks_removed) == [True, True]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="stages 0, 1 and 2"):
        replicated_optimizer(Odd(unused=True), None, 3)
    with pytest.raises(ValueError, match=r"'ps.0' is torch.float64, but training runs in torch.float32"):
        replicated_optimizer(Odd(unused=True).double(), None, 1)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        ReplicaPartitioning(2, 2)


def _kernels(rank, stage):
    """Kernel names per zero range in a second step, its ``zero_grad`` first: ``{range: [(op, parent op)]}``.

    One bucket.
    """
    model = Odd()
    cfg = ReduceConfig(reduce_bucket_size=10**6)
    opt, reduction = replicated_optimizer(
        model, make_optimizer("adamw"), stage, cfg, allgather_bucket_size=10**6
    )
    x = batch(0, 0, rank.world_size)
    model(x[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
    reduction.at_boundary()
    opt.step()
    with torch.profiler.profile() as prof:
        opt.zero_grad()
        model(x[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
        reduction.at_boundary()
        opt.step()
    reduction.remove()
    found = {}
    for e in prof.events():
        chain, node = [], e.cpu_parent
        while node is not None:
            chain.append(node.name)
            node = node.cpu_parent
        zero = next((n for n in chain if n.startswith("zero.optim.")), None)
        if (
            zero is not None
            and e.name.startswith("aten::")
            and not any(n.startswith("zero.reduce_scatter.") for n in chain)
        ):
            found.setdefault(zero, []).append((e.name, chain[0]))
    return found, len(opt.groups)


@pytest.mark.parametrize("world", [2, 4])
def test_a_bucket_is_finished_with_one_call_per_kernel_not_one_per_parameter(dist, world):
    """One call per kernel for a bucket, not one per parameter.

    Stage 2 adds its reduced partitions with one add_ per flat group; stage 1 zeroes nothing
    (``zero_grad`` releases its gradients, each is copied once into its region and the
    reduced rows are summed where they lie), and both refresh the whole parameters from the
    gathered rows with one fused copy (the last rank: its own rows are in place already, the
    others lie before them in one block).
    """
    for stage in (1, 2):
        found, groups = dist.run(world, _kernels, stage)[world - 1]
        assert groups == 2  # one run of adjacent gradient partitions per flat group
        # stage 1 waits for its (async) bucket at the boundary, stage 2 in the reduction call
        pairs = found.get("zero.optim.reduce_scatter_grads", []) + found.get(
            "zero.optim.reduce_at_boundary", []
        )
        reduce = [op for op, _ in pairs]
        if stage == 2:
            assert reduce.count("aten::add_") == groups, reduce
        else:
            zeroing = [(r, op, p) for r, ops in found.items() for op, p in ops if "zero_" in op]
            assert not zeroing, zeroing
            # the reduced rows are summed where they lie: nothing is copied back into the regions
            assert "aten::split_with_sizes_copy" not in reduce and "aten::copy_" not in reduce, reduce
            # each released gradient is copied into its region once, as autograd hands it over
            # (an empty one has nothing to copy)
            copies = [op for op, _ in found["zero.optim.accumulate_grad"] if op == "aten::copy_"]
            assert len(copies) == sum(1 for p in Odd().parameters() if p.numel()), found
        gather = found["zero.optim.allgather_params"]
        assert [op for op, _ in gather].count("aten::split_with_sizes_copy") == 1, gather
        assert all(p == "aten::split_with_sizes_copy" for op, p in gather if op == "aten::copy_"), gather


def _grads_held_until_their_bucket(rank):
    model = Odd()
    # one bucket for the whole model: before staging, every gradient waited in .grad for the last one
    _, reduction = replicated_optimizer(
        model, make_optimizer("sgd"), 2, ReduceConfig(reduce_bucket_size=10**6)
    )
    held = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: held.append(n) if p.grad is not None else None)
    model(batch(0, 0, rank.world_size)).backward()
    reduction.remove()
    return held


@pytest.mark.parametrize("world", [2, 4])
def test_stage_2_stages_each_gradient_on_arrival_and_frees_it(dist, world):
    """Contiguous gradients: a bucket holds one staging buffer, not its parameters' whole gradients."""
    assert dist.run(world, _grads_held_until_their_bucket) == [[]] * world


def _train_stage1(rank, kind, steps, accumulate, bucket, inflight, after_backward):
    """Stage 1 driven like the engine; ``after_backward``: the old boundary reduction instead."""
    model = Odd(unused=True)
    cfg = ReduceConfig(reduce_bucket_size=bucket, max_inflight=inflight)
    opt, reduction = replicated_optimizer(model, make_optimizer(kind), 1, cfg, allgather_bucket_size=bucket)
    assert isinstance(reduction, BackwardReduction)
    if after_backward:
        reduction.remove()
        reduction = BoundaryReduction(reduction.plan, reduction.reduce_fn, reduction.max_inflight)
    world, r = rank.world_size, rank.rank
    losses, grads = [], []
    for step in range(steps):
        for micro in range(accumulate):
            reduction.begin_micro_step(micro == accumulate - 1)
            x = batch(step, micro, world)[4 * r : 4 * (r + 1)]
            (model(x) / accumulate).backward()  # nan: Odd's empty parameter has a nan mean
            with torch.no_grad():  # a finite loss of the parameters this step trains from
                losses.append(model.inner(x[:, :5]).pow(2).mean())
        reduction.at_boundary()
        grads.append([g.clone() for group in opt.groups for g in group.grads()])
        opt.step()
        opt.zero_grad()
    reduction.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads, losses


@pytest.mark.parametrize(
    "world,kind,accumulate,bucket,inflight",
    [
        (1, "adamw", 3, 64, 1),
        (2, "sgd", 1, 300, 1),
        (2, "adamw", 3, 64, 2),
        (4, "adamw", 1, 64, 1),
        (4, "sgd", 3, 300, 1),
    ],
)
def test_stage_1_reducing_during_backward_is_bit_identical_to_reducing_after_it(
    dist, world, kind, accumulate, bucket, inflight
):
    during = dist.run(world, _train_stage1, kind, 3, accumulate, bucket, inflight, False)
    after = dist.run(world, _train_stage1, kind, 3, accumulate, bucket, inflight, True)
    ref = _reference(kind, 3, accumulate, world)
    for (params, grads, losses), (params_b, grads_b, losses_b) in zip(during, after, strict=True):
        assert all(torch.equal(params[n], params_b[n]) for n in params)
        assert all(torch.equal(a, b) for ga, gb in zip(grads, grads_b, strict=True) for a, b in zip(ga, gb))
        assert all(torch.equal(a, b) for a, b in zip(losses, losses_b, strict=True))
        assert_state_close(params, ref, rel=1e-6 if kind == "sgd" else 1e-5)


def _issued_before_backward_ends(rank, engine):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    _, reduction = replicated_optimizer(model, make_optimizer("sgd"), 1, ReduceConfig(reduce_bucket_size=10))
    # the first layer's weight is the last gradient of backward: mark it after the reduction's hook
    model[0].weight.register_post_accumulate_grad_hook(
        lambda _: torch.profiler.record_function("test.last")(lambda: None)()
    )
    issued = {}
    for boundary in (False, True):
        if engine:
            reduction.begin_micro_step(boundary)
        elif not boundary:
            continue
        with torch.profiler.profile() as prof:
            model(batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).sum().backward()
        names = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start)]
        last = names.index("test.last")
        issued[boundary] = names[:last].count("zero.optim.reduce_scatter_grads")
        reduction.at_boundary()
    reduction.remove()
    return issued


@pytest.mark.parametrize("world", [2, 4])
def test_stage_1_issues_its_first_buckets_before_backward_ends(dist, world):
    """Buckets of the last layers go out while backward still computes the first layer's gradients."""
    for issued in dist.run(world, _issued_before_backward_ends, True):
        assert issued[False] == 0  # a micro-step inside the window only accumulates
        assert issued[True] >= 4, issued  # one bucket per parameter of the last two layers
    for issued in dist.run(world, _issued_before_backward_ends, False):  # plain backward: a boundary
        assert issued[True] >= 4, issued


def _released_step(rank, stage):
    """A step after ``zero_grad`` with no backward and no reduction: the gradients it applies."""
    model = Odd()
    opt, reduction = replicated_optimizer(
        model, make_optimizer("adamw"), stage, ReduceConfig(reduce_bucket_size=64)
    )
    model(batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
    reduction.at_boundary()
    opt.step()
    opt.zero_grad()
    opt.step()  # nothing reduced since zero_grad: every gradient is zero
    reduction.remove()
    grads = [g.clone() for group in opt.groups for g in group.grads()]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads


@pytest.mark.parametrize("world", [2, 3])
def test_stage_1_steps_on_zero_gradients_after_zero_grad_as_stage_2_does(dist, world):
    """Stage 1's ``zero_grad`` only releases its gradients; a step with nothing reduced since sees zeros."""
    for (one, grads), (two, _) in zip(dist.run(world, _released_step, 1), dist.run(world, _released_step, 2)):
        assert all(not g.any() for g in grads)
        assert all(torch.equal(one[n], two[n]) for n in one)


def _grads_live_in_the_buffer(rank):
    """After each deferred micro-step: whether every ``.grad`` is a view of the in-place buffer."""
    model = Odd(unused=True)
    opt, reduction = replicated_optimizer(
        model, make_optimizer("sgd"), 1, ReduceConfig(reduce_bucket_size=64)
    )
    storage = opt.partitioning.grads.partition(model.inner.weight).untyped_storage().data_ptr()
    trained = [
        p
        for p in model.parameters()
        if p.numel() and p is not model.unused.weight and p is not model.unused.bias
    ]
    seen = []
    for step in range(2):
        for micro in range(2):
            reduction.begin_micro_step(micro == 1)
            model(batch(step, micro, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
            seen.append(all(p.grad.untyped_storage().data_ptr() == storage for p in trained))
        reduction.at_boundary()
        opt.step()
        opt.zero_grad()
        seen.append(all(p.grad is None for p in model.parameters()))
    reduction.remove()
    return seen


def test_stage_1_moves_each_new_gradient_into_its_region_at_once(dist):
    """No whole gradient outlives its own accumulation outside the buffer, even in deferred micro-steps."""
    assert dist.run(2, _grads_live_in_the_buffer) == [[True] * 6] * 2


def _saved_view_assigned_back(rank, reassign):
    """Two steps; with ``reassign`` the ``.grad`` views saved before ``zero_grad`` are set back after it."""
    model = Odd()
    opt, reduction = replicated_optimizer(
        model, make_optimizer("sgd"), 1, ReduceConfig(reduce_bucket_size=64)
    )
    for step in range(2):
        model(batch(step, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]).backward()
        reduction.at_boundary()
        opt.step()
        saved = [p.grad for p in model.parameters()]  # bound views, holding stale rows from here on
        opt.zero_grad()
        if reassign:
            for p, g in zip(model.parameters(), saved, strict=True):
                p.grad = g
    reduction.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_a_gradient_view_assigned_back_after_zero_grad_accumulates_from_zero(dist, world):
    """Autograd adds to the ``.grad`` it finds: a view of the released buffer set back starts at zero."""
    plain = dist.run(world, _saved_view_assigned_back, False)
    back = dist.run(world, _saved_view_assigned_back, True)
    for a, b in zip(plain, back, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)


def _failed_publish(rank, stage):
    """The optimizer raises on its second range, after the first all-gather bucket was issued."""
    fail_at = [2]
    model = Odd()
    opt, reduction = replicated_optimizer(
        model,
        failing_adamw(fail_at),
        stage,
        ReduceConfig(reduce_bucket_size=64),
        allgather_bucket_size=64,
    )
    x = batch(0, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)]
    model(x).backward()
    reduction.at_boundary()
    first = opt.partitioning.step_publisher(opt.groups).buckets[0]
    before = [p.detach().clone() for p, _ in first.items]
    with pytest.raises(InjectedFailure):
        opt.step()
    # The gather issued before the failure was waited for: its parameters show the stepped values.
    published = [_whole(part, p) for p, part in first.items]
    moved = [
        not torch.equal(b, p.detach()) and torch.equal(p.detach(), w)
        for b, (p, _), w in zip(before, first.items, published)
        if p.numel()
    ]
    fail_at[0] = 0
    opt.zero_grad()
    model(x).backward()
    reduction.at_boundary()
    opt.step()  # a full step afterwards: its collectives line up on every rank
    reduction.remove()
    return moved


def _whole(part: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s whole value assembled from every rank's working partition."""
    rows = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(rows, part.contiguous())
    return torch.cat(rows)[: param.numel()].view_as(param)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_failure_mid_step_leaves_no_gather_in_flight(dist, stage):
    for moved in dist.run(2, _failed_publish, stage):
        assert len(moved) == 3 and all(moved), moved


def _moved_out(rank, stage, move):
    model = Odd(unused=True)
    opt, reduction = replicated_optimizer(
        model, make_optimizer("sgd"), stage, ReduceConfig(reduce_bucket_size=300), allgather_bucket_size=300
    )
    world, r = rank.world_size, rank.rank
    for step in range(3):
        if step == move:  # after a step: the gather's plan for this bucket exists already
            for p in model.parameters():
                p.data = p.data.clone()
        x = batch(step, 0, world)
        model(x[4 * r : 4 * (r + 1)]).backward()
        reduction.at_boundary()
        opt.step()
        opt.zero_grad()
    reduction.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_moved_out_of_the_flat_buffer_still_receive_the_gathered_step(dist, stage):
    """The gathers' plans are reused step after step, but not once a parameter's storage moved."""
    stay = dist.run(2, _moved_out, stage, -1)
    moved = dist.run(2, _moved_out, stage, 2)
    for a, b in zip(moved, stay):
        for name, value in b.items():
            assert torch.equal(a[name], value), name


def _native_vs_exchange(rank, stage, dtype):
    """Stages 1-2 with the backend's reduce_scatter_tensor (as chosen on NCCL) or the exchange."""
    trained = []
    for strategy in (zero_comm.NativeReduceScatter(), None):
        model = Odd(unused=True).to(dtype)
        opt, reduction = replicated_optimizer(
            model, make_optimizer("adamw"), stage, working_dtype=dtype, reduce_strategy=strategy
        )
        for step in range(3):
            x = batch(step, 0, rank.world_size)[4 * rank.rank : 4 * (rank.rank + 1)].to(dtype)
            model(x).backward()
            reduction.at_boundary()
            opt.step()
            opt.zero_grad()
        reduction.remove()
        trained.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return all(torch.equal(trained[0][n], trained[1][n]) for n in trained[1])


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_native_reduce_scatter_trains_bit_identically_at_world_2(dist, stage, dtype):
    assert dist.run(2, _native_vs_exchange, stage, dtype) == [True, True]


def _stage0_fp32_reduction(rank, wide):
    """bf16 gradients of stage 0 averaged in fp32: exactly the fp32 average of every rank's bf16 gradient."""
    model = Odd(unused=True).to(torch.bfloat16)
    strategy = zero_comm.CastAllReduce(torch.float32) if wide else None
    opt, reduction = replicated_optimizer(
        model, make_optimizer("sgd"), 0, working_dtype=torch.bfloat16, all_reduce_strategy=strategy
    )
    world = rank.world_size
    x = batch(0, 0, world)
    model(x[4 * rank.rank : 4 * (rank.rank + 1)].to(torch.bfloat16)).backward()
    reduction.at_boundary()
    reduction.remove()
    # the reference: one process, each rank's bf16 gradient from its slice, summed in fp32 in rank order
    ref_model = Odd(unused=True).to(torch.bfloat16)
    per_rank = []
    for r in range(world):
        ref_model.zero_grad(set_to_none=True)
        ref_model(x[4 * r : 4 * (r + 1)].to(torch.bfloat16)).backward()
        per_rank.append(
            {
                n: (p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                for n, p in ref_model.named_parameters()
            }
        )
    exact = 0
    for group, seg in opt.segments():
        expected = per_rank[0][seg.name].clone()
        for grads in per_rank[1:]:
            expected += grads[seg.name]
        expected = expected.div_(world).reshape(-1)
        got = group.grad[seg.offset : seg.offset + seg.numel][: expected.numel()]
        exact += int(torch.equal(got, expected))
    return exact, len(list(opt.segments()))


@pytest.mark.parametrize("world", [2, 3])
def test_stage_0_reduces_bf16_gradients_in_fp32_when_asked(dist, world):
    wide = dist.run(world, _stage0_fp32_reduction, True)
    assert all(exact == total for exact, total in wide), wide
    plain = dist.run(world, _stage0_fp32_reduction, False)  # summed in bf16, rounded to bf16
    assert all(exact < total for exact, total in plain), plain
