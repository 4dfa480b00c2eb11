"""Offloaded shards are swapped in ahead of their gather: the trace prefetch asks the ShardPrefetcher."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from coord_cases import DeepMLP, ReduceScatterSink, build, over_worlds, rank_input

import zero_params
from zero_coord import Coordinator, CoordinatorConfig
from zero_offload import OffloadTarget, ParamOffloadConfig

DEPTH, WIDTH = 8, 17
LAYER_NUMEL = WIDTH * WIDTH + WIDTH


class Recorder:
    """A ShardPrefetcher that records what it is offered (takes the first ``room`` parameters)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.offers: list[list[int]] = []

    def prefetch(self, upcoming) -> int:
        taken = [id(p) for _, (p, swap_in) in zip(range(self.room), (u for u in upcoming if u[1]))]
        self.offers.append(taken)
        return len(taken)


def _swap_ahead(rank, prefetch: bool):
    model, ref = build(DeepMLP, depth=DEPTH, width=WIDTH)
    zero_params.partition(model)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ParamOffloadConfig(
            device=OffloadTarget.NVME, nvme_path=Path(tmp), buffer_count=4, buffer_size=WIDTH * WIDTH
        )
        home = zero_params.OffloadedShards(model.parameters(), cfg)
        config = CoordinatorConfig(prefetch_bucket_size=LAYER_NUMEL, max_reuse_distance=0)
        coord = Coordinator(model, config, ReduceScatterSink(), shard_prefetch=home if prefetch else None)
        coord.install()
        errors, stats = [], []
        for step in range(3):
            before = (home.stats.prefetched, home.stats.prefetch_hits, home.stats.swap_ins.count)
            x = rank_input(step, rank.rank, (4, WIDTH))
            out = model(x)
            out.pow(2).sum().backward()
            with torch.no_grad():
                errors.append((out - ref(x)).abs().max().item())
            after = (home.stats.prefetched, home.stats.prefetch_hits, home.stats.swap_ins.count)
            stats.append((*(a - b for a, b in zip(after, before)), coord.last_step_stats.shard_prefetches))
        coord.remove()
        home.close()
    return max(errors), stats


@over_worlds
def test_shards_of_upcoming_modules_are_swapped_in_before_their_gather(dist, world):
    control = dist.run(world, _swap_ahead, False)
    for (err, stats), (err_c, stats_c) in zip(dist.run(world, _swap_ahead, True), control):
        assert err == err_c == 0.0
        prefetched, hits, swap_ins, coord_count = stats[0]
        assert prefetched == hits == coord_count == 0  # recording step: no trace yet
        prefetched, hits, swap_ins, coord_count = stats[2]
        assert prefetched == coord_count > 0
        # nearly every swap-in the prefetch started was used by a later gather (its read was
        # issued before that gather); a few are evicted for the current gather's room
        assert 0.8 * prefetched <= hits <= prefetched, stats
        assert swap_ins == stats_c[2][2], (stats, stats_c)  # prefetching adds no reads
        # control: without a prefetcher every swap-in is a blocking read inside the gather
        assert all(s[0] == s[1] == s[3] == 0 and s[2] > 0 for s in stats_c)


def _offers(rank):
    model, _ = build(DeepMLP, depth=DEPTH, width=WIDTH)
    zero_params.partition(model)
    recorder = Recorder(room=3)
    config = CoordinatorConfig(prefetch_bucket_size=LAYER_NUMEL, max_reuse_distance=0)
    coord = Coordinator(model, config, None, shard_prefetch=recorder)
    coord.install()
    order = [id(p) for layer in model.layers for p in (layer.weight, layer.bias)]
    for step in range(2):
        recorder.offers.clear()
        with torch.no_grad():
            model(rank_input(step, rank.rank, (4, WIDTH)))
    coord.remove()
    return recorder.offers, order


def test_prefetcher_is_offered_the_next_modules_beyond_the_gather_window(dist):
    offers, order = dist.run(1, _offers)[0]
    assert offers, "no offers on the traced step"
    # after layer k runs, layer k + 1 is gathered (the one-layer bucket): offers start at layer k + 2
    for k, offer in enumerate(offers):
        assert offer == order[2 * (k + 2) : 2 * (k + 2) + 3], (k, offer)


def test_shard_prefetch_must_have_prefetch(dist):
    model, _ = build(DeepMLP, depth=2, width=WIDTH)
    with pytest.raises(TypeError, match="lacks prefetch"):
        Coordinator(model, CoordinatorConfig(), None, shard_prefetch=object())
