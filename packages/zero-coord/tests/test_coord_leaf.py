"""Leaf modules: a data-dependent mixture-of-experts block gathered as a whole, no hooks inside."""

from __future__ import annotations

import pytest
import torch
from coord_cases import (
    DeferredSink,
    Experts,
    MoEModel,
    build,
    coordinate,
    gathered_params,
    grad_partition_errors,
    hook_counts,
    over_worlds,
    rank_input,
    reference_grads,
)
from torch import nn

from zero_coord import Phase, find_leaf_modules, set_leaf_modules


def _moe_with_leaf(rank, how: str):
    world = rank.world_size
    model, ref = build(MoEModel)
    marked = set_leaf_modules(model, [Experts] if how == "class" else [how])
    sink = DeferredSink(list(model.parameters()))
    coord = coordinate(model, None, sink)
    inner_hooks = {name: hook_counts(m) for name, m in model.moe.named_modules() if name}
    leaf_hooks = hook_counts(model.moe)
    loss_fn = lambda out: out.sum()  # noqa: E731 - tiny test loss
    out_errors, leaks = [], []
    for step in range(3):
        x = rank_input(step, rank.rank, (5, 6)) * (rank.rank + 1)
        with torch.no_grad():
            ref_out = ref(x)
        out = model(x)
        out_errors.append((out - ref_out).abs().max().item())
        loss_fn(out).backward()
        leaks.append(gathered_params(model))
    inputs = [(rank_input(step, r, (5, 6)) * (r + 1),) for step in range(3) for r in range(world)]
    errors = grad_partition_errors(model, reference_grads(ref, inputs, loss_fn, world))
    events = [(e.module, e.backward) for e in coord.trace(Phase.TRAIN).events]
    stats = coord.last_step_stats
    coord.remove()
    return [m is model.moe for m in marked], inner_hooks, leaf_hooks, out_errors, errors, leaks, events, stats


@over_worlds
def test_a_data_dependent_moe_leaf_matches_the_reference(dist, world):
    for how in ("class", "Experts", "moe"):
        for r, result in enumerate(dist.run(world, _moe_with_leaf, how)):
            marked, inner_hooks, leaf_hooks, out_errors, errors, leaks, events, stats = result
            assert marked == [True]
            assert inner_hooks and all(n == 0 for n in inner_hooks.values()), inner_hooks
            assert leaf_hooks > 0
            assert max(out_errors) <= 1e-6, (r, out_errors)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, (how, r, worst, errors[worst])
            assert leaks == [[]] * 3
            forward = ["inp", "moe", "outp"]
            assert events == [(m, False) for m in forward] + [(m, True) for m in reversed(forward)]
            assert stats.prefetch_misses == 2  # only the first module (inp: weight, bias) misses


def _experts_run(rank):
    model, _ = build(MoEModel)
    runs = []
    with torch.no_grad():
        for step in range(3):  # the inputs of _moe_with_leaf
            x = rank_input(step, rank.rank, (5, 6)) * (rank.rank + 1)
            runs.append(sorted(set(model.moe.router(torch.tanh(model.inp(x))).argmax(-1).tolist())))
    return runs


@pytest.mark.parametrize("world", [2, 4])
def test_the_moe_case_really_routes_differently_per_rank(dist, world):
    per_rank = dist.run(world, _experts_run)
    for step in range(3):
        assert len({tuple(runs[step]) for runs in per_rank}) > 1, (step, per_rank)


def test_set_leaf_modules_marks_outermost_and_names_unmatched_entries():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Experts()
            self.b = nn.Sequential(Experts(), nn.Linear(6, 6))

    model = Outer()
    marked = set_leaf_modules(model, ["Experts"])
    assert marked == [model.a, model.b[0]]
    assert find_leaf_modules(model) == {"a": model.a, "b.0": model.b[0]}
    set_leaf_modules(model, ["b"])  # additive; b covers b.0
    assert find_leaf_modules(model) == {"a": model.a, "b": model.b}
    set_leaf_modules(model.a, [nn.Linear])  # a registry on a submodule is found too, but covered by 'a'
    assert find_leaf_modules(model) == {"a": model.a, "b": model.b}
    assert set(find_leaf_modules(model.a)) == {"router", "experts.0", "experts.1", "experts.2"}
    with pytest.raises(ValueError, match="matches NoSuchBlock, c.d"):
        set_leaf_modules(model, ["NoSuchBlock", "a", "c.d"])
    with pytest.raises(TypeError, match="neither an nn.Module subclass"):
        set_leaf_modules(model, [42])
