"""The stage-3 engine: what it refuses, accumulation and loss scaling, memory, stats, Init, sync."""

from __future__ import annotations

import collections
import json
import logging

import pytest
import torch

import zero_full
import zero_params
from zero_comm import partition_numel
from zero_testing import captured_logs
from zero_testing.models import TanhMLP

BATCH = 8


def _net(seed: int = 0) -> TanhMLP:
    return TanhMLP(11, 13, 3, seed=seed)


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 11, generator=g), torch.randn(BATCH, 3, generator=g)


def _stage3(**zero):
    extra = {k: zero.pop(k) for k in list(zero) if k in ("gradient_accumulation_steps", "optimizer")}
    return {**extra, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _full(model):
    with zero_full.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "config,fragment",
    [
        (
            {"zero_optimization": {"stage": 3, "load_from_fp32_weights": False}},
            "load_from_fp32_weights = false",
        ),
    ],
)
def test_what_is_not_implemented_yet_is_refused_by_name(config, fragment):
    with pytest.raises(NotImplementedError, match="not implemented yet") as info:
        zero_full.initialize(_net(), config)
    assert fragment in str(info.value)


def test_every_unsupported_feature_is_named_at_once():
    config = {
        "zero_optimization": {"stage": 3, "load_from_fp32_weights": False, "ignore_unused_parameters": False}
    }
    with pytest.raises(NotImplementedError) as info:
        zero_full.initialize(_net(), config)
    assert "load_from_fp32_weights" in str(info.value) and "ignore_unused_parameters" in str(info.value)


def _ignored_keys_log(rank):
    with captured_logs("zero.engine", logging.WARNING) as messages:
        zero_full.initialize(_net(), {"zero_optimization": {"stage": 1, "reduce_scatter": False}}).close()
    return [m for m in messages if "did not simply take effect" in m]


def test_keys_without_effect_are_logged_with_the_reason(dist):
    """One WARNING table: the key, its value, what became of it and why."""
    ((message,),) = dist.run(1, _ignored_keys_log)
    (row,) = [line for line in message.splitlines() if line.startswith("zero_optimization.reduce_scatter")]
    assert row.split()[1:3] == ["false", "ignored"]
    assert "stages 1-3 always reduce-scatter gradients" in row


def _two_optimizers():
    config = _stage3(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(ValueError, match="keep one of them"):
        zero_full.initialize(_net(), config, lambda ps: torch.optim.SGD(ps, lr=0.1))
    engine = zero_full.initialize(_net(), config)
    opt = engine.optimizer.torch_optimizer
    with pytest.raises(ValueError, match="needs a scalar loss"):
        engine.backward(torch.ones(2, requires_grad=True))
    return type(opt).__name__, opt.param_groups[0]["lr"]


def test_the_config_optimizer_is_used_and_two_optimizers_are_refused(dist):
    assert dist.run(1, _two_optimizers) == [("SGD", 0.1)]


# --------------------------------------------------------------------------- accumulation


def _accumulate(rank, accumulation):
    model = _net()
    config = _stage3(gradient_accumulation_steps=accumulation)
    engine = zero_full.initialize(model, config, _sgd)
    world, r = rank.world_size, rank.rank
    trace = []
    for micro in range(2 * accumulation):
        x, y = _data(micro)
        n = BATCH // world
        engine.backward(engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        trace.append((boundary, engine.global_steps))
    return trace, _full(model)


def _reference(accumulation, steps=2, make_optimizer=_sgd):
    """Single-process training on the whole batches (``accumulation`` micro-batches of each step)."""
    model = _net()
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        parts = [_data(step * accumulation + m) for m in range(accumulation)]
        x, y = (torch.cat(t) for t in zip(*parts))
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,accumulation", [(1, 3), (2, 2)])
@pytest.mark.smoke
def test_steps_only_at_the_boundary_and_scales_the_loss(dist, world, accumulation):
    results = dist.run(world, _accumulate, accumulation)
    ref = _reference(accumulation)
    for trace, params in results:
        expected = [((m + 1) % accumulation == 0, (m + 1) // accumulation) for m in range(2 * accumulation)]
        assert trace == expected
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-6, atol=1e-7)


def _derived_accumulation(rank):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, **_stage3()}
    return zero_full.initialize(_net(), config).gradient_accumulation_steps


def test_accumulation_steps_are_derived_from_the_batch_sizes(dist):
    assert dist.run(2, _derived_accumulation) == [2, 2]


# --------------------------------------------------------------------------- reductions in flight


class _Recording(collections.deque):
    """The reduction's queue of handles in flight, recording the most it ever held."""

    most = 0

    def append(self, handle):
        super().append(handle)
        self.most = max(self.most, len(self))


def _queue_holder(engine, stage):
    """The object whose ``_inflight`` queue bounds the reductions in flight (stages 1 to 3)."""
    if stage == 3:
        return engine.coordinator._sink
    reduction = engine._pipeline.pieces.reduction
    return reduction.reducer if stage == 2 else reduction


def _train_inflight(rank, stage, inflight):
    model = _net()
    zero = {"stage": stage, "reduce_bucket_size": 20, "overlap_comm": True}  # 4 buckets, 1 parameter each
    if stage == 1:
        del zero["overlap_comm"]  # stage 1 always reduces during backward
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if inflight is not None:
        zero["reduce_max_inflight"] = inflight
    engine = zero_full.initialize(model, {"zero_optimization": zero}, _adamw)
    holder = _queue_holder(engine, stage)
    holder._inflight = queue = _Recording()
    r, n = rank.rank, BATCH // rank.world_size
    for step in range(3):
        x, y = _data(step)
        engine.backward(engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
        engine.step()
    ignored = engine.config.ignored_keys()
    return queue.most, _full(model), ignored


@pytest.mark.parametrize(("stage", "world"), [(1, 2), (2, 2), (3, 2), (2, 4)])
def test_reduce_max_inflight_bounds_the_reductions_in_flight_and_never_changes_numbers(dist, stage, world):
    """4 one-parameter buckets: the default keeps one reduction in flight, 3 lets three be; same bits."""
    default = dist.run(world, _train_inflight, stage, None)
    three = dist.run(world, _train_inflight, stage, 3)
    ref = _reference(1, steps=3, make_optimizer=_adamw)
    for (most_1, params_1, ignored_1), (most_3, params_3, ignored_3) in zip(default, three, strict=True):
        assert (most_1, most_3) == (1, 3)
        assert ignored_1 == ignored_3 == []
        for name, value in params_3.items():
            torch.testing.assert_close(value, params_1[name], rtol=0, atol=0)
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6)


def _gpt2():
    """A GPT-2 whose root and trunk have coarser granularity than its blocks (vocabulary 401 > 5 x 24)."""
    from zero_full.cli.train.workloads import GPT2Workload

    return GPT2Workload(layers=3, hidden=24, heads=3, vocab=401, seq=9, seed=0)


def _gpt2_granular(rank, threshold):
    w = _gpt2()
    model = w.build_model()
    zero = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0}
    if threshold is not None:
        zero["stage3_module_granularity_threshold"] = threshold
    engine = zero_full.initialize(model, _stage3(**zero), _sgd)
    r, n = rank.rank, 6 // rank.world_size
    for step in range(3):  # the reference's batches, this rank's rows
        ids = w.uniform_batch(step, 6)[r * n : (r + 1) * n]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return engine.coordinator.leaf_modules, engine.stats.params.gathers, _full(model)


def _gpt2_reference(world):
    w = _gpt2()
    model = w.build_model()
    opt = _sgd(model.parameters())
    for step in range(3):
        ids = w.uniform_batch(step, 6)
        n = 6 // world
        parts = [ids[r * n : (r + 1) * n] for r in range(world)]
        (sum(model(input_ids=part, labels=part).loss for part in parts) / world).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_module_granularity_threshold_gathers_each_gpt2_block_once_with_unchanged_numbers(dist, world):
    """DeepSpeed's ``stage3_module_granularity_threshold`` through ``initialize``: GPT-2 blocks
    (~1.3 hidden^2 elements per layer; their MLP ~2.7) become leaves, fewer gathers per step,
    the same parameters bit for bit as per-module gathering, and the single-process run's."""
    per_module = dist.run(world, _gpt2_granular, None)
    by_block = dist.run(world, _gpt2_granular, int(1.5 * 24 * 24))
    ref = _gpt2_reference(world)
    for (leaves0, gathers0, params0), (leaves, gathers, params) in zip(per_module, by_block, strict=True):
        assert leaves0 == ()
        assert leaves == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
        assert gathers < gathers0, (gathers, gathers0)
        for name, value in params.items():
            torch.testing.assert_close(value, params0[name], rtol=0, atol=0)
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- memory and stats


def _memory_and_stats(rank):
    model = _net()
    numels = [p.numel() for p in model.parameters()]
    engine = zero_full.initialize(model, _stage3(), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    before = engine.model_state_bytes()
    x, y = _data(0)
    engine.backward(engine(x, y))
    reduced = engine.model_state_bytes()
    engine.step()
    after = engine.model_state_bytes()
    padded = sum(partition_numel(n, rank.world_size) for n in numels)
    return before, reduced, after, padded, engine.stats


@pytest.mark.parametrize("world", [1, 2])
def test_model_state_bytes_count_shards_gradients_and_optimizer_state_once(dist, world):
    for before, reduced, after, padded, stats in dist.run(world, _memory_and_stats):
        # stage 3 holds its fp32 gradient partition from the backward that reduces into it until
        # the step has applied it
        assert before == 4 * padded  # fp32 master (= the shards)
        assert reduced == 8 * padded  # + the fp32 gradient partition
        assert after == 12 * padded + 4  # master, AdamW exp_avg and exp_avg_sq, its 4-byte step counter
        assert stats.global_steps == 1
        assert stats.params.gathers > 0 and stats.params.max_live_elements > 0
        if world > 1:
            # 2 modules gathered in forward and again in backward, one gradient reduce-scatter,
            # which carries the non-finite gradient check (fp32 without clipping: no all-reduce).
            assert stats.params.gathers == 4
            assert stats.comm.calls == stats.params.gathers + 1
            assert stats.comm.payload_bytes > 0
        else:
            assert stats.comm.wire_bytes == 0


# --------------------------------------------------------------------------- Init, sync, close


def _init_and_sync(rank):
    cfg = zero_full.ZeroConfig.model_validate(_stage3(stage3_param_persistence_threshold=13))
    with zero_full.Init(config=cfg):
        built = _net(seed=rank.rank)  # different seeds: Init keeps each rank's shard of its own values
    persistent = sorted(n for n, p in built.named_parameters() if zero_params.state_of(p).persistent)
    with zero_full.Init(config={"zero_optimization": {"stage": 2}}):
        whole = _net()
    whole_is_plain = not any(zero_params.is_partitioned(p) for p in whole.parameters())
    model = _net(seed=rank.rank)  # built whole with different seeds: initialize broadcasts rank 0's
    engine = zero_full.initialize(model, _stage3(), None)
    synced = _full(model)
    engine.close()
    x, y = _data(0)
    with pytest.raises(zero_params.PartitionedParameterError):
        engine(x, y)  # hooks removed: nothing gathers the parameters any more
    return persistent, whole_is_plain, synced


def test_init_from_config_and_initialize_syncs_rank_zero_values(dist):
    results = dist.run(2, _init_and_sync)
    rank0 = {n: p.detach() for n, p in _net(seed=0).named_parameters()}
    for persistent, whole_is_plain, synced in results:
        assert persistent == ["a.bias", "b.bias"]
        assert whole_is_plain
        for name, value in synced.items():
            assert torch.equal(value, rank0[name])


def _from_json(rank, path):
    return zero_full.initialize(_net(), path, None).coordinator.config.max_live_parameters


def test_config_from_a_json_file(dist, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_stage3(stage3_max_live_parameters=1234)))
    assert dist.run(1, _from_json, str(path)) == [1234]
