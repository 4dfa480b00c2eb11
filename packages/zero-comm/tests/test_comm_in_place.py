"""reduce_scatter_in_place: the padded reduce-scatter's result, bit for bit, in each region's own row."""

from __future__ import annotations

import pytest
import torch
from comm_cases import ODD_SIZES, WORLDS, rank_tensor, result_of, run_on

from zero_comm import (
    CommLedger,
    Topology,
    partition_numel,
    reduce_scatter_coalesced_padded,
    reduce_scatter_in_place,
)

# world 3: a rank past the first two sums others' rows ahead of its own, and "avg" divides by 3
IN_PLACE_WORLDS = [*WORLDS, pytest.param((3, 3), id="w3")]
over_in_place_worlds = pytest.mark.parametrize("spec", IN_PLACE_WORLDS, scope="session")
FLOATS = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def _regions(world: int, rank: int, dtype: torch.dtype, sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Padded regions lying back to back in one flat buffer, as stage 1's gradients do."""
    padded = [world * partition_numel(n, world) for n in sizes]
    flat = rank_tensor(seed, rank, (sum(padded),), dtype)
    return list(flat.split(padded))


def _cases(rank, group_size: int | None):
    """Every dtype, op and sync mode, over the world or groups of ``group_size``: (checked, ledger)."""
    group = None if group_size is None else Topology().shard_group(group_size)
    world = rank.world_size if group is None else group_size
    me = rank.rank if group is None else rank.rank % group_size
    sizes = [n for n in ODD_SIZES if n] + [5, 1]
    checked = 0
    for name, dtype in FLOATS.items():
        for op in ("sum", "avg"):
            for async_op in (False, True):
                # a lone region on the sync runs: the other ranks' rows may be sent as they lie
                lengths = [4099] if not async_op else sizes
                regions = _regions(world, rank.rank, dtype, lengths, seed=len(name) + checked)
                before = [r.clone() for r in regions]
                expected = reduce_scatter_coalesced_padded([r.clone() for r in regions], group, op=op)
                own = result_of(reduce_scatter_in_place(regions, group, op=op, async_op=async_op), async_op)
                for i, (region, old, exp, mine) in enumerate(
                    zip(regions, before, expected, own, strict=True)
                ):
                    p = exp.numel()
                    assert mine.data_ptr() == region[me * p :].data_ptr(), (name, i)
                    assert torch.equal(region[me * p : (me + 1) * p], exp), (name, op, async_op, i)
                    assert torch.equal(region[: me * p], old[: me * p]), (name, i, "rows before")
                    assert torch.equal(region[(me + 1) * p :], old[(me + 1) * p :]), (name, i, "rows after")
                checked += 1
    with CommLedger(Topology()) as padded_ledger:
        reduce_scatter_coalesced_padded(_regions(world, rank.rank, torch.float32, sizes, 0), group)
    with CommLedger(Topology()) as in_place_ledger:
        reduce_scatter_in_place(_regions(world, rank.rank, torch.float32, sizes, 0), group)
    return checked, padded_ledger.totals(), in_place_ledger.totals()


@over_in_place_worlds
def test_in_place_equals_padded_reduce_scatter(dist, spec):
    for checked, padded, in_place in run_on(dist, spec, _cases, None):
        assert checked == len(FLOATS) * 2 * 2
        assert in_place == padded  # same collective on the ledger: same payload and wire bytes


def test_in_place_over_groups_of_two(dist):
    for checked, padded, in_place in dist.run(4, _cases, 2, ranks_per_node=2):
        assert checked == len(FLOATS) * 2 * 2
        assert in_place == padded


def _errors(rank):
    world = rank.world_size
    found = []
    bad = [
        [torch.zeros(2 * world + 1)],  # not a multiple of the group size
        [torch.zeros(world, 2)],  # not 1-D
        [torch.zeros(2 * world, dtype=torch.int64)],  # integers
        [torch.zeros(2 * world), torch.zeros(2 * world, dtype=torch.float64)],  # mixed dtypes
    ]
    for regions in bad:
        try:
            reduce_scatter_in_place(regions)
        except ValueError as exc:
            found.append(str(exc))
    try:
        reduce_scatter_in_place([torch.zeros(2 * world)], op="max")
    except ValueError as exc:
        found.append(str(exc))
    return found


def test_in_place_names_the_bad_input(dist):
    (found,) = set(map(tuple, dist.run(2, _errors, ranks_per_node=2)))
    assert len(found) == 5
    not_multiple, not_1d, integer, mixed, op = found
    assert "region 0 has 5 elements, not a multiple of the group size 2" in not_multiple
    assert "1-D" in not_1d or "1-d" in not_1d.lower()
    assert "floating-point" in integer
    assert "dtype" in mixed and "input 1" in mixed
    assert "'max'" in op
