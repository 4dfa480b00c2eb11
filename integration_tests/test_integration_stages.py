"""Stages 0-3 train like one process (with clipping and accumulation); fp16 overflow; bf16 accuracy.

* Parity (DESIGN.md yardstick): stages 0, 1, 2, 3 at world 2 and 4 with
  ``gradient_clipping`` and ``gradient_accumulation_steps = 2``, against a single process
  on the whole global batch that clips with ``torch.nn.utils.clip_grad_norm_``: per-step
  losses within 1e-5 relative over 20 steps with AdamW; final parameters within 1e-5 with
  SGD + momentum; every rank holds bit-identical parameters.
* fp16 dynamic loss scaling: an inf injected into ONE rank's gradient skips the step on
  every rank (parameters unchanged, scale halved, one skipped step counted) and training
  continues.
* bf16 working parameters with fp32 masters stay within a stated tolerance of fp32.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from models import (
    CASES,
    assert_ranks_agree_and_match,
    build,
    global_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
    train_steps,
)

import zero_full
import zero_params
from zero_testing import assert_losses_close, captured_logs

STEPS = 20
BATCH = 8
ACCUMULATION = 2
CLIP = 0.3  # below the model's typical gradient norm (about 0.3-1.5): most steps are clipped
BF16_LOSS_REL = 2e-2  # measured: max per-step relative loss difference bf16 vs fp32 about 4e-3


def _config(stage: int, precision: str = "fp32", fp16: dict | None = None, **zero) -> dict:
    cfg = {
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, **zero},
    }
    if stage == 3:
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
    if precision == "fp16":
        cfg["fp16"] = fp16 or {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


@functools.cache
def _reference(name: str, kind: str) -> dict:
    """One process on the whole global batch, clipping with torch, gradients accumulated over micro-steps."""
    model = build(name)
    opt = make_optimizer(kind)(list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    losses, clipped = [], 0
    for step in range(STEPS):
        total = 0.0
        for m in range(ACCUMULATION):
            loss = model(*global_batch(name, step * ACCUMULATION + m, BATCH))
            (loss / ACCUMULATION).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        clipped += int(norm > CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(total / ACCUMULATION)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "clipped": clipped}


def _full_params(model, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        with zero_params.GatheredParameters(list(model.parameters())):
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _cast(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def stage_run(rank, name: str, kind: str, config: dict, inject_step: int = -1) -> dict:
    """Train with the engine; optionally put an inf into rank 1's gradient at ``inject_step``."""
    with captured_logs("zero.engine", logging.INFO) as messages:
        result = _stage_train(rank, name, kind, config, inject_step)
    return {**result, "log": [m for m in messages if "overflow" in m]}


def _stage_train(rank, name: str, kind: str, config: dict, inject_step: int) -> dict:
    world = dist.get_world_size()
    model = build(name)
    engine = zero_full.initialize(model, config, make_optimizer(kind))
    dtype = next(model.parameters()).dtype
    stage = engine.config.stage
    losses, before, after, scales = [], None, None, []
    for step in range(STEPS):
        total = 0.0
        if step == inject_step:
            before = _full_params(model, stage)
        for micro in range(ACCUMULATION):
            full = global_batch(name, step * ACCUMULATION + micro, BATCH)
            loss = engine(*_cast(rank_slice(full, rank.rank, world), dtype))
            engine.backward(loss)
            if step == inject_step and micro == ACCUMULATION - 1 and rank.rank == 1:
                _inject_inf(engine)
            engine.step()
            total += loss.float().item()
        scales.append(engine.stats.loss_scale)
        if step == inject_step:
            after = _full_params(model, stage)
        losses.append(mean_over_ranks(total / ACCUMULATION))
    params = _full_params(model, stage)
    skipped = engine.stats.skipped_steps
    engine.close()
    return {
        "losses": losses,
        "params": params,
        "before": before,
        "after": after,
        "scales": scales,
        "skipped": skipped,
    }


def _inject_inf(engine) -> None:
    """An inf in this rank's gradient partition (stages 1-3 reduce during the boundary backward)."""
    with torch.no_grad():
        engine.optimizer.groups[0].grads()[-1][-1] = float("inf")


W2, W4 = 2, 4
PARITY = [
    (W2, "mlp", 0, {"reduce_bucket_size": 300, "reduce_max_inflight": 2}),
    (W2, "mlp", 1, {"reduce_bucket_size": 300, "allgather_bucket_size": 500}),
    (W2, "mlp", 2, {"reduce_bucket_size": 300, "overlap_comm": True}),
    (W2, "mlp", 3, {"reduce_bucket_size": 300}),
    (W2, "tied", 1, {"reduce_bucket_size": 2_000}),  # one Parameter used twice (embedding = head)
    (W2, "tied", 2, {"reduce_bucket_size": 2_000, "overlap_comm": True}),
    (W4, "mlp", 0, {}),
    (W4, "mlp", 1, {"allgather_bucket_size": 200}),
    (W4, "mlp", 2, {"reduce_bucket_size": 500, "overlap_comm": False}),
    (W4, "mlp", 3, {"reduce_bucket_size": 1_000, "overlap_comm": True, "reduce_max_inflight": 3}),
]


@pytest.mark.parametrize("world,name,stage,zero", PARITY, ids=[f"{n}-stage{s}-w{w}" for w, n, s, _ in PARITY])
def test_stage_matches_single_process_with_clipping_and_accumulation(dist, world, name, stage, zero):
    """AdamW: losses within 1e-5; SGD + momentum: losses and final parameters within 1e-5."""
    for kind in ("adamw", "sgd"):
        ref = _reference(name, kind)
        assert ref["clipped"] >= STEPS // 2, (
            "clipping must be active in most steps for this test to mean much"
        )
        results = dist.run(world, stage_run, name, kind, _config(stage, **zero))
        assert_ranks_agree_and_match(results, ref, kind)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(dist, stage):
    """Rank 1's inf: every rank skips step 3 (params unchanged), the scale halves, training goes on."""
    results = dist.run(2, stage_run, "mlp", "adamw", _config(stage, "fp16"), 3)
    for r, res in enumerate(results):
        for n, p in res["before"].items():
            assert torch.equal(p, res["after"][n]), f"rank {r} changed {n} in the skipped step"
        assert res["skipped"] == 1, f"rank {r} counted {res['skipped']} skipped steps"
        assert res["scales"][2] == 256.0 and res["scales"][3] == 128.0, res["scales"]
        assert res["scales"][-1] == 128.0
        assert all(torch.isfinite(torch.tensor(res["losses"])))
        final = res["params"]
        assert any(not torch.equal(final[n], res["after"][n]) for n in final), "training did not continue"
        assert res["params"].keys() == results[0]["params"].keys()
        for n, p in res["params"].items():
            assert torch.equal(p, results[0]["params"][n]), f"rank {r} diverged from rank 0 in {n}"
    assert results[0]["log"] == [
        "zero: gradient overflow (inf/nan) on some rank: step skipped on every rank, loss scale 256 -> 128"
    ]
    assert results[1]["log"] == []  # reported once, by rank 0
    ref = _reference("mlp", "adamw")
    # fp16 (10-bit mantissa) with one step skipped: close to fp32 but not equal.
    assert_losses_close(results[0]["losses"][:3], ref["losses"][:3], rel=2e-2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_trains_within_tolerance_of_fp32(dist, stage):
    """bf16 working parameters, fp32 masters: per-step losses within BF16_LOSS_REL of fp32."""
    res = dist.run(2, stage_run, "mlp", "adamw", _config(stage, "bf16"))[0]
    ref = _reference("mlp", "adamw")
    rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"]))
    print(f"bf16 stage {stage}: max relative loss difference to fp32 {rel:.2e}")
    assert rel < BF16_LOSS_REL
    assert res["losses"][-1] < res["losses"][0] * 0.9, "bf16 training did not reduce the loss"
    assert not CASES["mlp"].per_rank


def test_fp16_with_the_default_scale_trains(dist):
    """DeepSpeed's defaults (scale 2**16, hysteresis 2): the scaled loss is formed in fp32, so
    a loss above 1 times 65536 does not overflow fp16; at most a few early steps are skipped."""
    res = dist.run(2, stage_run, "mlp", "adamw", _config(0, "fp16", {"enabled": True}))[0]
    assert res["skipped"] <= 2, res["scales"]
    assert res["losses"][-1] < res["losses"][0] * 0.9


def _init_bf16(rank):
    cfg = _config(3, "bf16")
    with zero_full.Init(config=cfg):
        model = build("mlp")
    engine = zero_full.initialize(model, cfg, make_optimizer("adamw"))
    losses = train_steps(engine, "mlp", STEPS, BATCH, dtype=torch.bfloat16)
    dtypes = {zero_params.state_of(p).shard.dtype for p in model.parameters()}
    engine.close()
    return dtypes, losses


def test_init_partitions_in_the_bf16_working_dtype(dist):
    """Under ``zero_full.Init`` with bf16 the shards are bf16 and training matches fp32 within tolerance."""
    ref = _reference("mlp", "adamw")
    for dtypes, losses in dist.run(2, _init_bf16):
        assert dtypes == {torch.bfloat16}
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
        assert rel < BF16_LOSS_REL, rel


def _collectives_per_micro_step(rank, stage: int) -> list[int]:
    """Collectives each backward issues with 4 accumulation micro-steps (stages 1 and 2)."""
    from zero_comm import CommLedger, Topology

    world = dist.get_world_size()
    config = dict(_config(stage), gradient_accumulation_steps=4)
    model = build("mlp")
    engine = zero_full.initialize(model, config, make_optimizer("sgd"))
    counts = []
    for micro in range(4):
        full = global_batch("mlp", micro, BATCH)
        loss = engine(*rank_slice(full, rank.rank, world))
        with CommLedger(Topology()) as ledger:
            engine.backward(loss)
        counts.append(ledger.count())
        engine.step()
    engine.close()
    return counts


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_communicates_only_at_the_boundary(dist, stage):
    """Stages 1 and 2 reduce inside the boundary micro-step's backward only, never in the others."""
    for counts in dist.run(2, _collectives_per_micro_step, stage):
        assert counts[:3] == [0, 0, 0], counts
        assert counts[3] > 0, counts
