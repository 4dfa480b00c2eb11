"""MiCS end to end: parity with one process, the communication pattern, memory, checkpoints.

* Parity (DESIGN.md yardstick): world 4, ``mics_shard_size=2``, with and without the
  hierarchical gather, ``gradient_accumulation_steps`` 1 and 4 — per-step losses within
  1e-5 of one process over 20 steps (AdamW), final parameters within 1e-5 (SGD + momentum).
  2 nodes x 2 ranks keeps a shard group of 2 on one node, where a hierarchical gather has
  nothing to do (it is refused); the hierarchical cases therefore run shard groups that
  span 2 nodes: shard 2 over 4 nodes x 1 rank (replicas 2) and shard 4 over 2 nodes x 2
  ranks (the true two-hop gather).
* Communication, from a ``CommLedger``: every gather and reduce-scatter of a micro-step is
  inside the shard group; the replicate-group all-reduce happens once per optimizer step;
  with the hierarchical gather, inter-node bytes per gather are ``(k - 1) / p`` of the
  gathered bytes (docs/mics.md).
* Model-state bytes per rank = 16 * sum(ceil(numel / p)) for fp32 AdamW.
* Checkpoints: one copy per partition; MiCS world 4 -> ZeRO-3 world 2 and ZeRO-3 / stage 2
  world 2 -> MiCS world 4 continue with the same losses (1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch
from models import (
    assert_ranks_agree_and_match,
    build,
    make_optimizer,
    reference_run,
    save_then_continue,
    train_steps,
    zero_config,
    zero_run,
)

import zero_full
import zero_params
from zero_comm import CommLedger, LinkKind, Topology, partition_numel
from zero_optim import ReplicaMismatchError
from zero_testing import assert_losses_close
from zero_testing.models import OddMLP

STEPS = 20
BATCH = 8
X2X2, X4X1 = (4, 2), (4, 1)  # (world size, ranks per node)


def _mics(shard: int, hierarchical: bool = False, **zero) -> dict:
    return zero_config(mics_shard_size=shard, mics_hierarchical_params_gather=hierarchical, **zero)


# --------------------------------------------------------------------------- parity

PARITY = [
    # (topology, shard size, hierarchical, accumulation), ordered by topology (one pool each)
    (X2X2, 2, False, 1),
    (X2X2, 2, False, 4),
    (X2X2, 4, True, 1),
    (X2X2, 4, True, 4),
    (X4X1, 2, True, 1),
    (X4X1, 2, True, 4),
]


def _parity_id(case) -> str:
    (world, per_node), shard, hier, accum = case
    return f"{world // per_node}x{per_node}-shard{shard}-{'hier' if hier else 'flat'}-gas{accum}"


@pytest.mark.parametrize("topo,shard,hier,accum", PARITY, ids=[_parity_id(c) for c in PARITY])
def test_mics_matches_single_process_training(dist, topo, shard, hier, accum):
    world, per_node = topo
    for kind in ("adamw", "sgd"):
        config = _mics(shard, hier, gradient_accumulation_steps=accum, reduce_bucket_size=400)
        results = dist.run(world, zero_run, "mlp", kind, STEPS, BATCH, config, ranks_per_node=per_node)
        ref = reference_run("mlp", kind, STEPS, BATCH, accum, world)
        assert_ranks_agree_and_match(results, ref, kind)


# --------------------------------------------------------------------------- communication pattern


def _train(engine, name: str, start: int, steps: int, ledger: CommLedger | None = None) -> list[float]:
    """``steps`` optimizer steps from step ``start``; one ledger step per micro-step."""
    after_micro = ledger.step if ledger is not None else None
    return train_steps(engine, name, steps, BATCH, start=start, after_micro=after_micro)


def _ledger_run(rank, shard: int, hierarchical: bool, accum: int, steps: int) -> dict:
    config = _mics(
        shard,
        hierarchical,
        gradient_accumulation_steps=accum,
        stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=0,
    )
    engine = zero_full.initialize(build("gpt2"), config, make_optimizer("adamw"))
    ledger = CommLedger(Topology())
    with ledger:
        _train(engine, "gpt2", 0, steps, ledger)
    mics = engine.mics
    out = {
        "records": [
            (r.op, r.group_ranks, r.link.value, r.payload_bytes, r.wire_bytes, r.step) for r in ledger.records
        ],
        "shard": mics.shard_ranks,
        "replicate": mics.replicate_ranks,
        "grad_numel": sum(g.grad.numel() for g in engine.optimizer.groups),
        "numels": [zero_params.state_of(p).numel for p in engine.module.parameters()],
    }
    engine.close()
    return out


COMM = [(X2X2, 2, False), (X2X2, 4, True), (X4X1, 2, True)]


@pytest.mark.parametrize("topo,shard,hier", COMM, ids=[_parity_id((c[0], c[1], c[2], 4)) for c in COMM])
def test_communication_stays_in_shard_groups_and_replicas_sync_once_per_step(dist, topo, shard, hier):
    world, per_node = topo
    accum, steps = 4, 2
    results = dist.run(world, _ledger_run, shard, hier, accum, steps, ranks_per_node=per_node)
    for res in results:
        shard_ranks, replicate = set(res["shard"]), tuple(res["replicate"])
        micro_steps = accum * steps
        reduces = [r for r in res["records"] if r[0] == "all_reduce" and r[1] == replicate]
        # the second hop: one all-reduce of every gradient partition per optimizer step, at its boundary
        replicas = world // shard
        if replicas > 1:
            assert [r[5] for r in reduces] == [m for m in range(micro_steps) if m % accum == accum - 1]
            for r in reduces:
                assert r[3] == 4 * res["grad_numel"]  # the whole fp32 gradient partition, once
                assert r[4] == 2 * (replicas - 1) * r[3] // replicas  # 2 (Psi/p) (r-1)/r, in bytes
        else:
            assert reduces == []
        # the non-finite gradient check (robustness.nonfinite_gradients, no clipping): one 4-byte flag
        # per optimizer step, inside the shard group (replicas hold the same synced partitions)
        flags = [r for r in res["records"] if r[0] == "all_reduce" and set(r[1]) == shard_ranks and r[3] == 4]
        assert [r[5] for r in flags] == [m for m in range(micro_steps) if m % accum == accum - 1]
        for record in res["records"]:
            op, ranks = record[0], record[1]
            if op in ("all_gather", "reduce_scatter"):
                assert set(ranks) <= shard_ranks, (
                    f"{op} over {ranks} leaves the shard group {sorted(shard_ranks)}"
                )
            else:  # only the replicate-group sync and the flag (the ledger's mean loss is not zero-comm)
                assert op == "all_reduce" and (ranks == replicate or record in flags), (op, ranks)
        gathers = [r for r in res["records"] if r[0] == "all_gather"]
        assert gathers and all(any(r[5] == m for r in gathers) for m in range(micro_steps))
        rs = [r for r in res["records"] if r[0] == "reduce_scatter"]
        assert {r[5] for r in rs} == set(range(micro_steps))  # first hop: every micro-step
        # inside the shard group per micro-step: 3 Psi (p-1)/p (gather fwd + gather bwd + reduce-
        # scatter; Psi padded to the shard group), once the first step recorded the trace
        psi = sum(shard * partition_numel(n, shard) for n in res["numels"])
        for m in range(1, micro_steps):
            inside = sum(r[4] for r in gathers + rs if r[5] == m)
            assert inside == 3 * psi * (shard - 1) // shard * 4, (m, inside)
        if not hier:
            # shard groups live on one node: the only inter-node traffic is the boundary sync
            inter = [r for r in res["records"] if r[2] == LinkKind.INTER_NODE.value]
            assert inter == reduces
        else:
            _check_hierarchical_bytes(gathers, shard, per_node)


def _check_hierarchical_bytes(gathers: list, shard: int, per_node: int) -> None:
    """Inter-node bytes per gather = (k - 1) / p of the gathered bytes (k nodes per shard group)."""
    nodes = shard // per_node
    inter = [r for r in gathers if r[2] == LinkKind.INTER_NODE.value]
    assert inter and all(len(r[1]) == nodes for r in inter)
    for r in inter:
        gathered = shard * r[3]  # every rank's shard of the bucket
        assert r[4] * shard == (nodes - 1) * gathered
    if per_node > 1:  # a real second hop inside the node, carrying the node-stacked blocks
        intra = [r for r in gathers if r[2] == LinkKind.INTRA_NODE.value]
        assert len(intra) == len(inter)
        for a, b in zip(inter, intra):
            assert b[3] == nodes * a[3] and b[4] == (per_node - 1) * nodes * a[3]


# --------------------------------------------------------------------------- memory, replicas, Init


def _memory_and_replicas(rank, shard: int) -> dict:
    engine = zero_full.initialize(build("mlp"), _mics(shard), make_optimizer("adamw"))
    _train(engine, "mlp", 0, 3)
    numels = [zero_params.state_of(p).numel for p in engine.module.parameters()]
    out = {"bytes": engine.model_state_bytes(), "numels": numels, "ok": None, "perturbed": None}
    engine.check_replicas_consistent()  # passes after training: replicas stepped identically
    opt = engine.optimizer
    group = opt.groups[0]
    seg = next(s for s in group.segments if s.name == "hidden.weight")
    if rank.rank == 2:  # one replica of rank 0's partition drifts
        opt.torch_optimizer.state[group.master]["exp_avg"][seg.offset] += 1e-3
    try:
        engine.check_replicas_consistent()
    except ReplicaMismatchError as exc:
        out["perturbed"] = str(exc)
    engine.close()
    return out


def test_model_state_bytes_and_the_replica_consistency_check(dist):
    shard = 2
    results = dist.run(4, _memory_and_replicas, shard, ranks_per_node=2)
    numels = results[0]["numels"]
    psi = sum(numels)
    # after a step, fp32 AdamW: master 4 + exp_avg 4 + exp_avg_sq 4 bytes per element of the
    # shard-group partition (padding included; the gradient partition is freed once the step
    # applied it), plus AdamW's 4-byte step counter
    expected = 12 * sum(partition_numel(n, shard) for n in numels)
    assert 12 * psi / shard <= expected <= 12 * (psi / shard + len(numels))
    for res in results:
        assert res["bytes"] == expected + 4
    # the perturbed replicate group (ranks 0 and 2) fails naming itself, the tensor and the
    # parameter; the other replicate group (1 and 3) still agrees
    for r in (0, 2):
        msg = results[r]["perturbed"]
        assert msg is not None and "[0, 2]" in msg and "'exp_avg'" in msg and "'hidden.weight'" in msg, msg
    assert results[1]["perturbed"] is None and results[3]["perturbed"] is None


def _init_and_errors(rank, config: dict, bad: list[dict]) -> dict:
    errors = []
    for cfg in bad:
        for make in (lambda c: zero_full.Init(config=c), lambda c: zero_full.initialize(build("mlp"), c)):
            try:
                make(cfg)
            except ValueError as exc:
                errors.append(str(exc))
            else:
                errors.append(None)
    with zero_full.Init(config=config):
        model = build("mlp")
    states = [zero_params.state_of(p) for p in model.parameters()]
    layout = {(s.group_ranks, type(s.gather_strategy).__name__) for s in states}
    engine = zero_full.initialize(model, config, make_optimizer("adamw"))
    losses = _train(engine, "mlp", 0, 3)
    engine.close()
    plain = zero_full.initialize(build("mlp"), config, make_optimizer("adamw"))
    plain_losses = _train(plain, "mlp", 0, 3)
    plain.close()
    return {"errors": errors, "layout": sorted(layout), "losses": losses, "plain": plain_losses}


def test_init_partitions_over_the_shard_group_and_bad_layouts_name_the_numbers(dist):
    bad = [_mics(3), _mics(2, True), _mics(8)]
    config = _mics(4, True)  # 2 nodes x 2 ranks: the two-hop gather
    results = dist.run(4, _init_and_errors, config, bad, ranks_per_node=2)
    for res in results:
        assert res["layout"] == [((0, 1, 2, 3), "HierarchicalAllGather")]
        assert res["losses"] == res["plain"]  # Init builds the same model as partitioning it afterwards
        e = res["errors"]
        assert all(m is not None for m in e), e
        assert "mics_shard_size=3 does not divide world size 4" in e[0] and e[0] == e[1]
        assert "spanning >= 2 nodes" in e[2] and "mics_shard_size=2" in e[2] and "2 ranks per node" in e[2]
        assert e[2] == e[3]
        assert "mics_shard_size=8 does not divide world size 4" in e[4]


def _init_with_rank_seeds(rank) -> str | None:
    config = _mics(2)
    torch.manual_seed(rank.rank)  # every rank builds other values: replicas must be made equal
    with zero_full.Init(config=config):
        model = OddMLP()
    engine = zero_full.initialize(model, config, make_optimizer("adamw"))
    try:
        engine.check_replicas_consistent()  # replica-rank 0's shards were broadcast
        _train(engine, "mlp", 0, 2)
        engine.check_replicas_consistent()
    except ReplicaMismatchError as exc:
        return str(exc)
    finally:
        engine.close()
    return None


def test_replicas_of_a_model_built_under_init_start_equal(dist):
    assert dist.run(4, _init_with_rank_seeds, ranks_per_node=2) == [None] * 4


# --------------------------------------------------------------------------- checkpoints


def _stage_config(stage: int, shard: int = -1) -> dict:
    cfg = _mics(shard) if shard > 0 else zero_config()
    cfg["zero_optimization"]["stage"] = stage
    return cfg


def _save_then_continue(rank, root: str, config: dict, name: str) -> dict:
    engine = zero_full.initialize(build(name), config, make_optimizer("adamw"))
    return save_then_continue(engine, name, root, BATCH)


def _load_then_continue(rank, root: str, config: dict, name: str) -> dict:
    engine = zero_full.initialize(build(name), config, make_optimizer("adamw"))
    engine.load_checkpoint(root)
    engine.check_replicas_consistent()  # every replica read the same pieces
    weights = engine.consolidated_state_dict()
    nxt = _train(engine, name, 3, 3)
    engine.close()
    return {"losses": nxt, "weights": weights}


def _same_continuation(loaded: dict, saved: dict) -> None:
    for k, v in saved["weights"].items():  # re-partitioned exactly: the same bits
        assert torch.equal(loaded["weights"][k], v), k
    first, expected = loaded["losses"][0], saved["losses"][0]
    assert abs(first - expected) <= 1e-6 * max(1.0, abs(expected)), (loaded["losses"], saved["losses"])
    assert_losses_close(loaded["losses"], saved["losses"], rel=1e-5)


def _check_one_copy_per_partition(path, shard: int) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["partition_layout"] == {
        "kind": "mics",
        "shard_size": shard,
        "replicas": manifest["world_size"] // shard,
        "hierarchical_gather": False,
        "writer_ranks": list(range(shard)),
    }
    written: dict[str, int] = {}
    for f in manifest["files"]:
        for name, a, b in f["pieces"]:
            written[name] = written.get(name, 0) + (b - a)
        if f["rank"] >= shard:  # replicas write no parameter data (only their RNG states)
            assert f["pieces"] == [] and f["size"] < 16_384, f
    assert written == {p["name"]: p["numel"] for p in manifest["params"]}  # every element exactly once


@pytest.mark.parametrize("name", ["tied", "mlp"])
def test_mics_world_4_checkpoint_loads_as_zero3_at_world_2(dist, tmp_path, name):
    saved = dist.run(4, _save_then_continue, str(tmp_path), _stage_config(3, 2), name, ranks_per_node=2)[0]
    _check_one_copy_per_partition(tmp_path / "global_step3", 2)
    loaded = dist.run(2, _load_then_continue, str(tmp_path), _stage_config(3), name, ranks_per_node=2)[0]
    _same_continuation(loaded, saved)


@pytest.mark.parametrize("stage", [3, 2])
def test_zero_world_2_checkpoint_loads_into_mics_at_world_4(dist, tmp_path, stage):
    saved = dist.run(2, _save_then_continue, str(tmp_path), _stage_config(stage), "mlp", ranks_per_node=2)[0]
    loaded = dist.run(4, _load_then_continue, str(tmp_path), _stage_config(3, 2), "mlp", ranks_per_node=2)[0]
    _same_continuation(loaded, saved)


# --------------------------------------------------------------------------- clipping


def _clipped(rank, shard: int) -> dict:
    out = {}
    for label, cfg in (("zero3", zero_config()), ("mics", _mics(shard))):
        cfg["gradient_clipping"] = 0.05
        engine = zero_full.initialize(build("mlp"), cfg, make_optimizer("sgd"))
        norms, losses = [], []
        for step in range(4):
            losses += _train(engine, "mlp", step, 1)
            norms.append(engine._pipeline.last_grad_norm)
        engine.close()
        out[label] = norms
        out[label + "_losses"] = losses
    return out


def test_gradient_clipping_norm_counts_each_element_once(dist):
    """The global norm sums the shard group's partitions, not the replicas too (else x sqrt(r))."""
    for res in dist.run(4, _clipped, 2, ranks_per_node=2):
        for a, b in zip(res["mics"], res["zero3"]):
            assert abs(a - b) <= 1e-5 * b, (res["mics"], res["zero3"])
        assert min(res["zero3"]) > 0.05  # clipping was active in every step
        assert_losses_close(res["mics_losses"], res["zero3_losses"], rel=1e-5)
