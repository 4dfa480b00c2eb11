"""communication_data_type through zero_full: bf16 / fp16 collectives of fp32 training, every stage."""

from __future__ import annotations

import pytest
import torch

import zero_comm
import zero_full
import zero_params
from zero_full.config.zero_config import Precision
from zero_testing.models import TanhMLP

BATCH = 12
STEPS = 6
# Measured (SGD + momentum, 6 steps, this model): the largest relative loss difference to the
# single-process fp32 run, world 2 / 4 — bf16: stages 0-2 (gradients only) 1.5e-5 / 9.0e-5,
# stage 3 (gradients and parameter gathers) 5.5e-4 / 5.5e-4; fp16: 2.9e-6 / 5.3e-6 and
# 4.7e-5 / 4.9e-5; fp32 collectives 1.9e-7 / 1.4e-7. The tolerances keep a ~4x margin.
LOSS_TOLERANCE = {"bf16": 2e-3, "fp16": 2e-4}


def _net() -> TanhMLP:
    return TanhMLP(11, 29, 5, 3)


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 11, generator=g), torch.randn(BATCH, 3, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _config(stage, comm, persistence=0):
    cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence}}
    if comm is not None:
        cfg["communication_data_type"] = comm
    return cfg


def _train(rank, stage, comm, persistence=0):
    world, r = rank.world_size, rank.rank
    engine = zero_full.initialize(_net(), _config(stage, comm, persistence), _sgd)
    losses = []
    n = BATCH // world
    with zero_comm.CommLedger(zero_comm.Topology()) as ledger:
        for step in range(STEPS):
            x, y = _data(step)
            loss = engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    ops = {op: ledger.totals(op).wire_bytes for op in ("all_gather", "reduce_scatter", "all_reduce")}
    ops["reduce_scatter_calls"] = sum(1 for r in ledger.records if r.op == "reduce_scatter")
    engine.close()
    return losses, ops


def _reference():
    model = _net()
    opt = _sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        world_losses = model(x, y)
        world_losses.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(world_losses.detach()))
    return losses


def _mean_losses(results):
    """Per step, the mean over ranks of the rank losses (each rank's batch slice is equal-sized)."""
    return [sum(r[0][s] for r in results) / len(results) for s in range(STEPS)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("comm", ["bf16", "fp16"])
def test_training_through_half_collectives_stays_near_the_single_process_run(dist, stage, comm):
    world = 2
    ref = _reference()
    half = dist.run(world, _train, stage, comm)
    full = dist.run(world, _train, stage, None)
    for step, (a, b) in enumerate(zip(_mean_losses(half), ref)):
        assert abs(a - b) <= LOSS_TOLERANCE[comm] * abs(b), f"step {step}: {a} vs {b}"
    assert _mean_losses(half) != _mean_losses(full)  # the collectives really rounded
    cast_ops, fp32_ops = half[0][1], full[0][1]
    if stage == 0:  # an fp32 all-reduce became a half reduce-scatter + all-gather of the same bytes
        assert fp32_ops["all_reduce"] > 2 * cast_ops["all_reduce"]
        moved = cast_ops["reduce_scatter"] + cast_ops["all_gather"] - fp32_ops["all_gather"]
        assert 2 * moved == fp32_ops["all_reduce"] - cast_ops["all_reduce"], (cast_ops, fp32_ops)
        return
    # stage 3 gathers parameters in half; stages 1 and 2 refresh their fp32 masters in fp32.
    # The plain fp32 reduce-scatter carries the inf/nan check: one fp32 element per rank (world - 1
    # on the wire) per call, where the cast path all-reduces a flag instead
    sideband = fp32_ops["reduce_scatter_calls"] * (world - 1) * 4
    assert fp32_ops["all_reduce"] == 0 < cast_ops["all_reduce"], (cast_ops, fp32_ops)
    assert 2 * cast_ops["reduce_scatter"] + sideband == fp32_ops["reduce_scatter"], (cast_ops, fp32_ops)
    expect = fp32_ops["all_gather"] // 2 if stage == 3 else fp32_ops["all_gather"]
    assert cast_ops["all_gather"] == expect, (cast_ops, fp32_ops)


def _stage3_world4(rank):
    # biases (29, 5 and 3 elements) stay whole: refreshed after each step through the bf16 gather
    return _train(rank, 3, "bf16", persistence=32)


def test_stage3_bf16_at_world_4_with_persistent_parameters(dist):
    ref = _reference()
    half = dist.run(4, _stage3_world4)
    for a, b in zip(_mean_losses(half), ref):
        assert abs(a - b) <= LOSS_TOLERANCE["bf16"] * abs(b)
    assert half[0][1]["all_gather"] > 0


def _init_built(rank):
    cfg = {**_config(3, "bf16"), "train_micro_batch_size_per_gpu": 1}
    with zero_full.Init(config=cfg):
        model = _net()
    states = [zero_params.state_of(p) for p in model.parameters()]
    kinds = (
        {type(s.gather_strategy).__name__ for s in states},
        {type(s.reduce_strategy).__name__ for s in states},
    )
    engine = zero_full.initialize(model, cfg, _sgd)
    engine.close()
    with zero_params.Init():
        plain = _net()
    try:
        zero_full.initialize(plain, cfg, _sgd)
    except ValueError as exc:
        return kinds, str(exc)
    return kinds, ""


def test_init_partitions_with_the_cast_strategies_and_a_plain_init_is_refused(dist):
    (gather, reduce), message = dist.run(2, _init_built)[0]
    assert gather == {"CastAllGather"} and reduce == {"CastReduceScatter"}
    assert "zero_full.Init(config=...)" in message


def test_the_key_is_validated_and_refused_with_mics():
    cfg = zero_full.ZeroConfig.model_validate({"communication_data_type": "BF16"})
    assert cfg.communication_data_type is Precision.BF16
    with pytest.raises(ValueError, match="expected one of"):
        zero_full.ZeroConfig.model_validate({"communication_data_type": "int8"})
    mics = zero_full.ZeroConfig.model_validate(
        {"communication_data_type": "bf16", "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    )
    assert any("communication_data_type" in f for f in mics.unsupported_features())


def _bf16_training(rank, comm):
    world, r = rank.world_size, rank.rank
    cfg = {**_config(2, comm), "bf16": {"enabled": True}}
    engine = zero_full.initialize(_net(), cfg, _sgd)
    n = BATCH // world
    losses = []
    with zero_comm.CommLedger(zero_comm.Topology()) as ledger:
        for step in range(STEPS):
            x, y = _data(step)
            loss = engine(x[r * n : (r + 1) * n].bfloat16(), y[r * n : (r + 1) * n].bfloat16())
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    engine.close()
    calls = sum(1 for r in ledger.records if r.op == "reduce_scatter")
    return losses, ledger.totals("reduce_scatter").wire_bytes, calls


def test_bf16_training_may_reduce_its_gradients_in_fp32(dist):
    wide = dist.run(2, _bf16_training, "fp32")
    plain = dist.run(2, _bf16_training, None)
    # fp32 on the wire: twice bf16's bytes; the plain bf16 one also carries the inf/nan check
    # (one bf16 element per rank and call, world - 1 = 1 of them on the wire)
    _, plain_bytes, plain_calls = plain[0]
    assert wide[0][1] == 2 * (plain_bytes - plain_calls * 2)
    for a, b in zip(_mean_losses(wide), _mean_losses(plain)):  # one bf16 rounding less per reduction
        assert abs(a - b) <= 2e-2 * abs(b)


def _chosen_reduce_scatter(rank):
    from zero_full.wiring.comm_dtype import comm_strategies

    def pick(stage, comm, backend=None):
        cfg = zero_full.ZeroConfig.coerce(_config(stage, comm))
        return type(comm_strategies(cfg, backend=backend).reduce_scatter).__name__

    return [
        pick(2, None),  # gloo: the exchange
        pick(2, None, "nccl"),
        pick(3, "fp32", "cpu:gloo,cuda:nccl"),  # the working dtype: nothing to cast
        pick(0, None, "nccl"),  # stage 0 all-reduces
        pick(1, "bf16", "nccl"),  # a cast asked for: the cast strategy
    ]


def test_the_reduce_scatter_follows_the_backend(dist):
    got = dist.run(2, _chosen_reduce_scatter)
    assert (
        got
        == [["NoneType", "NativeReduceScatter", "NativeReduceScatter", "NoneType", "CastReduceScatter"]] * 2
    )
