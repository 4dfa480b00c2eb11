"""The pool reports results, failures and hangs the way tests rely on."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist_

from zero_comm.torch_compat import all_gather_single
from zero_testing import (
    RankFailure,
    RankTimeout,
    assert_losses_close,
    assert_tensors_close,
    measure_wire_bytes,
)


def _sum_of_ranks(rank):
    t = torch.tensor([float(rank.rank)])
    dist_.all_reduce(t)
    return (rank.rank, rank.local_rank, rank.node, t.item())


def _fail_on_rank_one(rank):
    if rank.rank == 1:
        raise ValueError("boom on purpose")
    return rank.rank


def _hang_on_rank_zero(rank):
    if rank.rank == 0:
        t = torch.zeros(1)
        dist_.all_reduce(t)  # rank 1 never joins
    return rank.rank


def _wire_bytes_of_all_gather():
    world = dist_.get_world_size()
    shard = torch.ones(250_000)
    out = torch.empty(world * shard.numel())
    with measure_wire_bytes() as w:
        all_gather_single(out, shard)
    return w.written


@pytest.mark.parametrize("world,per_node", [(1, 1), (2, 2), (4, 2)])
def test_results_come_back_in_rank_order(dist, world, per_node):
    results = dist.run(world, _sum_of_ranks, ranks_per_node=per_node)
    total = sum(range(world))
    assert results == [(r, r % per_node, r // per_node, float(total)) for r in range(world)]


def _pid(rank):
    return os.getpid()


def test_the_worlds_of_the_suites_keep_their_pools_between_calls(dist):
    # a world-parametrized test calls 1, 2, 4, 1, 2, 4, ...: each pool must be started only once
    worlds = [(1, 1), (2, 2), (4, 4), (4, 2)]
    first = [dist.run(w, _pid, ranks_per_node=n) for w, n in worlds]
    again = [dist.run(w, _pid, ranks_per_node=n) for w, n in worlds]
    assert again == first


@pytest.mark.smoke
def test_a_failing_rank_is_named_and_the_pool_recovers(dist):
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\][\s\S]*boom on purpose"):
        dist.run(2, _fail_on_rank_one)
    assert dist.run(2, _sum_of_ranks)[1][3] == 1.0


def test_a_hanging_rank_is_killed_and_reported(dist):
    with pytest.raises((RankTimeout, RankFailure), match=r"rank\(s\) \[0\]"):
        dist.run(2, _hang_on_rank_zero, timeout=8)
    assert dist.run(2, _sum_of_ranks)[0][3] == 1.0


@pytest.mark.smoke
def test_wire_bytes_see_a_ring_all_gather(dist):
    written = dist.run(2, _wire_bytes_of_all_gather)
    ideal = 250_000 * 4  # world 2: each rank sends its shard once
    for w in written:
        assert 0.9 * ideal <= w <= 1.3 * ideal, (w, ideal)


@pytest.mark.smoke
def test_compare_helpers_fail_when_they_should():
    a = torch.tensor([1.0, 2.0, 4.0])
    assert_tensors_close(a, a.clone(), rel=0.0)
    with pytest.raises(AssertionError, match="relative"):
        assert_tensors_close(a + 0.01, a, rel=1e-3)
    assert_losses_close([1.0, 2.0], [1.0, 2.0 + 1e-7], rel=1e-6)
    with pytest.raises(AssertionError, match="step 1"):
        assert_losses_close([1.0, 2.0], [1.0, 2.1], rel=1e-6)
