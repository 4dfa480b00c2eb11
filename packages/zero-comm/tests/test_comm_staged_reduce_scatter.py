"""StagedReduceScatter: staged tensor by tensor, bit-identical to reduce_scatter_coalesced_padded."""

from __future__ import annotations

import pytest
import torch
from comm_cases import ODD_SIZES, rank_tensor

from zero_comm import StagedReduceScatter, reduce_scatter_coalesced_padded

SHAPES = [(n,) for n in ODD_SIZES] + [(3, 5), (1, 1, 7), (60,), (12, 5)]  # 60: whole rows at 1, 2, 4, 5 ranks


def _staged_equals_padded(rank):
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [rank_tensor(i, rank.rank, s, dtype) for i, s in enumerate(SHAPES)]
        missing = 3  # never put: reduced as zeros
        expected_inputs = [torch.zeros_like(t) if i == missing else t for i, t in enumerate(tensors)]
        for op in ("sum", "avg"):
            for async_op in (False, True):
                expected = reduce_scatter_coalesced_padded(expected_inputs, op=op)
                staged = StagedReduceScatter([t.numel() for t in tensors], None, dtype, "cpu")
                for i in reversed(range(len(tensors))):  # any order, as gradients arrive
                    if i != missing:
                        staged.put(i, tensors[i].clone())  # the caller's copy may be freed at once
                handle = staged.issue(op=op, async_op=async_op)
                parts = handle.wait()
                assert len(parts) == len(expected)
                for i, (p, e) in enumerate(zip(parts, expected)):
                    assert p.dtype == dtype and torch.equal(p, e), (dtype, op, i, SHAPES[i])
                    checked += 1
    staged = StagedReduceScatter([4, 5], None, torch.float32, "cpu")
    staged.put(0, torch.ones(4))
    with pytest.raises(ValueError, match="put twice"):
        staged.put(0, torch.ones(4))
    with pytest.raises(ValueError, match="has 4 elements, expected 5"):
        staged.put(1, torch.ones(4))
    return checked


@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_staged_reduce_scatter_is_bit_identical_to_the_padded_one(dist, world):
    """Rows staged on put (edge, middle and own rows; world 5 exchanges every row): the same bits."""
    assert dist.run(world, _staged_equals_padded) == [2 * 2 * 2 * len(SHAPES)] * world


def _staged_rows_are_every_ranks_partitions(rank):
    world = rank.world_size
    tensors = [rank_tensor(i, rank.rank, s, torch.float32) for i, s in enumerate(SHAPES)]
    staged = StagedReduceScatter([t.numel() for t in tensors] + [world], None, torch.float32, "cpu")
    for i in (4, 0, 6):  # some put, the others filled with zeros
        staged.put(i, tensors[i])
    staged.fill_missing(len(tensors))
    rows = staged.staged_rows(len(tensors))
    # what the rows hold, whatever their layout: every element of the tensors put, zeros for the rest
    put = torch.cat([tensors[i].reshape(-1) for i in (4, 0, 6)])
    held = torch.cat([r.reshape(-1) for r in rows])
    padded = sum(-(-t.numel() // world) * world for t in tensors)
    assert held.numel() == padded and (held != 0).sum() == (put != 0).sum()
    assert torch.equal(held.abs().sort().values[-put.numel() :], put.abs().sort().values)
    staged.put(len(tensors), torch.full((world,), 2.0))  # the last tensor is still open
    parts = staged.issue(op="sum").wait()
    return parts[-1].item()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_staged_rows_show_what_will_be_sent_before_the_last_tensor_is_put(dist, world):
    """``fill_missing(count)`` zeroes the tensors not put; ``staged_rows(count)`` views exactly them."""
    assert dist.run(world, _staged_rows_are_every_ranks_partitions) == [2.0 * world] * world
