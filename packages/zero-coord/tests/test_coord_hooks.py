"""Hook bookkeeping: remove() leaves nothing, unseen parameters fail with the fix, manual fetch."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from coord_cases import (
    ReduceScatterSink,
    TiedBranchModel,
    build,
    capture_coord_logs,
    coordinate,
    gathered_params,
    grad_hook_count,
    grad_partition_errors,
    hook_counts,
    over_worlds,
    rank_input,
    reference_grads,
    release_logs,
)
from torch import nn

import zero_params
from zero_coord import Coordinator, CoordinatorConfig, Phase, TraceState
from zero_coord._tree import collect_grad_tensors, replace_grad_tensors
from zero_testing.models import ReluMLP


def _remove_leaves_no_hooks(rank):
    model, _ = build(TiedBranchModel)
    coord = coordinate(model, None, ReduceScatterSink())
    before = {name: hook_counts(m) for name, m in model.named_modules()}
    grad_before = {name: grad_hook_count(p) for name, p in model.named_parameters()}
    model(rank_input(0, rank.rank, (2, 3), high=11)).sum().backward()
    coord.remove()
    after = {name: hook_counts(m) for name, m in model.named_modules()}
    grad_after = {name: grad_hook_count(p) for name, p in model.named_parameters()}
    try:
        model(rank_input(0, rank.rank, (2, 3), high=11))
        unhooked = "ran"
    except zero_params.PartitionedParameterError:
        unhooked = "PartitionedParameterError"
    coord.install()  # and it can be installed again
    out = model(rank_input(0, rank.rank, (2, 3), high=11))
    coord.remove()
    return before, grad_before, after, grad_after, unhooked, tuple(out.shape), gathered_params(model)


@over_worlds
def test_remove_takes_out_every_hook(dist, world):
    for before, grad_before, after, grad_after, unhooked, shape, leaks in dist.run(
        world, _remove_leaves_no_hooks
    ):
        # hooked: the root and every module with partitioned parameters (own or external)
        assert {n for n, c in before.items() if c} == {
            "",
            "embed",
            "block",
            "frozen",
            "left",
            "right",
            "head",
            "out",
        }
        assert all(c == 0 for c in after.values()), after
        # grad hooks on every trainable parameter (the frozen layer has none), none after remove()
        assert {n for n, c in grad_before.items() if c} == {
            "embed.weight", "block.weight", "block.bias", "left.weight", "left.bias",
            "right.weight", "right.bias", "empty", "head.bias",
        }  # fmt: skip
        assert all(c == 0 for c in grad_after.values()), grad_after
        assert unhooked == "PartitionedParameterError"
        assert shape == (2, 3, 11) and leaks == []


class ReadsOther(nn.Module):
    """Its forward reads ``other.weight`` without declaring it."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self._other = (other,)
        self.proj = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self._other[0].weight


class Unseen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(5, 5)
        self.user = ReadsOther(self.other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.user(x)


def _unseen_parameter(rank):
    model, ref = build(Unseen)
    coord = coordinate(model, None, ReduceScatterSink())
    x = rank_input(0, rank.rank, (3, 5))
    try:
        model(x)
        message = None
    except zero_params.PartitionedParameterError as error:
        message = str(error)
    clean = (coord.live_elements, gathered_params(model), coord.trace(Phase.TRAIN).state.name)
    coord.remove()
    zero_params.register_external_parameter(model.user, model.other.weight)  # the fix
    coord.install()
    out = model(x)
    out.sum().backward()
    with torch.no_grad():
        err = (out - ref(x)).abs().max().item()
    coord.remove()
    return message, clean, err


@over_worlds
def test_an_unseen_parameter_fails_naming_it_and_the_fix(dist, world):
    for message, clean, err in dist.run(world, _unseen_parameter):
        assert message is not None
        assert "'other.weight'" in message
        assert "forward of module 'user' (ReadsOther)" in message
        assert "zero_params.register_external_parameter(model.get_submodule('user'), " in message
        assert "model.get_parameter('other.weight'))" in message
        assert "zero_coord.set_leaf_modules(model, ['ReadsOther'])" in message
        assert message.count("[zero_coord]") == 1  # annotated once, by the innermost hooked module
        # the failed forward released what it had gathered and recorded no partial trace
        assert clean == (0, [], "RECORD")
        assert err == 0.0


def _manual_fetch_and_invalidate(rank):
    model, ref = build(ReluMLP)
    coord = coordinate(model, CoordinatorConfig(prefetch_bucket_size=50))
    layer = model.layers[1]
    coord.fetch(layer)
    coord.fetch(layer)  # holds nest
    status = [zero_params.state_of(p).status.name for p in layer.parameters()]
    with torch.no_grad():
        weight_ok = torch.equal(layer.weight, ref.layers[1].weight)
    coord.release(layer)
    still = gathered_params(model)
    coord.release(layer)
    after = gathered_params(model)
    handler = capture_coord_logs()
    x = rank_input(0, rank.rank, (2, 7))
    for _ in range(2):
        model(x).sum().backward()
    state_before = coord.trace(Phase.TRAIN).state.name
    coord.invalidate_traces()
    state_after = coord.trace(Phase.TRAIN).state.name
    model(x).sum().backward()  # records again, silently
    state_final = coord.trace(Phase.TRAIN).state.name
    records = release_logs(handler)
    coord.fetch(layer)
    coord.release_all()
    released = (coord.live_elements, gathered_params(model))
    with pytest.raises(ValueError, match="not a submodule"):
        coord.fetch(nn.Linear(2, 2))
    coord.remove()
    return status, weight_ok, still, after, (state_before, state_after, state_final), records, released


def test_manual_fetch_release_and_silent_invalidation(dist):
    status, weight_ok, still, after, states, records, released = dist.run(2, _manual_fetch_and_invalidate)[0]
    assert status == ["AVAILABLE", "AVAILABLE"] and weight_ok
    assert still == ["layers.1.weight", "layers.1.bias"] and after == []
    assert states == ("COMPLETE", "INVALID", "COMPLETE")
    assert records == []
    assert released == (0, [])


class _Checkpointed(ReluMLP):
    """Every layer under ``torch.utils.checkpoint`` (the first one plain when reentrant: a
    reentrant checkpoint needs an input that requires grad)."""

    reentrant = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for i, layer in enumerate(self.layers):
            if self.reentrant and i == 0:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.reentrant)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class _CheckpointedReentrant(_Checkpointed):
    reentrant = True


def _checkpointed(rank, reentrant: bool = False):
    Checkpointed = _CheckpointedReentrant if reentrant else _Checkpointed
    model, ref = build(Checkpointed)
    for m in (model, ref):
        m.layers[2].requires_grad_(False)  # frozen inside a checkpoint: read by its backward, no gradient
    sink = ReduceScatterSink()
    coord = coordinate(model, CoordinatorConfig(max_reuse_distance=0, max_live_parameters=1), sink)
    outs = []
    for step in range(3):
        x = rank_input(step, rank.rank, (3, 7))
        out = model(x)
        out.sum().backward()
        with torch.no_grad():
            outs.append((out - ref(x)).abs().max().item())
    inputs = [(rank_input(step, r, (3, 7)),) for step in range(3) for r in range(rank.world_size)]
    expected = reference_grads(ref, inputs, lambda out: out.sum(), rank.world_size)
    errors = grad_partition_errors(model, expected)
    trace_state = coord.trace(Phase.TRAIN).state
    coord.remove()
    return max(outs), max(errors.values()), sink.problems, trace_state, gathered_params(model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_recompute_is_gathered(dist, reentrant):
    # Released parameters' storages are empty: a recomputation must gather them again and keep
    # them (frozen ones too) until the backward that reads what it saved is done.
    for out_err, grad_err, problems, trace_state, leaks in dist.run(2, _checkpointed, reentrant):
        assert out_err == 0.0 and grad_err <= 1e-5
        assert problems == [] and leaks == []
        assert trace_state is TraceState.COMPLETE


def test_coordinator_rejects_bad_arguments():
    with pytest.raises(TypeError, match="needs an nn.Module"):
        Coordinator("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a CoordinatorConfig"):
        Coordinator(nn.Linear(2, 2), {"prefetch_bucket_size": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lacks on_grad_ready"):
        Coordinator(nn.Linear(2, 2), grad_sink=object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="call install"):
        Coordinator(nn.Linear(2, 2)).trace(Phase.TRAIN)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    extra: tuple
    step: int = 0


class _Pair(collections.namedtuple("_Pair", "a b")):
    pass


def test_nested_outputs_are_found_and_rebuilt_in_order():
    t = [torch.randn(2, requires_grad=True) for _ in range(5)]
    plain = torch.randn(2)
    od = collections.OrderedDict(x=t[3], y=plain)
    structure = (t[0], [plain, {"k": t[1]}], _Out(t[2], (od, 3)), _Pair(t[4], "s"))
    found = collect_grad_tensors(structure, [])
    assert [id(x) for x in found] == [id(x) for x in (t[0], t[1], t[2], t[3], t[4])]
    new = [x * 2 for x in found]
    rebuilt = replace_grad_tensors(structure, iter(new))
    assert rebuilt[0] is new[0] and rebuilt[1][0] is plain and rebuilt[1][1]["k"] is new[1]
    assert isinstance(rebuilt[2], _Out) and rebuilt[2].logits is new[2] and rebuilt[2].extra[1] == 3
    assert type(rebuilt[2].extra[0]) is collections.OrderedDict and rebuilt[2].extra[0]["x"] is new[3]
    assert isinstance(rebuilt[3], _Pair) and rebuilt[3].a is new[4] and rebuilt[3].b == "s"
    assert structure[0] is t[0] and od["x"] is t[3]  # the original is untouched


def _profiled(rank):
    model, _ = build(ReluMLP)
    coord = coordinate(model, CoordinatorConfig(), ReduceScatterSink())
    x = rank_input(0, rank.rank, (2, 7))
    model(x).sum().backward()  # record the trace so the profiled step prefetches
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    coord.remove()
    return sorted({e.name for e in prof.events() if e.name.startswith("zero.coord.")})


def test_profiler_sees_the_coordinator_phases(dist):
    names = dist.run(1, _profiled)[0]
    assert names == ["zero.coord.fetch", "zero.coord.prefetch", "zero.coord.release"]


def _recovers_and_unfreezes(rank):
    model, _ = build(TiedBranchModel)
    sink = ReduceScatterSink()
    coord = coordinate(model, CoordinatorConfig(max_reuse_distance=0), sink)
    ids = rank_input(0, rank.rank, (2, 3), high=11)
    model(ids).sum().backward()

    def boom(grad):
        raise RuntimeError("backward failed on purpose")

    # fails late in backward: after the pre-backward of head and out queued the final callback
    def arm(module, args, output):
        output.register_hook(boom)

    handle = model.embed.register_forward_hook(arm)
    out = model(ids)
    handle.remove()
    try:
        out.sum().backward()
        raised = False
    except RuntimeError:
        raised = True
    ends_after_failure = sink.ends
    model.frozen.requires_grad_(True)  # unfrozen after install: its gradient must reach the sink too
    sink.ready.clear()
    model(ids).sum().backward()
    result = (
        raised,
        ends_after_failure,
        sink.ends,
        "frozen.weight" in sink.ready,
        coord.live_elements,
        gathered_params(model),
        sink.problems,
    )
    coord.remove()
    return result


def test_a_failed_backward_and_unfreezing_are_handled(dist):
    for result in dist.run(2, _recovers_and_unfreezes):
        raised, ends_failed, ends, frozen_ready, live, leaks, problems = result
        assert raised and ends_failed == 1  # the failed backward never reached its final callback
        assert ends == 2  # ... and the next backward queues (and runs) its own
        assert frozen_ready and live == 0 and leaks == [] and problems == []
