"""Prefetch hit rate on a steady-state step, the max-live-parameters bound, one gather per window."""

from __future__ import annotations

import torch
from coord_cases import (
    DeepMLP,
    ReduceScatterSink,
    build,
    coordinate,
    grad_partition_errors,
    over_worlds,
    rank_input,
    reference_grads,
    train_steps,
)

import zero_params
from zero_comm import CommLedger, Topology
from zero_coord import CoordinatorConfig

DEPTH, WIDTH = 12, 17
LAYER_NUMEL = WIDTH * WIDTH + WIDTH


def _steady_state_hits(rank, bucket: int):
    model, ref = build(DeepMLP, depth=DEPTH, width=WIDTH)
    config = CoordinatorConfig(prefetch_bucket_size=bucket, max_reuse_distance=0)
    coord = coordinate(model, config, ReduceScatterSink())
    batch = lambda step: rank_input(step, rank.rank, (4, WIDTH))  # noqa: E731 - tiny test input
    stats, err = train_steps(model, ref, coord, batch, loss=lambda out: out.pow(2).sum())
    coord.remove()
    return stats, err


@over_worlds
def test_prefetch_hits_at_least_90_percent_on_a_steady_step(dist, world):
    two_layers = 2 * LAYER_NUMEL
    for stats, err in dist.run(world, _steady_state_hits, two_layers):
        assert err == 0.0
        first, steady = stats[0], stats[2]
        assert first.prefetch_hits == 0  # recording step: no trace, no prefetch
        assert steady.prefetch_hit_rate >= 0.9, steady
        # 2 parameters per layer and pass; with max_reuse_distance=0 backward gathers again.
        # Only the first module of the step misses (nothing runs before it to prefetch it).
        assert steady.prefetch_hits + steady.prefetch_misses + steady.reuse_hits == 4 * DEPTH
        assert steady.prefetch_misses == 2, steady
        assert steady.bytes_gathered < first.bytes_gathered  # the last layer is kept into backward
    # Control: the same steps without prefetching miss every time, except the last layer,
    # whose backward directly follows its forward (reuse distance 0).
    for stats, err in dist.run(world, _steady_state_hits, 0):
        steady = stats[2]
        assert err == 0.0 and steady.prefetch_hits == 0
        assert steady.prefetch_misses == 4 * DEPTH - 2 and steady.reuse_hits == 2


BOUND_DEPTH = 24  # 1/8 of the model = 3 layers: room for the running layer and 2 prefetched


def _live_bound(rank, max_live: int):
    model, ref = build(DeepMLP, depth=BOUND_DEPTH, width=WIDTH)
    config = CoordinatorConfig(prefetch_bucket_size=10**6, max_live_parameters=max_live)
    coord = coordinate(model, config, ReduceScatterSink())
    params = [p for p in model.parameters()]
    observed = [0]

    def measure(*_):  # what is really gathered, independent of the coordinator's own count
        live = sum(
            zero_params.state_of(p).numel
            for p in params
            if zero_params.state_of(p).status is not zero_params.ParamStatus.NOT_AVAILABLE
        )
        observed[0] = max(observed[0], live)

    handles = [layer.register_forward_pre_hook(measure) for layer in model.layers]
    handles += [p.register_post_accumulate_grad_hook(measure) for p in params]
    peaks, errors, hits = [], [], []
    for step in range(3):
        x = rank_input(step, rank.rank, (4, WIDTH))
        out = model(x)
        out.pow(2).sum().backward()
        peaks.append(coord.last_step_stats.max_live_elements)
        hits.append(coord.last_step_stats.prefetch_hit_rate)
        with torch.no_grad():
            errors.append((out - ref(x)).abs().max().item())
    for h in handles:
        h.remove()
    coord.remove()
    return peaks, observed[0], max(errors), hits


@over_worlds
def test_live_parameters_stay_within_the_bound_plus_one_module(dist, world):
    total = BOUND_DEPTH * LAYER_NUMEL
    bound = total // 8
    for peaks, observed, err, hits in dist.run(world, _live_bound, bound):
        assert err == 0.0
        assert max(peaks) <= bound + LAYER_NUMEL, (peaks, bound)
        assert observed <= bound + LAYER_NUMEL, (observed, bound)
        assert LAYER_NUMEL < observed <= max(peaks)  # prefetching still runs within the bound
        # kept-for-reuse parameters needed later make room for prefetches needed sooner
        assert hits[2] >= 0.9, hits
    # Control: unbounded, the same run keeps (nearly) the whole model gathered.
    for peaks, observed, err, _ in dist.run(world, _live_bound, 10**9):
        assert err == 0.0 and observed > bound + LAYER_NUMEL and max(peaks) >= observed


WINDOW_LAYERS = 4  # the prefetch bucket: four layers ahead


def _window_collectives(rank, bucket: int):
    model, ref = build(DeepMLP, depth=DEPTH, width=WIDTH)
    config = CoordinatorConfig(prefetch_bucket_size=bucket, max_reuse_distance=0)
    coord = coordinate(model, config, ReduceScatterSink())
    topology = Topology(rank.ranks_per_node)
    collectives, stats, errors, inputs, plans = [], [], [], [], []
    loss_fn = lambda out: out.pow(2).sum()  # noqa: E731 - tiny test loss
    for step in range(3):
        x = rank_input(step, rank.rank, (4, WIDTH))
        inputs += [(rank_input(step, r, (4, WIDTH)),) for r in range(rank.world_size)]
        with CommLedger(topology) as ledger:
            out = model(x)
            loss_fn(out).backward()
        collectives.append(sum(r.op == "all_gather" for r in ledger.records))
        stats.append(coord.last_step_stats)
        plans.append(dict(coord._live.plans))  # each window's gather plan, by window
        with torch.no_grad():
            errors.append((out - ref(x)).abs().max().item())
    grad_errors = grad_partition_errors(model, reference_grads(ref, inputs, loss_fn, rank.world_size))
    # The steady step gathered the windows of the first traced step with the very same plans.
    reused = plans[2] == plans[1] and all("planned=True" in repr(p) for p in plans[2].values())
    coord.remove()
    return collectives, stats, max(errors), max(grad_errors.values()), reused, len(coord._live.plans)


@over_worlds
def test_one_gather_per_prefetch_window_not_per_module(dist, world):
    window = WINDOW_LAYERS * LAYER_NUMEL
    for collectives, stats, err, grad_err, reused, left in dist.run(world, _window_collectives, window):
        assert err == 0.0 and grad_err <= 1e-5, (err, grad_err)
        assert reused and left == 0  # plans reused step after step, dropped by remove()
        steady = stats[2]
        assert steady.prefetch_misses == 2 and steady.prefetch_hit_rate >= 0.9, steady
        assert collectives[2] == steady.gathers, (collectives, steady)  # one collective per gather
        # Recording step: no trace, a gather per module and pass.
        assert stats[0].gathers == 2 * DEPTH, stats[0]
        # Steady step, 2 x DEPTH fetches (the last layer's backward reuses its forward's): the
        # first fetch gathers its layer with the window of 4 after it; later windows start once
        # half the bucket (2 layers) is free, 2 layers per gather (before: a gather per layer).
        modules = 2 * DEPTH - 1 - (1 + WINDOW_LAYERS)
        assert steady.gathers <= 1 + -(-modules // (WINDOW_LAYERS // 2)), steady
    # Control: a bucket of one layer gathers one layer at a time (the first with the missed one).
    for _, stats, err, grad_err, reused, _ in dist.run(world, _window_collectives, LAYER_NUMEL):
        assert reused and err == 0.0 and grad_err <= 1e-5 and stats[2].gathers == 2 * DEPTH - 2, stats[2]
