"""ZeRO-3 on a simulated two-node cluster: network namespaces, a shaped veth link, loopback inside a node.

2 nodes x 2 ranks (``zero_testing.netns``), a tiny GPT-2, stage 3 in bf16 with parameters
released after each use, a few steps:

* the per-step losses are bit-equal to the same run on plain loopback (same collectives, only
  the transport differs);
* the bytes each node sends to the other, by the rank-pair model of ``zero_testing.traffic``
  from every rank's ``CommLedger`` records, equal the formula for gloo's algorithms: per step
  two ring all-gathers of M over the world group (one ring edge leaves each node:
  ``(W-1)/W * M`` each) and one all-to-all reduce-scatter (``r(W-r)/W * M`` per node), with M
  the padded model bytes in bf16; the ledger's ring-ideal inter-node bytes per rank are
  ``3M(W-1)/W`` (the papers' 3M); the veth counters agree with the model within 3%, up to
  what TCP sent again (``retransmitted_bytes``: on a loaded machine a late acknowledgement
  makes a sender repeat a 64 KiB segment, which then crosses the veth twice);
* every namespace of the run is gone afterwards (``ip netns list``), also when a rank fails.

Needs root and iproute2 (``ip``, ``tc``, ``ss``): skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.distributed as dist

from zero_testing import RankFailure, netns
from zero_testing.traffic import node_egress_bytes

pytestmark = netns.needs_cluster()

WORLD, PER_NODE, STEPS, VOCAB, SEQ = 4, 2, 3, 97, 16
RELEASED = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 4096,
}


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=128, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def _train(rank, on_cluster: bool) -> dict:
    import zero_full
    import zero_params
    from zero_comm import CommLedger, LinkKind, Topology, partition_numel

    config = {"bf16": {"enabled": True}, "zero_optimization": RELEASED}
    model = _gpt2()
    dist.barrier()  # ranks start at different times on a loaded machine; the watchdog waits 10 s
    engine = zero_full.initialize(model, config, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    numel = sum(partition_numel(zero_params.state_of(p).numel, WORLD) for p in engine.module.parameters())
    gen = torch.Generator().manual_seed(rank.rank)
    losses, steps = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        dist.barrier()
        tx0 = (netns.interface_counters(), netns.retransmitted_bytes()) if on_cluster else None
        dist.barrier()  # every rank has read the counters before any rank sends
        with CommLedger(Topology()) as ledger:
            loss = engine.module(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        dist.barrier()
        veth = None
        if tx0 is not None:
            veth = ((netns.interface_counters() - tx0[0]).payload_bytes, netns.retransmitted_bytes() - tx0[1])
        losses.append(loss.item())
        records = [(r.op, r.group_ranks, r.payload_bytes, r.wire_bytes) for r in ledger.records]
        steps.append((records, ledger.totals(link=LinkKind.INTER_NODE).wire_bytes, veth))
    engine.close()
    return {"losses": losses, "steps": steps, "model_bytes": 2 * WORLD * numel}


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_zero3_on_two_nodes_matches_loopback_and_sends_the_formula_bytes() -> None:
    with netns.SimulatedCluster(2, netns.LinkShape(rate_mbit=1000)) as cluster:
        names = set(cluster.namespaces())
        assert names <= _netns_names()
        ranks = netns.run_on_cluster(cluster, WORLD, _train, True, ranks_per_node=PER_NODE)
    assert not names & _netns_names(), f"namespaces left behind: {sorted(names & _netns_names())}"
    loopback = netns.run_on_cluster(None, WORLD, _train, False, ranks_per_node=PER_NODE)

    for r in range(WORLD):
        assert ranks[r]["losses"] == loopback[r]["losses"], f"rank {r}: losses differ from loopback"

    m = ranks[0]["model_bytes"]
    per_node = (2 * (WORLD - 1) / WORLD + PER_NODE * (WORLD - PER_NODE) / WORLD) * m
    for step in range(1, STEPS):  # step 0 records the trace; the formula holds from step 1
        records = [ranks[r]["steps"][step][0] for r in range(WORLD)]
        moving = [[rec for rec in recs if rec[0] in ("all_gather", "reduce_scatter")] for recs in records]
        # each reduce-scatter also carries the inf/nan check: one bf16 element per rank to every peer
        reductions = sum(1 for rec in records[0] if rec[0] == "reduce_scatter")
        sideband = reductions * PER_NODE * (WORLD - PER_NODE) * 2
        for node, egress in enumerate(node_egress_bytes(moving, PER_NODE)):
            assert egress == pytest.approx(per_node + sideband, rel=1e-9), (
                f"step {step} node {node}: gathers + reduce"
            )
        model = node_egress_bytes(records, PER_NODE)
        for node in range(2):
            what = f"step {step} node {node}"
            assert model[node] == pytest.approx(per_node, rel=0.01), f"{what}: all collectives"
            veth, again = ranks[node * PER_NODE]["steps"][step][2]
            bounds = f"veth {veth:,} B, of which up to {again:,} B sent again; model {model[node]:,.0f} B"
            assert veth >= 0.97 * model[node], f"{what}: the veth carried less: {bounds}"
            assert veth - again <= 1.03 * model[node], f"{what}: the veth carried more: {bounds}"
        for r in range(WORLD):
            ledger_inter = ranks[r]["steps"][step][1]
            assert ledger_inter == pytest.approx(3 * m * (WORLD - 1) / WORLD, rel=0.01), f"rank {r} ledger"


def _fail(rank) -> None:
    raise RuntimeError(f"planned failure on rank {rank.rank}")


def test_cluster_is_removed_when_a_rank_fails() -> None:
    with pytest.raises(RankFailure, match="planned failure"):
        with netns.SimulatedCluster(2, netns.LinkShape(rate_mbit=None)) as cluster:
            names = set(cluster.namespaces())
            netns.run_on_cluster(cluster, WORLD, _fail, ranks_per_node=PER_NODE, timeout=120)
    assert not names & _netns_names(), f"namespaces left behind: {sorted(names & _netns_names())}"
