"""Leaf modules: a data-dependent mixture-of-experts block gathered as a whole, no hooks inside."""

from __future__ import annotations

import dataclasses

import coord_cases as cases
import pytest
import torch
from torch import nn

from zero_coord import (
    CoordinatorConfig,
    Phase,
    coordinated_leaves,
    find_leaf_modules,
    granularity_leaves,
    set_leaf_modules,
)


def _moe_with_leaf(rank, how: str):
    world = rank.world_size
    model, ref = cases.build(cases.MoEModel)
    marked = set_leaf_modules(model, [cases.Experts] if how == "class" else [how])
    sink = cases.DeferredSink(list(model.parameters()))
    coord = cases.coordinate(model, None, sink)
    inner_hooks = {name: cases.hook_counts(m) for name, m in model.moe.named_modules() if name}
    leaf_hooks = cases.hook_counts(model.moe)
    loss_fn = lambda out: out.sum()  # noqa: E731 - tiny test loss
    out_errors, leaks = [], []
    for step in range(3):
        x = cases.rank_input(step, rank.rank, (5, 6)) * (rank.rank + 1)
        with torch.no_grad():
            ref_out = ref(x)
        out = model(x)
        out_errors.append((out - ref_out).abs().max().item())
        loss_fn(out).backward()
        leaks.append(cases.gathered_params(model))
    inputs = [(cases.rank_input(step, r, (5, 6)) * (r + 1),) for step in range(3) for r in range(world)]
    errors = cases.grad_partition_errors(model, cases.reference_grads(ref, inputs, loss_fn, world))
    events = [(e.module, e.backward) for e in coord.trace(Phase.TRAIN).events]
    stats = coord.last_step_stats
    coord.remove()
    return [m is model.moe for m in marked], inner_hooks, leaf_hooks, out_errors, errors, leaks, events, stats


@cases.over_worlds
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
    model, _ = cases.build(cases.MoEModel)
    runs = []
    with torch.no_grad():
        for step in range(3):  # the inputs of _moe_with_leaf
            x = cases.rank_input(step, rank.rank, (5, 6)) * (rank.rank + 1)
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
            self.a = cases.Experts()
            self.b = nn.Sequential(cases.Experts(), nn.Linear(6, 6))

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


class _Attn(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class _Block(nn.Module):
    """ln, attention (2 Linears), an MLP in a Sequential (2 Linears, a GELU): 5 layers + 2 modules."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = _Attn(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class _Stack(nn.Module):
    """Linear, 3 blocks, a wide head: the root's granularity above a block's, a block's above its
    attention's, so the threshold decides which one is the leaf."""

    def __init__(self, width: int = 7, depth: int = 3, head: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.act = nn.GELU()
        self.out = nn.Linear(width, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.act(x))


def _block_granularity(width: int) -> tuple[int, int, int]:
    """The formula by hand: (block, attention, root) elements // layers of a _Stack(width, 3)."""
    ln, qkv, proj = 2 * width, width * 3 * width + 3 * width, width * width
    mlp = (width * 4 * width + 4 * width) + (4 * width * width + width)
    block = ln + qkv + proj + mlp
    # layers: ln, qkv, proj, mlp.0, mlp.2 (torch leaves with parameters) + attn + the block
    # itself; the Sequential (a container) and the GELU (no parameters) do not count
    root_elements = (5 * width + width) + 3 * block + (width * 64 + 64)
    root_layers = 1 + 3 * 7 + 1 + 1  # inp, 3 blocks, out, the root (the ModuleList is a container)
    return block // 7, (qkv + proj) // 3, root_elements // root_layers


def test_granularity_leaves_follow_deepspeeds_rule_parents_first() -> None:
    width = 7
    model = _Stack(width)
    block, attn, root = _block_granularity(width)
    assert attn < block < root  # the case tests that the parent (block) wins over the smaller attn
    names = ["blocks.0", "blocks.1", "blocks.2"]
    assert granularity_leaves(model, block) == (names, granularity_leaves(model, 0)[1])
    _, smallest = granularity_leaves(model, 0)
    assert (smallest.name, smallest.value) == ("blocks.0.attn", attn)
    assert granularity_leaves(model, attn)[0] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert granularity_leaves(model, attn - 1)[0] == []
    assert granularity_leaves(model, root)[0] == [""]  # the whole model as one leaf
    with pytest.raises(ValueError, match="non-negative int"):
        granularity_leaves(model, -1)


def _granular_run(rank, threshold: int):
    world = rank.world_size
    model, ref = cases.build(_Stack)
    sink = cases.DeferredSink(list(model.parameters()))
    config = CoordinatorConfig(prefetch_bucket_size=400, max_live_parameters=800, max_reuse_distance=0)
    handler = cases.capture_coord_logs()
    coord = cases.coordinate(model, dataclasses.replace(config, module_granularity_threshold=threshold), sink)
    logs = cases.release_logs(handler)
    inner = sum(cases.hook_counts(m) for m in model.blocks[0].modules() if m is not model.blocks[0])
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731 - tiny test loss
    leaks = []
    for step in range(3):
        loss_fn(model(cases.rank_input(step, rank.rank, (4, 5)))).backward()
        leaks.append(cases.gathered_params(model))
    inputs = [(cases.rank_input(step, r, (4, 5)),) for step in range(3) for r in range(world)]
    errors = cases.grad_partition_errors(model, cases.reference_grads(ref, inputs, loss_fn, world))
    leaves, gathers = coord.leaf_modules, coord.last_step_stats.gathers
    coord.remove()
    return leaves, inner, leaks, max(errors.values()), gathers, logs


@cases.over_worlds
def test_module_granularity_threshold_gathers_blocks_as_leaves_with_the_reference_gradients(dist, world):
    block = _block_granularity(7)[0]
    per_module = dist.run(world, _granular_run, 0)
    by_block = dist.run(world, _granular_run, block)
    for (leaves0, inner0, *_, gathers0, _), (leaves, inner, leaks, error, gathers, logs) in zip(
        per_module, by_block, strict=True
    ):
        assert leaves0 == () and inner0 > 0
        assert leaves == ("blocks.0", "blocks.1", "blocks.2")
        assert inner == 0  # no hooks inside a leaf block
        assert leaks == [[]] * 3  # released after use, as per module
        assert error <= 1e-5
        assert gathers < gathers0, (gathers, gathers0)
        assert any("3 module(s) gathered as leaves: blocks.0, blocks.1, blocks.2" in m for _, m in logs), logs


def test_coordinated_leaves_are_the_marked_and_the_selected_outermost_first() -> None:
    """Marked leaves and those a threshold selects, merged: a marked attention inside a selected
    block is covered by the block; a marked module outside the selected ones stays a leaf."""
    width = 7
    block, attn, _ = _block_granularity(width)
    model = _Stack(width)
    set_leaf_modules(model, ["blocks.0.attn", "out"])
    assert list(coordinated_leaves(model, 0)) == ["out", "blocks.0.attn"]
    leaves = coordinated_leaves(model, block)
    assert sorted(leaves) == ["blocks.0", "blocks.1", "blocks.2", "out"]
    assert leaves["blocks.1"] is model.blocks[1] and leaves["out"] is model.out
    attns = ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert sorted(coordinated_leaves(model, attn)) == [*attns, "out"]


def _installed_with_threshold(rank, threshold):
    model, _ = cases.build(_Stack)
    handler = cases.capture_coord_logs()
    coord = cases.coordinate(model, CoordinatorConfig(module_granularity_threshold=threshold))
    logs = cases.release_logs(handler)
    leaves = coord.leaf_modules
    coord.remove()
    return leaves, [(level, message) for level, message in logs if level == "WARNING"]


def _flat_model_threshold(rank):
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # a container of layers: no leaf
    handler = cases.capture_coord_logs()
    coord = cases.coordinate(model, CoordinatorConfig(module_granularity_threshold=10**6))
    logs = cases.release_logs(handler)
    leaves = coord.leaf_modules
    coord.remove()
    return leaves, [message for level, message in logs if level == "WARNING"]


def test_a_threshold_on_a_model_without_blocks_says_no_module_can_be_a_leaf(dist):
    ((leaves, warnings),) = dist.run(1, _flat_model_threshold)
    assert leaves == ()
    assert len(warnings) == 1 and "no module of Sequential can be a leaf" in warnings[0], warnings


def test_a_threshold_selecting_nothing_or_most_of_the_model_is_a_warning(dist):
    _, attn, root = _block_granularity(7)
    ((leaves, warnings),) = dist.run(1, _installed_with_threshold, 1)
    assert leaves == ()
    assert len(warnings) == 1 and f"smallest granularity is {attn} (blocks.0.attn)" in warnings[0][1]
    ((leaves, warnings),) = dist.run(1, _installed_with_threshold, root)
    assert leaves == ("",)  # the whole model as one leaf: gathered whole, said so
    assert len(warnings) == 1 and "makes <root> one leaf: 2528 of the model's 2528" in warnings[0][1]
    ((leaves, warnings),) = dist.run(1, _installed_with_threshold, _block_granularity(7)[0])
    assert len(leaves) == 3 and warnings == []  # a block is 658 of 2528 elements
