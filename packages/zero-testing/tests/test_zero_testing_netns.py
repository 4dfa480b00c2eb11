"""The simulated cluster (network namespaces, shaped veth links) and the rank-pair traffic model.

The model is checked against arithmetic on hand-made records, and against the physical veth
counters for each collective gloo runs on 2 nodes x 2 ranks (root + iproute2 only).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from zero_comm.torch_compat import all_gather_single
from zero_testing.netns import (
    ClusterState,
    LinkShape,
    SimulatedCluster,
    interface_counters,
    needs_cluster,
    retransmitted_bytes,
    run_on_cluster,
)
from zero_testing.traffic import node_egress_bytes, pair_bytes

WORLD4 = (0, 1, 2, 3)


def test_ring_ops_send_everything_to_the_next_member() -> None:
    assert pair_bytes(1, [("all_gather", WORLD4, 7, 21)]) == {2: 21}
    assert pair_bytes(3, [("all_reduce", WORLD4, 1023, 1534)]) == {0: 1534}
    assert pair_bytes(2, [("quantized_all_gather", (0, 2), 5, 5)]) == {0: 5}


def test_spread_ops_and_broadcast() -> None:
    assert pair_bytes(0, [("all_to_all", WORLD4, 12, 9)]) == {1: 3, 2: 3, 3: 3}
    assert pair_bytes(2, [("reduce_scatter", (1, 2, 3), 9, 6)]) == {1: 3, 3: 3}
    assert pair_bytes(0, [("broadcast", WORLD4, 13, 9)]) == {1: 13, 2: 13, 3: 13}
    assert pair_bytes(1, [("broadcast", WORLD4, 0, 9)]) == {}
    assert pair_bytes(1, [("all_gather", (1,), 4, 0)]) == {}


def test_unknown_collective_and_foreign_group_are_errors() -> None:
    with pytest.raises(ValueError, match="no traffic model for collective 'gather'"):
        pair_bytes(0, [("gather", WORLD4, 1, 1)])
    with pytest.raises(ValueError, match="without that rank"):
        pair_bytes(0, [("all_gather", (1, 2), 1, 1)])
    with pytest.raises(ValueError, match="divide"):
        node_egress_bytes([[], [], []], 2)


def test_node_egress_of_world_gather_and_all_to_all_at_2x2() -> None:
    shard = 1009
    gathers = [[("all_gather", WORLD4, shard, 3 * shard)] for _ in WORLD4]
    # ring 0->1->2->3->0: one edge leaves each node, carrying 3 shards
    assert node_egress_bytes(gathers, 2) == [3 * shard, 3 * shard]
    a2a = [[("all_to_all", WORLD4, 4 * shard, 3 * shard)] for _ in WORLD4]
    assert node_egress_bytes(a2a, 2) == [4 * shard, 4 * shard]
    # inside a node nothing leaves it
    intra = [[("all_gather", (0, 1) if r < 2 else (2, 3), shard, shard)] for r in WORLD4]
    assert node_egress_bytes(intra, 2) == [0, 0]


def test_link_shape_tc_arguments() -> None:
    assert LinkShape(100, burst_kib=64, queue_ms=50).tc_args() == [
        "tbf",
        "rate",
        "100000kbit",
        "burst",
        "64kb",
        "latency",
        "50ms",
    ]
    assert LinkShape(None).tc_args() == []
    with pytest.raises(ValueError, match="positive"):
        LinkShape(0).tc_args()
    with pytest.raises(ValueError, match="nodes"):
        SimulatedCluster(0)


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_cluster()
def test_cluster_is_removed_on_interrupt() -> None:
    cluster = SimulatedCluster(3, LinkShape(50))
    with pytest.raises(KeyboardInterrupt):
        with cluster:
            assert set(cluster.namespaces()) <= _netns_names()
            assert len(cluster.tx_bytes()) == 3
            raise KeyboardInterrupt
    assert cluster.state is ClusterState.CLOSED
    assert not set(cluster.namespaces()) & _netns_names()
    with pytest.raises(RuntimeError, match="closed"):
        cluster.up()


_SIGTERM_CHILD = """
import sys, time
from zero_testing.netns import LinkShape, SimulatedCluster
with SimulatedCluster(2, LinkShape(None)) as cluster:
    print(" ".join(cluster.namespaces()), flush=True)
    time.sleep(120)
"""


@needs_cluster()
def test_sigterm_removes_the_cluster_and_stale_namespaces_are_collected() -> None:
    child = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD], stdout=subprocess.PIPE, text=True)
    names = set(child.stdout.readline().split())
    assert len(names) == 3 and names <= _netns_names()
    child.terminate()
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    assert not names & _netns_names()
    # a namespace left by a process that is gone (SIGKILL) is removed by the next cluster
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"zero-{gone.pid}-0-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with SimulatedCluster(1, LinkShape(None)):
        assert stale not in _netns_names()


def _collectives(rank) -> dict[str, tuple[int, int, list]]:
    """Each collective once on the world group: this node's veth payload, the bytes its TCP
    sent again in that window, and this rank's record."""
    n, world = 30011, rank.world_size
    shard, full = torch.ones(n), torch.ones(n * world)
    out = torch.empty(n * world)
    calls = {
        "all_gather": (lambda: all_gather_single(out, shard), n * 4 * (world - 1), n * 4),
        "all_to_all": (lambda: dist.all_to_all_single(out, full), n * 4 * (world - 1), n * 4 * world),
        "all_reduce": (lambda: dist.all_reduce(full), 2 * n * 4 * (world - 1), full.numel() * 4),
        "broadcast": (lambda: dist.broadcast(full, 0), 0, full.numel() * 4 if rank.rank == 0 else 0),
    }
    seen = {}
    for op, (call, wire, payload) in calls.items():
        dist.barrier()
        before, again = interface_counters(), retransmitted_bytes()
        dist.barrier()  # every rank has read the counters before any rank sends
        call()
        dist.barrier()
        sent = (interface_counters() - before).payload_bytes
        seen[op] = (sent, retransmitted_bytes() - again, [(op, WORLD4, payload, wire)])
    return seen


@needs_cluster()
def test_pair_model_matches_veth_counters_for_each_collective() -> None:
    with SimulatedCluster(2, LinkShape(None)) as cluster:
        ranks = run_on_cluster(cluster, 4, _collectives, ranks_per_node=2, timeout=240)
    for op in ranks[0]:
        model = node_egress_bytes([ranks[r][op][2] for r in WORLD4], 2)
        for node in (0, 1):
            veth, again = ranks[2 * node][op][:2]
            # the barriers around the call add a few hundred bytes per node; a segment TCP sent
            # again because its acknowledgement came late (a loaded machine) crossed the veth
            # twice, so the veth lies between the model and the model plus the resent bytes
            low = model[node] * 0.98 - 4096
            high = model[node] * 1.02 + 4096 + again
            assert low <= veth <= high, (
                f"{op} node {node}: veth {veth} B, model {model[node]} B, resent {again} B"
            )


def _broadcast_4mib(rank) -> tuple[int, int]:
    """Rank 0 broadcasts 4 MiB to rank 1 on the other node: this node's veth payload and resends."""
    full = torch.ones(1 << 20)
    dist.barrier()
    before, again = interface_counters(), retransmitted_bytes()
    dist.barrier()  # every rank has read the counters before any rank sends
    dist.broadcast(full, 0)
    dist.barrier()
    return (interface_counters() - before).payload_bytes, retransmitted_bytes() - again


@needs_cluster()
def test_resent_bytes_on_a_dropping_link_are_counted_and_the_veth_sees_each_once() -> None:
    # 100 Mbit/s with a 1 ms queue: the token bucket drops most of a TCP burst before the veth
    shape = LinkShape(rate_mbit=100.0, burst_kib=16, queue_ms=1)
    with SimulatedCluster(2, shape) as cluster:
        (veth, again), _ = run_on_cluster(cluster, 2, _broadcast_4mib, ranks_per_node=1, timeout=120)
    assert again > 64 * 1024, f"the link was to drop segments; TCP resent only {again} B"
    # the barriers around the broadcast add a few hundred bytes; a segment resent because its
    # acknowledgement came late crossed the veth twice, but the drops are most of what was resent
    assert 4 << 20 <= veth <= (4 << 20) + 4096 + again // 8, (
        f"veth payload {veth} B for a 4 MiB broadcast, {again} B resent"
    )
