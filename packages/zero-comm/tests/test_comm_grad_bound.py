"""GradientBound: the sideband, the fp32 running sum, reset; and its reduce-scatters, which return
exactly the plain ones' partitions while the bound learns whether any rank's gradients held an
inf or nan (the optimizers' use: zero-optim's tests)."""

from __future__ import annotations

import math

import pytest
import torch
from comm_cases import ODD_SIZES, rank_tensor

from zero_comm import (
    AllToAllReduceScatter,
    BoundedReduceScatter,
    CastReduceScatter,
    GradientBound,
    StagedReduceScatter,
    padded_numel,
    reduce_scatter_coalesced_padded,
    reduce_scatter_in_place,
)


def test_the_sideband_is_the_largest_magnitude_and_propagates_nan():
    bound = GradientBound(3)
    a, b = torch.tensor([1.0, -7.5, 2.0]), torch.tensor([[4.0, 0.5]])
    assert torch.equal(bound.sideband([a, b]), torch.full((3,), 7.5))
    assert torch.equal(bound.sideband([torch.zeros(0)]), torch.zeros(3))
    assert math.isnan(bound.sideband([a, torch.tensor([float("nan")])])[0].item())
    flat = torch.tensor([3.0, -9.0, 1.0, 2.0])
    assert bound.sideband([flat[2:], flat[:2]])[1].item() == 9.0  # regions of one buffer, either order
    assert not bound.nonfinite()  # nothing received yet
    bound.received(torch.tensor([1.0e38], dtype=torch.bfloat16))
    bound.received(torch.tensor([3.0e38]))
    assert bound.nonfinite()  # summed in fp32: 4e38 overflows
    bound.reset()
    bound.received(torch.tensor([2.0]))
    assert not bound.nonfinite()
    with pytest.raises(ValueError, match="needs the bucket's gradients"):
        bound.sideband([])


def test_carried_appends_the_sideband_and_split_takes_it_back():
    bound = GradientBound(2)
    grads = [torch.tensor([1.0, -3.0]), torch.tensor([2.0])]
    sent = bound.carried(grads)
    assert len(sent) == 3 and sent[0] is grads[0] and torch.equal(sent[2], torch.tensor([3.0, 3.0]))
    assert bound.carried([]) == []
    reduced = [torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([float("inf")])]
    assert bound.split(reduced) == reduced[:2] and bound.nonfinite()
    with pytest.raises(ValueError, match="world must be >= 1"):
        GradientBound(0)


def _bounded_equals_plain(rank, poisoned: int | None) -> list[bool]:
    """Each bounded reduce-scatter against the plain one on the same inputs; ``poisoned``: the
    rank whose gradient 1 holds an inf. Returns each bound's ``nonfinite()``."""
    world, flags = rank.world_size, []
    for dtype in (torch.float32, torch.bfloat16):
        grads = [rank_tensor(i, rank.rank, (n,), dtype) for i, n in enumerate(ODD_SIZES)]
        if rank.rank == poisoned:
            grads[1] = grads[1].clone().index_fill_(0, torch.tensor([0]), float("inf"))
        expected = reduce_scatter_coalesced_padded(grads, op="avg")

        for async_op in (False, True):
            bound, plain = GradientBound(world), AllToAllReduceScatter()
            strategy = bound.riding(plain)
            assert bound.riding(plain) is strategy  # made once per strategy
            assert (strategy.group, strategy.group_size, strategy.group_rank) == (None, world, rank.rank)
            got = strategy.reduce_scatter_coalesced(grads, op="avg", async_op=async_op).wait()
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), dtype
            flags.append(bound.nonfinite())

        bound, missing = GradientBound(world), 2  # a gradient never put is reduced (and scanned) as zeros
        staging = StagedReduceScatter([g.numel() for g in grads] + [world], None, dtype, "cpu")
        for i, g in enumerate(grads):
            if i != missing:
                staging.put(i, g.clone())
        got = bound.issue_staged(staging, len(grads), op="avg").wait()
        plain = [torch.zeros_like(g) if i == missing else g for i, g in enumerate(grads)]
        expected_staged = reduce_scatter_coalesced_padded(plain, op="avg")
        assert all(torch.equal(g, e) for g, e in zip(got, expected_staged, strict=True)), dtype
        flags.append(bound.nonfinite())

        live = [g for g in grads if g.numel()]  # the optimizers pass non-empty regions only
        regions = [torch.zeros(padded_numel(g.numel(), world), dtype=dtype) for g in live]
        for region, g in zip(regions, live):
            region[: g.numel()] = g
        plain_regions = [r.clone() for r in regions]
        reduce_scatter_in_place(plain_regions, op="avg")
        bound = GradientBound(world)
        bound.reduce_in_place(regions, None, op="avg").wait()
        assert all(torch.equal(r, e) for r, e in zip(regions, plain_regions, strict=True)), dtype
        flags.append(bound.nonfinite())
    return flags


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bounded_reduce_scatters_return_the_plain_partitions_and_see_an_inf_on_any_rank(dist, world):
    clean = dist.run(world, _bounded_equals_plain, None)
    assert clean == [[False] * 8] * world
    poisoned = dist.run(world, _bounded_equals_plain, world - 1)
    assert poisoned == [[True] * 8] * world  # every rank learns of the last rank's inf


def _refused(rank) -> list[str]:
    messages = []
    for strategy, bound in (
        (CastReduceScatter(torch.bfloat16), GradientBound(2)),
        (AllToAllReduceScatter(), GradientBound(3)),
    ):
        with pytest.raises(ValueError) as info:
            BoundedReduceScatter(strategy, bound, "'layer.weight'")
        messages.append(str(info.value))
    return messages


def test_a_bound_rides_only_on_the_plain_strategy_over_its_own_ranks(dist):
    cast, other_world = dist.run(2, _refused)[0]
    assert cast.startswith("'layer.weight' is reduced by CastReduceScatter over 2 ranks")
    assert (
        "AllToAllReduceScatter over 2 ranks" in other_world
        and "plain AllToAllReduceScatter over 3" in other_world
    )
