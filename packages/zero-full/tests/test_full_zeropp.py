"""ZeRO++ through the engine: qwZ, hpZ, qgZ (with error feedback), alone and combined.

References: plain ZeRO-3 on the same data (hpZ must equal it; quantized variants stay within a
bound), ``dequantize(quantize(shard))`` for the qwZ gather, the ledger's per-group counts for
hpZ's node-local backward, the layout rules for bad input.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_full
import zero_params
from zero_comm import CommLedger, Topology, padded_numel, partition_numel
from zero_full.wiring.zeropp import check_zeropp_layout
from zero_kernels import dequantize, quantize
from zero_testing.models import TanhMLP

BATCH = 8
LR = 0.05


def _net(seed: int = 0) -> TanhMLP:
    """Weights of 240 and 140 elements (divisible by 4: qgZ quantizes them) and 21 (reduced exactly)."""
    return TanhMLP(12, 20, 7, 3, seed=seed)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)


def _config(precision: str = "fp32", accumulation: int = 1, **zero) -> dict:
    cfg: dict = {
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _sgd(ps):
    return torch.optim.SGD(ps, lr=LR, momentum=0.9)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zero_full.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _train(rank, zero: dict, steps: int, precision: str = "fp32", accumulation: int = 1):
    model = _net()
    engine = zero_full.initialize(
        model, _config(precision, accumulation, **zero), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9)
    )
    world, r = rank.world_size, rank.rank
    n = BATCH // world
    losses = []
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for step in range(steps * accumulation):
        x, y = (t.to(dtype) for t in _data(step))
        loss = engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    weights = _full(model)
    engine.close()
    return losses, weights


QWZ = {"zero_quantized_weights": True}
HPZ = {"zero_hpz_partition_size": 2}
QGZ = {"zero_quantized_gradients": True}
LOCO = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
ALL = {**QWZ, **HPZ, **QGZ}


# --------------------------------------------------------------------------- hpZ is exact


def test_hpz_trains_exactly_like_plain_zero3_at_2x2(dist):
    plain = dist.run(4, _train, {}, 6, ranks_per_node=2)
    hpz = dist.run(4, _train, HPZ, 6, ranks_per_node=2)
    for (lp, wp), (lh, wh) in zip(plain, hpz, strict=True):
        assert lh == pytest.approx(lp, rel=1e-6)
        for name, value in wp.items():
            torch.testing.assert_close(wh[name], value, rtol=1e-6, atol=1e-7)


def _hpz_ledger(rank):
    model = _net()
    # release after each module, so backward gathers again
    release = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0}
    engine = zero_full.initialize(model, _config(**HPZ, **release), lambda ps: torch.optim.SGD(ps, lr=LR))
    topo = Topology()
    r, n = rank.rank, BATCH // rank.world_size
    counts = []
    for step in range(2):
        x, y = _data(step)
        with CommLedger(topo) as fwd:
            loss = engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n])
        with CommLedger(topo) as bwd:
            engine.backward(loss)
        engine.step()
        stale = [zero_params.state_of(p).secondary_valid for p in model.parameters()]
        counts.append(
            (
                fwd.count("all_gather", "inter_node"),
                bwd.count("all_gather", "inter_node"),
                bwd.count("all_gather", "intra_node"),
                any(stale),
            )
        )
    engine.close()
    return counts


def test_hpz_backward_gathers_only_inside_the_node(dist):
    for counts in dist.run(4, _hpz_ledger, ranks_per_node=2):
        for fwd_inter, bwd_inter, bwd_intra, any_valid_after_step in counts:
            assert fwd_inter > 0  # the forward gathers over the world (2 nodes)
            assert bwd_inter == 0  # backward: secondary shards only
            assert bwd_intra > 0
            assert not any_valid_after_step  # the optimizer step invalidated every secondary shard


# --------------------------------------------------------------------------- qwZ


def _qwz_gather(rank):
    model = _net()
    engine = zero_full.initialize(model, _config(**QWZ), lambda ps: torch.optim.SGD(ps, lr=LR))
    ref = _net()
    out = {}
    for name, p in model.named_parameters():
        with zero_full.GatheredParameters([p]):
            out[name] = p.detach().clone()
        full = dict(ref.named_parameters())[name].detach().reshape(-1)
        world = rank.world_size
        part = partition_numel(full.numel(), world)
        padded = torch.zeros(padded_numel(full.numel(), world))
        padded[: full.numel()] = full
        pieces = [
            dequantize(quantize(padded[i * part : (i + 1) * part], _qwz_config())) for i in range(world)
        ]
        out[name + ".expected"] = torch.cat(pieces)[: full.numel()].view_as(out[name])
    engine.close()
    return out


def _qwz_config():
    from zero_comm.quantized import QWZ_DEFAULT_CONFIG

    return QWZ_DEFAULT_CONFIG


@pytest.mark.parametrize("world", [2, 4])
def test_qwz_gather_equals_dequant_of_quant_per_shard(dist, world):
    for out in dist.run(world, _qwz_gather):
        for name in [k for k in out if not k.endswith(".expected")]:
            assert torch.equal(out[name], out[name + ".expected"]), name
            assert not torch.equal(out[name], dict(_net().named_parameters())[name].detach()), name


# --------------------------------------------------------------------------- qgZ


def _grad_partitions(rank, zero: dict):
    model = _net()
    engine = zero_full.initialize(
        model, _config(accumulation=2, **zero), lambda ps: torch.optim.SGD(ps, lr=LR)
    )
    r, n = rank.rank, BATCH // rank.world_size
    x, y = _data(0)
    engine.backward(engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
    engine.step()  # not a boundary: the reduced gradients stay in the partitions
    grads = {
        name: zero_params.state_of(p).grad_partition.detach().clone() for name, p in model.named_parameters()
    }
    engine.close()
    return grads


@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 2)])
def test_qgz_reduces_matrices_quantized_and_vectors_exactly(dist, world, per_node):
    exact = dist.run(world, _grad_partitions, {}, ranks_per_node=per_node)
    quant = dist.run(world, _grad_partitions, QGZ, ranks_per_node=per_node)
    for ge, gq in zip(exact, quant, strict=True):
        for name, ref in ge.items():
            got = gq[name]
            if name.endswith("bias") or name == "c.weight":  # 1-D or numel not divisible: exact fallback
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8)
                continue
            # two int4 hops: |err| <= 2**-3 * (2 + 2**-3) * sum_r A_r / W <= 0.27 * max_r A_r;
            # the partition's own absmax bounds the average's scale from below, so test a loose bound
            bound = 0.27 * ref.abs().max() * world
            assert (got - ref).abs().max() <= bound, name
            assert not torch.equal(got, ref), name  # it really went through int4


# --------------------------------------------------------------------------- combined, bf16, accumulation


@pytest.mark.parametrize(
    "zero,tol",
    [(QWZ, 0.02), (QGZ, 0.05), (LOCO, 0.05), (ALL, 0.05)],
    ids=["qwz", "qgz", "qgz+loco", "all"],
)
def test_quantized_variants_track_plain_zero3_at_2x2(dist, zero, tol):
    plain = dist.run(4, _train, {}, 12, ranks_per_node=2)
    variant = dist.run(4, _train, zero, 12, ranks_per_node=2)
    for (lp, _), (lv, _) in zip(plain, variant, strict=True):  # each rank's own micro-batches
        assert lv[0] == pytest.approx(lp[0], rel=tol)
        assert sum(lv[-4:]) == pytest.approx(sum(lp[-4:]), rel=tol)
        assert lv != lp  # quantization changed the numbers


def test_all_three_with_bf16_and_accumulation(dist):
    plain = dist.run(4, _train, {}, 4, "bf16", 2, ranks_per_node=2)
    variant = dist.run(4, _train, ALL, 4, "bf16", 2, ranks_per_node=2)
    for (lp, _), (lv, _) in zip(plain, variant, strict=True):
        assert all(torch.isfinite(torch.tensor(lv)))
        assert sum(lv[-4:]) == pytest.approx(sum(lp[-4:]), rel=0.05)


# --------------------------------------------------------------------------- checkpoints


def _ckpt_round_trip(rank, root: str, first: dict, second: dict):
    model = _net()
    engine = zero_full.initialize(
        model, _config(**first), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9)
    )
    r, n = rank.rank, BATCH // rank.world_size
    for step in range(3):
        x, y = _data(step)
        engine.backward(engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
        engine.step()
    engine.save_checkpoint(root, tag="t")
    saved = engine.consolidated_state_dict()
    engine.close()
    other = _net(seed=5)
    engine2 = zero_full.initialize(
        other, _config(**second), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9)
    )
    engine2.load_checkpoint(root, tag="t")
    loaded = engine2.consolidated_state_dict()
    engine2.close()
    return saved, loaded


@pytest.mark.parametrize("first,second", [(ALL, {}), ({}, ALL)], ids=["zeropp-to-zero3", "zero3-to-zeropp"])
def test_checkpoints_hold_the_exact_master_across_zeropp_and_zero3(dist, tmp_path, first, second):
    results = dist.run(4, _ckpt_round_trip, str(tmp_path), first, second, ranks_per_node=2)
    saved, loaded = results[0]
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "zero,world,per_node,needles",
    [
        ({"zero_hpz_partition_size": 3}, 4, 2, ["= 3", "does not divide the world size 4"]),
        ({"zero_hpz_partition_size": 4}, 8, 2, ["= 4", "larger than a node", "2 ranks"]),
        ({"zero_hpz_partition_size": 2}, 6, 3, ["= 2", "does not divide the 3 ranks"]),
        ({"zero_quantized_gradients": True}, 6, 4, ["zero_quantized_gradients = true", "whole nodes", "6"]),
        ({"zero_hpz_partition_size": 2, "mics_shard_size": 2}, 4, 2, ["hpz_partition_size = 2", "MiCS"]),
        ({"zero_quantized_gradients": True, "mics_shard_size": 2}, 4, 2, ["quantized_gradients", "MiCS"]),
        (
            {"zero_quantized_weights": True, "mics_shard_size": 4, "mics_hierarchical_params_gather": True},
            4, 2, ["zero_quantized_weights = true", "mics_hierarchical_params_gather"],
        ),
    ],
)  # fmt: skip
def test_bad_layouts_name_key_value_and_rule(zero, world, per_node, needles):
    z = zero_full.ZeroConfig.model_validate(_config(**zero)).zero_optimization
    with pytest.raises(ValueError) as info:
        check_zeropp_layout(z, world, per_node)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize(
    "zero,world,per_node", [(ALL, 4, 2), (HPZ, 8, 4), ({**QWZ, "mics_shard_size": 2}, 4, 2)]
)
def test_good_layouts_pass(zero, world, per_node):
    check_zeropp_layout(
        zero_full.ZeroConfig.model_validate(_config(**zero)).zero_optimization, world, per_node
    )


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    "key,value",
    [
        ("zero_quantized_weights", True),
        ("zero_quantized_gradients", True),
        ("zero_hpz_partition_size", 2),
        ("zero_quantized_nontrainable_weights", True),
    ],
)
def test_zeropp_below_stage_3_is_an_error(stage, key, value):
    with pytest.raises(ValueError) as info:
        zero_full.ZeroConfig.model_validate({"zero_optimization": {"stage": stage, key: value}})
    assert (
        key in str(info.value) and f"stage {stage}" in str(info.value) and "needs stage 3" in str(info.value)
    )


def test_loco_without_qgz_is_an_error():
    with pytest.raises(ValueError, match="zeropp_loco_param.*zero_quantized_gradients = true"):
        zero_full.ZeroConfig.model_validate(_config(zeropp_loco_param={"err_beta": 0.5}))
    with pytest.raises(ValueError, match="err_beta"):
        zero_full.ZeroConfig.model_validate(_config(**QGZ, zeropp_loco_param={"err_beta": 1.5}))


def _initialize_with_local_world(rank, local: str, zero: dict):
    old = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = local
    try:
        zero_full.initialize(_net(), _config(**zero))
    except ValueError as err:
        return str(err)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = old
    return "no error"


def test_initialize_refuses_a_bad_layout_by_key(dist):
    for msg in dist.run(2, _initialize_with_local_world, "3", QGZ):
        assert "zero_quantized_gradients = true needs a world of whole nodes" in msg
    for msg in dist.run(2, _initialize_with_local_world, "1", HPZ):
        assert "zero_hpz_partition_size = 2 is larger than a node" in msg


# --------------------------------------------------------------------------- memory: estimator and report


def test_estimate_adds_the_hpz_secondary_shard():
    from zero_full.memory.estimate import estimate_model_states

    est = estimate_model_states(1000, 4, "mixed", (3,), None, 2)
    plain, hpz = est.stages
    assert hpz.name == "ZeRO-3 + hpZ 2"
    assert hpz.total_bytes - plain.total_bytes == 2 * 1000 / 2  # + P/n elements of 2 bytes
    fp32 = estimate_model_states(1000, 4, "fp32", (3,), None, 4).stages[-1]
    assert fp32.params_bytes == 4 * 1000 / 4 + 4 * 1000 / 4
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3"):
        estimate_model_states(1000, 4, "mixed", (3,), None, 3)


def test_cli_estimate_hpz(capsys):
    from zero_full.cli.main import main

    assert main(["estimate", "--params", "1M", "--world", "4", "--hpz", "2", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 + hpZ 2" in out and "16P/N + 2P/n" in out and "1.5 MB" in out


def _memory(rank, zero: dict):
    model = _net()
    engine = zero_full.initialize(model, _config(**zero), _sgd)
    r, n = rank.rank, BATCH // rank.world_size
    x, y = _data(0)
    engine.backward(engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
    engine.step()
    report = engine.memory_report()
    secondary = sum(
        zero_params.state_of(p).secondary_shard.numel() * 4
        for p in model.parameters()
        if zero_params.state_of(p).secondary_shard is not None
    )
    out = (report.formula, report.formula_bytes, engine.model_state_bytes(), secondary)
    engine.close()
    return out


def test_memory_report_counts_the_secondary_shard(dist):
    plain = dist.run(4, _memory, {}, ranks_per_node=2)
    hpz = dist.run(4, _memory, HPZ, ranks_per_node=2)
    numel = sum(p.numel() for p in _net().parameters())
    for (f0, b0, s0, _), (f1, b1, s1, sec) in zip(plain, hpz, strict=True):
        assert "hpZ" in f1 and "hpZ" not in f0
        assert b1 - b0 == pytest.approx(4 * numel / 2)  # fp32: + 4 P/n bytes
        assert sec > 0 and s1 - s0 == sec  # the engine's counter sees exactly the secondary shards


# --------------------------------------------------------------------------- Init, fp16


def _init_and_fp16(rank):
    config = _config("fp16", **ALL, zeropp_loco_param={"err_beta": 0.5, "reset_T": 2})
    with zero_full.Init(config=config):
        model = _net()
    kinds = {
        type(s).__name__
        for p in model.parameters()
        for s in (
            zero_params.state_of(p).gather_strategy,
            zero_params.state_of(p).reduce_strategy,
            zero_params.state_of(p).secondary_strategy,
        )
    }
    engine = zero_full.initialize(model, config, _sgd)
    feedback = engine._pipeline.pieces.feedback  # the strategies the Init-built parameters use
    r, n = rank.rank, BATCH // rank.world_size
    losses = []
    for step in range(3):
        x, y = (t.half() for t in _data(step))
        loss = engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out = (kinds, len(feedback), [f.steps for f in feedback], losses)
    engine.close()
    return out


def test_init_built_model_gets_the_zeropp_strategies_and_trains_in_fp16(dist):
    for kinds, n_feedback, steps, losses in dist.run(4, _init_and_fp16, ranks_per_node=2):
        assert kinds == {"QuantizedAllGather", "ErrorFeedbackReduceScatter", "FlatAllGather"}
        assert n_feedback == 1 and steps == [3]
        assert all(torch.isfinite(torch.tensor(losses)))


def test_quantized_nontrainable_weights_is_implemented_not_ignored():
    cfg = zero_full.ZeroConfig.model_validate(_config(zero_quantized_nontrainable_weights=True))
    assert "zero_optimization.zero_quantized_nontrainable_weights" not in cfg.ignored_keys()
    assert cfg.unsupported_features() == []


def test_estimate_int8_frozen_entry():
    from zero_full.memory.estimate import estimate_model_states

    est = estimate_model_states(10_000, 4, "mixed", (3,), frozen_int8_params=6144)
    plain, frozen = est.stages
    assert frozen.name == "ZeRO-3 + int8 frozen" and frozen.frozen_int8 == 6144
    trainable = 10_000 - 6144
    assert frozen.params_bytes == 2 * trainable / 4 + 6144 * (1 + 4 / 2048) / 4
    assert frozen.gradients_bytes == 2 * trainable / 4 and frozen.optimizer_bytes == 12 * trainable / 4
    with pytest.raises(ValueError, match="frozen_int8_params=20000"):
        estimate_model_states(10_000, 4, frozen_int8_params=20_000)


@pytest.mark.parametrize("mics", [None, 2])
def test_estimate_int8_frozen_entry_adds_mics_group_and_hpz_secondary(mics):
    from zero_full.memory.estimate import EstimatePrecision, estimate_model_states

    psi, frozen, world = 10_000, 6144, 4
    est = estimate_model_states(psi, world, "mixed", (3,), mics, 2, frozen)
    last = est.stages[-1]
    group = mics or world
    trainable = psi - frozen
    assert last.params_bytes == 2 * trainable / group + frozen * (1 + 4 / 2048) / group + 2 * psi / 2
    assert last.gradients_bytes == 2 * trainable / group and last.optimizer_bytes == 12 * trainable / group
    hpz = est.stages[-2]  # the hpZ entry is over the same group
    assert hpz.params_bytes == 2 * psi / group + 2 * psi / 2
    over = "S" if mics else "N"
    assert last.formula(EstimatePrecision.MIXED) == f"16T/{over} + 1.002F/{over} + 2P/n"
    assert last.formula(EstimatePrecision.FP32).endswith(" + 4P/n")
    prefix = "MiCS shard 2" if mics else "ZeRO-3"
    assert [s.name for s in est.stages[-2:]] == [f"{prefix} + hpZ 2", f"{prefix} + hpZ 2 + int8 frozen"]


def test_cli_estimate_frozen_int8(capsys):
    from zero_full.cli.main import main

    assert main(["estimate", "--params", "1M", "--world", "4", "--frozen-int8", "900k", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 + int8 frozen" in out and "16T/N + 1.002F/N" in out
    args = ["estimate", "--params", "1M", "--world", "4", "--frozen-int8", "900k", "--hpz", "2"]
    assert main([*args, "--stage", "3", "--mics-shard-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("MiCS shard (S)") == 1 and out.count("hpZ group (n)") == 1
    assert "MiCS shard 2 + hpZ 2 + int8 frozen  16T/S + 1.002F/S + 2P/n" in out


def _persistent_after_steps(rank):
    model = _net()
    config = _config(**QWZ)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 25  # biases + c.weight whole
    engine = zero_full.initialize(model, config, _sgd)
    r, n = rank.rank, BATCH // rank.world_size
    for step in range(2):
        x, y = _data(step)
        engine.backward(engine(x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]))
        engine.step()
    whole = {
        name: p.detach().clone() for name, p in model.named_parameters() if zero_params.state_of(p).persistent
    }
    master = engine.consolidated_state_dict()
    engine.close()
    return whole, master


def test_qwz_refreshes_whole_parameters_exactly(dist):
    results = dist.run(4, _persistent_after_steps, ranks_per_node=2)
    master = results[0][1]  # the consolidated fp32 master (rank 0)
    for whole, _ in results:
        assert set(whole) == {"a.bias", "b.bias", "c.weight", "c.bias"}
        for name, value in whole.items():
            assert torch.equal(value, master[name]), name  # not int8-rounded
