"""Forward outputs and reduced gradient partitions equal a non-partitioned model's."""

from __future__ import annotations

import pytest
import torch
from coord_cases import (
    ReduceScatterSink,
    TiedBranchModel,
    build,
    coordinate,
    gathered_params,
    grad_partition_errors,
    over_worlds,
    rank_input,
    reference_grads,
)

import zero_params
from zero_comm import CommLedger, FlatAllGather, LinkKind, Topology
from zero_coord import Coordinator, CoordinatorConfig
from zero_testing.models import ReluMLP

# (name, config): defaults keep everything between forward and backward; "tight" prefetches
# little, bounds live parameters and releases everything right after use.
CONFIGS = {
    "default": CoordinatorConfig(),
    "tight": CoordinatorConfig(prefetch_bucket_size=40, max_live_parameters=120, max_reuse_distance=0),
    "no_prefetch": CoordinatorConfig(prefetch_bucket_size=0, max_reuse_distance=0),
}


def _mlp_matches_reference(rank, config_name: str, steps: int):
    world = rank.world_size
    model, ref = build(ReluMLP)
    sink = ReduceScatterSink()
    coord = coordinate(model, CONFIGS[config_name], sink)
    weights = torch.arange(1.0, 4.0)
    loss_fn = lambda out: (out * weights).sum()  # noqa: E731 - tiny test loss
    out_errors, leaks = [], []
    for step in range(steps):
        x = rank_input(step, rank.rank, (5, 7))
        out = model(x)
        with torch.no_grad():
            ref_out = ref(x)
        out_errors.append((out - ref_out).abs().max().item())
        loss_fn(out).backward()
        leaks.append(gathered_params(model) + ([] if coord.live_elements == 0 else ["live"]))
    inputs = [(rank_input(step, r, (5, 7)),) for step in range(steps) for r in range(world)]
    errors = grad_partition_errors(model, reference_grads(ref, inputs, loss_fn, world))
    coord.remove()
    return out_errors, errors, leaks, sink.problems, sink.ends, coord.last_step_stats.prefetch_hits


@over_worlds
@pytest.mark.smoke
def test_odd_mlp_outputs_and_gradient_partitions_match(dist, world):
    for config_name in CONFIGS:
        results = dist.run(world, _mlp_matches_reference, config_name, 3)
        for r, (out_errors, errors, leaks, problems, ends, hits) in enumerate(results):
            assert max(out_errors) == 0.0, (config_name, r, out_errors)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, (config_name, r, worst, errors[worst])
            assert leaks == [[]] * 3, (config_name, r, leaks)
            assert problems == [], (config_name, r, problems)
            assert ends == 3
            if config_name == "tight":
                assert hits > 0, "prefetch never hit on a complete trace"


def _tied_branch_matches_reference(rank, config_name: str):
    world = rank.world_size
    model, ref = build(TiedBranchModel)
    sink = ReduceScatterSink()
    coord = coordinate(model, CONFIGS[config_name], sink)
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731 - tiny test loss
    branches = [True, True, False, True]  # the same on every rank: the order changes between steps
    out_errors, leaks, statuses, kept = [], [], [], []
    for step, go_left in enumerate(branches):
        ids = rank_input(step, rank.rank, (3, 4), high=11)
        out = model(ids, go_left)
        state = zero_params.state_of(model.embed.weight)
        after_forward = state.unsharded.fills if state.status is zero_params.ParamStatus.AVAILABLE else None
        with torch.no_grad():
            ref_out = ref(ids, go_left)
        out_errors.append((out - ref_out).abs().max().item())
        loss_fn(out).backward()
        # The tied weight's gradient is complete only after embed's backward, long after
        # out's and head's: it must stay gathered (not refilled) until on_grad_ready.
        kept.append(after_forward is not None and sink.fills["embed.weight"] == after_forward)
        leaks.append(gathered_params(model) + ([] if coord.live_elements == 0 else ["live"]))
        statuses.append(zero_params.state_of(model.frozen.weight).status.name)
    inputs = [
        (rank_input(step, r, (3, 4), high=11), b) for step, b in enumerate(branches) for r in range(world)
    ]
    errors = grad_partition_errors(model, reference_grads(ref, inputs, loss_fn, world))
    coord.remove()
    ready_counts = {name: sink.ready.count(name) for name in set(sink.ready)}
    return out_errors, errors, leaks, sink.problems, ready_counts, statuses, kept


@over_worlds
def test_tied_weights_branches_and_frozen_params_match(dist, world):
    for config_name in CONFIGS:
        results = dist.run(world, _tied_branch_matches_reference, config_name)
        for r, (out_errors, errors, leaks, problems, ready, statuses, kept) in enumerate(results):
            assert max(out_errors) <= 1e-6, (config_name, r, out_errors)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, (config_name, r, worst, errors[worst])
            assert leaks == [[]] * 4, (config_name, r, leaks)
            assert problems == [], (config_name, r, problems)
            # The tied weight gets ONE on_grad_ready per backward whatever the number of uses;
            # the branch not taken gets none; the frozen layer never.
            assert ready["embed.weight"] == 4
            assert ready["left.weight"] == 3 and ready["right.weight"] == 1
            assert "frozen.weight" not in ready
            assert ready["empty"] == 4  # persistent parameters reach the sink too
            assert statuses == ["NOT_AVAILABLE"] * 4
            assert kept[1], (config_name, kept)  # step 1 validates the trace: kept into backward


def _hpz_backward_gathers_stay_in_the_node(rank, config_name: str):
    world = rank.world_size
    model, ref = build(ReluMLP)
    topology = Topology(rank.ranks_per_node)
    zero_params.partition(model, secondary_strategy=FlatAllGather(topology.intra_node_group()))
    sink = ReduceScatterSink()
    coord = Coordinator(model, CONFIGS[config_name], sink)
    coord.install()
    loss_fn = lambda out: out.sum()  # noqa: E731 - tiny test loss
    links = []
    for step in range(2):
        with CommLedger(topology) as ledger:
            loss_fn(model(rank_input(step, rank.rank, (5, 7)))).backward()
        gathers = [r for r in ledger.records if r.op == "all_gather"]
        inter = [r.payload_bytes for r in gathers if r.link is LinkKind.INTER_NODE]
        links.append((len(inter), len(gathers) - len(inter), sum(inter)))
    inputs = [(rank_input(step, r, (5, 7)),) for step in range(2) for r in range(world)]
    errors = grad_partition_errors(model, reference_grads(ref, inputs, loss_fn, world))
    coord.remove()
    return links, max(errors.values()), sink.problems


def test_hpz_backward_gathers_use_the_secondary_group(dist):
    layers = len(ReluMLP().layers)
    for config_name in ("no_prefetch", "tight"):  # gathered on demand, or prefetched
        for links, err, problems in dist.run(
            4, _hpz_backward_gathers_stay_in_the_node, config_name, ranks_per_node=2
        ):
            assert err <= 1e-5 and problems == []
            # (inter-node, intra-node) all-gathers per step: forward gathers each layer once
            # over all 4 ranks (prefetched: several layers per gather, the same bytes as the
            # recording step's gather per layer); every backward regather stays within the node.
            (first_inter, first_intra, first_bytes), *rest = links
            assert first_inter == layers and first_intra >= 1, (config_name, links)
            for inter, intra, inter_bytes in rest:
                assert 1 <= inter <= layers and intra >= 1 and inter_bytes == first_bytes, (
                    config_name,
                    links,
                )
