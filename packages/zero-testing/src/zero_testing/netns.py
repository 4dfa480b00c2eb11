"""A simulated multi-node cluster on one Linux machine: network namespaces, veth links and ``tc``.

:class:`SimulatedCluster` creates one network namespace per node and a hub namespace holding a
bridge; each node is joined to the bridge by a veth pair whose node end is called
:data:`NODE_IFNAME` inside the node's namespace (address ``10.200.0.<node+1>/24``). The link of
each node is shaped in both directions with a token bucket (``tc qdisc ... tbf``) at
:class:`LinkShape`'s rate. ``netem`` (delay) is not available on every kernel; the shape has no
delay field: only the rate is shaped.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import datetime
import enum
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

import pytest

from zero_testing.pool import RankFailure, RankInfo, RankTimeout

__all__ = [
    "NODE_IFNAME",
    "ClusterState",
    "LinkShape",
    "SimulatedCluster",
    "cluster_unavailable_reason",
    "needs_cluster",
    "enter_namespace",
    "remove_stale_namespaces",
    "FRAME_HEADER_BYTES",
    "LinkCounters",
    "interface_counters",
    "retransmitted_bytes",
    "run_on_cluster",
]

NODE_IFNAME = "zero0"
"""Name of the inter-node interface inside every node namespace."""

_CLONE_NEWNET = 0x40000000
_SUBNET = "10.200.0"
_COUNTER = itertools.count()


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """How each node's link to the switch is shaped (token bucket filter, both directions).

    Attributes:
        rate_mbit: Link rate in Mbit/s; ``None`` leaves the link unshaped (veth speed).
        burst_kib: Bucket size in KiB (bytes sent at line rate before the rate applies).
        queue_ms: Longest time a packet may wait in the bucket's queue before it is dropped.
    """

    rate_mbit: float | None = 1000.0
    burst_kib: int = 256
    queue_ms: int = 100

    def tc_args(self) -> list[str]:
        """The ``tc qdisc replace`` arguments after ``root`` (empty when unshaped)."""
        if self.rate_mbit is None:
            return []
        if self.rate_mbit <= 0 or self.burst_kib <= 0 or self.queue_ms <= 0:
            raise ValueError(f"LinkShape needs positive rate, burst and queue time, got {self}")
        rate = f"{int(self.rate_mbit * 1000)}kbit"
        return ["tbf", "rate", rate, "burst", f"{self.burst_kib}kb", "latency", f"{self.queue_ms}ms"]


class ClusterState(enum.Enum):
    """Lifecycle of a :class:`SimulatedCluster`."""

    NEW = "new"
    UP = "up"
    CLOSED = "closed"


def _ip(*args: str) -> str:
    """Run ``ip args...``; its stdout, or a RuntimeError with ip's message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def cluster_unavailable_reason() -> str | None:
    """``None`` when a simulated cluster can be made here, else why not (a skip message)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a simulated cluster needs root (network namespaces); run as root"
    missing = [tool for tool in ("ip", "tc", "ss") if shutil.which(tool) is None]
    if missing:
        return (
            f"a simulated cluster needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2"
        )
    probe = f"zero-{os.getpid()}-probe{next(_COUNTER)}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"network namespaces cannot be made here: {exc}"
    try:
        _ip("netns", "del", probe)
    except RuntimeError as exc:
        return f"a probe network namespace could not be removed: {exc}"
    return None


def needs_cluster() -> pytest.MarkDecorator:
    """A pytest mark skipping its tests where no simulated cluster can be made, with the reason.

    ``pytestmark = needs_cluster()`` for a whole module, ``@needs_cluster()`` for one test. The
    probe (:func:`cluster_unavailable_reason`) runs when the mark is made, at collection.
    """
    reason = cluster_unavailable_reason()
    return pytest.mark.skipif(reason is not None, reason=f"simulated cluster: {reason}")


def remove_stale_namespaces() -> list[str]:
    """Remove the namespaces of clusters whose creating process is gone (e.g. killed); their names.

    Names are ``zero-<pid>-...``: a namespace whose pid no longer runs was left behind by a
    process that could not clean up (SIGKILL). Namespaces of live processes are left alone.
    """
    removed = []
    for name in _ip("netns", "list").split():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "zero" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
        except PermissionError:
            continue
    return removed


def enter_namespace(name: str) -> None:
    """Move the calling thread into the network namespace ``name`` (made by ``ip netns add``).

    Call it first thing in a fresh process, before any socket or thread is created: sockets
    opened later (and threads started later) live in that namespace.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class SimulatedCluster:
    """``nodes`` network namespaces joined by shaped veth links through a bridge.

    Use as a context manager (``with SimulatedCluster(2, LinkShape(100)) as cluster:``), which
    creates everything on entry and removes it on exit, whatever happened inside.

    Args:
        nodes: Number of nodes (namespaces), >= 1.
        shape: How each node's link is shaped.
    """

    __slots__ = ("_closer", "_old_sigterm", "nodes", "prefix", "shape", "state")

    def __init__(self, nodes: int = 2, shape: LinkShape | None = None) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= 250:
            raise ValueError(f"SimulatedCluster: nodes must be an integer in 1..250, got {nodes!r}")
        self.nodes = nodes
        self.shape = shape if shape is not None else LinkShape()
        self.prefix = f"zero-{os.getpid()}-{next(_COUNTER)}"
        self.state = ClusterState.NEW
        self._closer: Callable[[], None] | None = None
        self._old_sigterm: Any = None

    @property
    def hub(self) -> str:
        """Name of the namespace holding the bridge."""
        return f"{self.prefix}-hub"

    def namespace(self, node: int) -> str:
        """Name of node ``node``'s namespace."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} is outside this cluster of {self.nodes} nodes")
        return f"{self.prefix}-n{node}"

    def address(self, node: int) -> str:
        """IPv4 address of node ``node`` (on :data:`NODE_IFNAME`, inside its namespace)."""
        self.namespace(node)
        return f"{_SUBNET}.{node + 1}"

    def namespaces(self) -> list[str]:
        """Every namespace this cluster creates: the hub, then the nodes."""
        return [self.hub, *(self.namespace(n) for n in range(self.nodes))]

    def up(self) -> SimulatedCluster:
        """Create the namespaces, links, addresses and shaping; undone by :meth:`close`."""
        if self.state is not ClusterState.NEW:
            raise RuntimeError(f"SimulatedCluster {self.prefix} is {self.state.value}; make a new one")
        remove_stale_namespaces()
        self.state = ClusterState.UP
        self._closer = self.close
        atexit.register(self._closer)
        self._catch_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _catch_sigterm(self) -> None:
        """While up, SIGTERM exits like ``sys.exit`` (so ``finally`` and ``atexit`` clean up).

        Only when SIGTERM has its default action and this is the main thread; restored by close.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _build(self) -> None:
        hub = self.hub
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for node in range(self.nodes):
            ns, port = self.namespace(node), f"port{node}"
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns)
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", NODE_IFNAME)
            _ip("-n", ns, "link", "set", NODE_IFNAME, "up")
            tbf = self.shape.tc_args()
            if tbf:
                for where, dev in ((ns, NODE_IFNAME), (hub, port)):
                    _ip("netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)

    def close(self) -> None:
        """Remove every namespace of this cluster (their links go with them); idempotent."""
        if self.state is ClusterState.UP:
            existing = set(_ip("netns", "list").split())
            for ns in self.namespaces():
                if ns in existing:
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.state = ClusterState.CLOSED
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if self._closer is not None:
            atexit.unregister(self._closer)
            self._closer = None

    def __enter__(self) -> SimulatedCluster:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def link_stats(self, node: int) -> dict[str, int]:
        """Counters of node ``node``'s inter-node interface (``tx_bytes``, ``rx_bytes``, packets)."""
        if self.state is not ClusterState.UP:
            raise RuntimeError(f"SimulatedCluster {self.prefix} is {self.state.value}, not up")
        info = json.loads(_ip("-j", "-s", "-n", self.namespace(node), "link", "show", "dev", NODE_IFNAME))
        stats = info[0]["stats64"]
        return {
            "tx_bytes": stats["tx"]["bytes"],
            "rx_bytes": stats["rx"]["bytes"],
            "tx_packets": stats["tx"]["packets"],
            "rx_packets": stats["rx"]["packets"],
        }

    def tx_bytes(self) -> list[int]:
        """Bytes each node has sent over its inter-node link so far (headers included)."""
        return [self.link_stats(n)["tx_bytes"] for n in range(self.nodes)]


FRAME_HEADER_BYTES = 66
"""Headers of one TCP/IPv4 frame on a veth: Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12."""


@dataclasses.dataclass(frozen=True)
class LinkCounters:
    """What an interface has sent so far: bytes (headers included) and frames."""

    tx_bytes: int
    tx_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.tx_bytes - other.tx_bytes, self.tx_packets - other.tx_packets)

    @property
    def payload_bytes(self) -> int:
        """``tx_bytes`` less :data:`FRAME_HEADER_BYTES` per frame: the TCP payload sent.

        A veth counts a segmentation-offloaded super-frame once, with one set of headers, so
        this is exact for TCP over IPv4 with timestamps (Linux's default); pure ACK frames
        count zero.
        """
        return self.tx_bytes - FRAME_HEADER_BYTES * self.tx_packets


def interface_counters(ifname: str = NODE_IFNAME) -> LinkCounters:
    """Counters of ``ifname`` in this process's network namespace (``/proc/self/net/dev``).

    Inside a rank of :func:`run_on_cluster` the default is the node's inter-node interface: the
    difference around a window is what the node (all its ranks) sent to other nodes.
    """
    with open("/proc/self/net/dev", encoding="ascii") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == ifname:
                fields = rest.split()
                return LinkCounters(tx_bytes=int(fields[8]), tx_packets=int(fields[9]))
    raise RuntimeError(f"no interface {ifname!r} in this network namespace (/proc/self/net/dev)")


def retransmitted_bytes() -> int:
    """TCP payload bytes this network namespace has sent again to other addresses, so far."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    total, remote = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket: "<recv-q> <send-q> <local>:<port> <peer>:<port>"
            fields = line.split()
            local, peer = (f.rpartition(":")[0] for f in fields[-2:])
            remote = local != peer
        elif remote:
            for word in line.split():
                if word.startswith("bytes_retrans:"):
                    total += int(word.partition(":")[2])
    return total


def _rank_main(
    info: RankInfo,
    namespace: str | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    if namespace is not None:
        enter_namespace(namespace)
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
        LOCAL_WORLD_SIZE=str(info.ranks_per_node),
        GLOO_SOCKET_IFNAME=NODE_IFNAME if namespace is not None else "lo",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{info.workdir}/store",
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=300),
        )
        result = fn(info, *args)
        dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        conn.send(("error", traceback.format_exc()))
    conn.close()


def run_on_cluster(
    cluster: SimulatedCluster | None,
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    ranks_per_node: int,
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank_info, *args)`` on ``world_size`` fresh gloo ranks; per-rank results in rank order."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide world_size={world_size}")
    nodes = world_size // ranks_per_node
    if cluster is not None and cluster.nodes != nodes:
        raise ValueError(
            f"world_size={world_size} with ranks_per_node={ranks_per_node} needs {nodes} nodes; "
            f"the cluster has {cluster.nodes}"
        )
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zero-cluster-") as workdir:
        conns: list[Connection] = []
        procs: list[mp.process.BaseProcess] = []
        try:
            for rank in range(world_size):
                info = RankInfo(rank, world_size, ranks_per_node, workdir)
                ns = cluster.namespace(info.node) if cluster is not None else None
                parent, child = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_rank_main, args=(info, ns, fn, args, child), daemon=True)
                proc.start()
                child.close()
                conns.append(parent)
                procs.append(proc)
            return _collect(fn, conns, procs, timeout, world_size, ranks_per_node)
        except BaseException:  # a failure, Ctrl-C or SIGTERM: no rank is worth waiting for
            for proc in procs:
                proc.kill()
            raise
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
            for conn in conns:
                conn.close()


def _collect(
    fn: Callable[..., Any],
    conns: list[Connection],
    procs: list[mp.process.BaseProcess],
    timeout: float,
    world_size: int,
    ranks_per_node: int,
) -> list[Any]:
    what = getattr(fn, "__qualname__", repr(fn))
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = dict(enumerate(conns))
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for conn in wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic())):
            rank = next(r for r, c in pending.items() if c is conn)
            del pending[rank]
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", f"rank {rank} exited (exit code {procs[rank].exitcode})"
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + 10.0)
    topo = f"world_size={world_size}, ranks_per_node={ranks_per_node}"
    for rank in pending:
        procs[rank].kill()
    if errors:
        first = min(errors)
        raise RankFailure(f"{what} failed on rank(s) {sorted(errors)} ({topo}).\n{errors[first]}")
    if pending:
        raise RankTimeout(f"{what}: rank(s) {sorted(pending)} did not finish within {timeout:.0f}s ({topo})")
    return [results[r] for r in range(world_size)]
