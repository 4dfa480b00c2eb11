"""checkpoint.layout.covered_prefix: how far the saved pieces of a parameter cover it without a gap."""

from __future__ import annotations

import random

from zero_full.checkpoint.layout import covered_prefix


def _reference(ranges: list[tuple[int, int]]) -> int:
    """The first element no piece holds, element by element."""
    held = {i for a, b in ranges for i in range(a, b)}
    pos = 0
    while pos in held:
        pos += 1
    return pos


def test_covered_prefix_matches_an_element_by_element_count_in_any_order():
    rng = random.Random(15)
    for _ in range(400):
        ranges = []
        for _ in range(rng.randint(0, 6)):
            a = rng.randint(0, 23)
            ranges.append((a, a + rng.randint(0, 7)))  # empty pieces too
        rng.shuffle(ranges)
        assert covered_prefix(ranges) == _reference(ranges), ranges


def test_shard_ranges_of_odd_numels_cover_the_whole_parameter():
    from zero_comm import shard_range

    for numel in (0, 1, 7, 131, 1023):
        for world in (1, 2, 3, 4):
            pieces = [shard_range(numel, world, r) for r in range(world)]
            assert covered_prefix(list(reversed(pieces))) == numel
            assert covered_prefix(pieces[:-1]) == pieces[-1][0]  # clipped: numel when the last is empty
