"""MiCS layout validation (no process group needed): errors name the numbers and the fix."""

from __future__ import annotations

import pytest

from zero_full.wiring.mics import check_mics_layout


@pytest.mark.parametrize(
    "shard,hier,world,per_node",
    [(1, False, 1, 1), (1, False, 4, 2), (2, False, 4, 2), (4, False, 4, 2), (2, True, 4, 1), (4, True, 4, 2),
     (4, True, 8, 2), (8, True, 8, 4), (3, False, 6, 3), (6, True, 6, 3)],
)  # fmt: skip
def test_valid_layouts_pass(shard, hier, world, per_node):
    check_mics_layout(shard, hier, world, per_node)


@pytest.mark.parametrize(
    "shard,hier,world,per_node,needles",
    [
        (3, False, 4, 2, ["mics_shard_size=3 does not divide world size 4"]),
        (8, False, 4, 4, ["mics_shard_size=8 does not divide world size 4"]),
        (0, False, 4, 2, ["mics_shard_size=0", ">= 1"]),
        (2, True, 4, 2, ["spanning >= 2 nodes", "mics_shard_size=2", "2 ranks per node", "multiple of 2"]),
        (1, True, 4, 1, ["spanning >= 2 nodes", "mics_shard_size=1"]),
        (2, True, 6, 3, ["mics_shard_size=2 is not a multiple of the 3 ranks per node", "straddle"]),
    ],
)
def test_invalid_layouts_name_the_numbers(shard, hier, world, per_node, needles):
    with pytest.raises(ValueError) as info:
        check_mics_layout(shard, hier, world, per_node)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
