"""gather_rows: gloo's all-gather replaced by one pairwise exchange between two ranks, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from comm_cases import DTYPES, ODD_SIZES, over_worlds, rank_tensor
from torch.profiler import ProfilerActivity, profile

from zero_comm import Topology, all_gather_coalesced, all_gather_coalesced_into
from zero_comm.pairwise import gather_rows, gathers_pairwise
from zero_comm.torch_compat import all_gather_single


def _reference(send: torch.Tensor, group=None) -> torch.Tensor:
    out = torch.empty(tdist.get_world_size(group) * send.numel(), dtype=send.dtype)
    all_gather_single(out, send, group=group)
    return out


def _rows_cases(rank):
    """Every odd size and dtype, sync and async, the input apart from ``out`` or its own row."""
    world = rank.world_size
    checked = 0
    for dtype in DTYPES.values():
        for i, n in enumerate(n for n in ODD_SIZES if n):
            send = rank_tensor(i, rank.rank, (n,), dtype)
            ref = _reference(send)
            for async_op in (False, True):
                out = torch.full((world * n,), 7.0, dtype=dtype)
                work = gather_rows(out, send, None, async_op=async_op)
                if async_op:
                    work.wait()
                assert torch.equal(out, ref), (dtype, n, async_op)
                inside = torch.full((world * n,), 7.0, dtype=dtype)  # the input is its own row of out
                own = inside.view(world, n)[rank.rank]
                own.copy_(send)
                gather_rows(inside, own, None, async_op=False)
                assert torch.equal(inside, ref), (dtype, n, "own row")
                checked += 1
    return checked


@over_worlds
@pytest.mark.smoke
def test_gather_rows_matches_all_gather_single(dist, spec):
    world, rpn = spec
    if world == 1:
        return  # gather_rows is for groups of more than one rank; callers copy locally
    expected = len(DTYPES) * 2 * (len(ODD_SIZES) - 1)
    assert dist.run(world, _rows_cases, ranks_per_node=rpn) == [expected] * world


def _issued(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("c10d::")}


def _which_collective(rank):
    """The torch collective a coalesced gather issues, over the world and over groups of two."""
    shards = [rank_tensor(i, rank.rank, (n,), torch.float32) for i, n in enumerate((131, 7))]
    outputs = [torch.empty(rank.world_size * n) for n in (131, 7)]
    found = {
        "world": _issued(lambda: all_gather_coalesced(shards)),
        "world into": _issued(lambda: all_gather_coalesced_into(shards, outputs)),
        "pairs": _issued(lambda: all_gather_coalesced(shards, Topology().shard_group(2))),
    }
    pairwise = {
        "world": gathers_pairwise(None, torch.device("cpu")),
        "meta": gathers_pairwise(None, torch.device("meta")),
    }
    return found, pairwise


@over_worlds
def test_two_gloo_ranks_exchange_pairwise_and_larger_groups_all_gather(dist, spec):
    world, rpn = spec
    if world == 1:
        return
    gather, a2a = "c10d::_allgather_base_", "c10d::alltoall_base_"
    for found, pairwise in dist.run(world, _which_collective, ranks_per_node=rpn):
        assert pairwise == {"world": world == 2, "meta": False}
        for case in ("world", "world into"):
            assert (a2a in found[case], gather in found[case]) == (world == 2, world != 2), (case, found)
        assert a2a in found["pairs"] and gather not in found["pairs"], found
