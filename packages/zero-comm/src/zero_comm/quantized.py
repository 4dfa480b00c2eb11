"""Quantized collectives of ZeRO++: qwZ (quantized weight all-gather) and qgZ (quantized gradients).

Needs the optional extra ``pip install zero-comm[quantized]`` (the ``zero-kernels`` package);
``import zero_comm`` works without it, and the names below are exported lazily from ``zero_comm``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from zero_comm.checks import check_flat_inputs
from zero_comm.coalesced import (
    GatherLayout,
    adjacent_flat_view,
    issue_reduce_scatter,
    result_or_handle,
    unpad_partitions,
)
from zero_comm.handles import AllGatherHandle, ReduceScatterHandle
from zero_comm.ledger import record, ring_wire_bytes
from zero_comm.pairwise import gather_rows
from zero_comm.partition import partition_numel
from zero_comm.reduction import ReduceOpLike, Reduction
from zero_comm.strategies import FlatAllGather, OnGroup
from zero_comm.topology import Topology, group_size_and_rank
from zero_comm.watched import watched_call

try:
    from zero_kernels import (
        QuantConfig,
        QuantizedTensor,
        dequant_reduce,
        dequant_reduce_requant,
        dequantize,
        quantize,
        swizzled_quantize,
    )
except ModuleNotFoundError as _missing:  # only a missing zero-kernels gets the install hint
    if _missing.name != "zero_kernels":
        raise
    raise ImportError(
        "zero_comm's quantized collectives (qwZ / qgZ) need the zero-kernels package, which is not "
        "installed: pip install zero-comm[quantized]"
    ) from _missing

__all__ = [
    "QGZ_DEFAULT_CONFIG",
    "QWZ_DEFAULT_CONFIG",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "all_to_all_quant_reduce",
    "issue_prequantized_all_gather",
    "issue_quantized_all_gather",
    "quantized_all_gather_coalesced",
]

logger = logging.getLogger("zero.comm")

QWZ_DEFAULT_CONFIG = QuantConfig(bits=8, group_size=2048)
"""qwZ default: int8 codes, one fp32 scale per 2048 elements (0.2% scale overhead)."""

QGZ_DEFAULT_CONFIG = QuantConfig(bits=4, group_size=2048)
"""qgZ default: int4 codes (two per byte), one fp32 scale per 2048 elements."""

QWZ_OP = "quantized_all_gather"
QGZ_OP = "quantized_all_to_all"
_RS_HANDLE_OP = "quantized_reduce_scatter"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_RS_OPS = (Reduction.SUM, Reduction.AVG)


# ----------------------------------------------------------------------------- checks and packing


def _check_config(config: Any, what: str) -> None:
    if not isinstance(config, QuantConfig):
        raise TypeError(
            f"{what}: config must be a zero_kernels.QuantConfig, e.g. QuantConfig(bits=8, group_size=2048), "
            f"got {type(config).__name__} {config!r}"
        )


def _check_float(dtype: torch.dtype, what: str, exact: str) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{what}: quantization needs float32, bfloat16 or float16 inputs, got {dtype}; use the "
            f"exact zero_comm.{exact} for other dtypes"
        )


def _pack(q: QuantizedTensor, pieces: int) -> torch.Tensor:
    """``(pieces, row)`` uint8 send buffer: row ``i`` is piece ``i``'s codes, then its scales' bytes.

    ``q`` must split into ``pieces`` equal pieces of whole groups (a swizzled layout does).
    """
    codes = q.codes.view(torch.uint8).view(pieces, -1)
    scales = q.scales.view(torch.uint8).view(pieces, -1)
    return torch.cat([codes, scales], dim=1)


def _unpack(rows: torch.Tensor, piece_numel: int, config: QuantConfig) -> QuantizedTensor:
    """The received ``(pieces, row)`` buffer as ``pieces`` quantized pieces stacked in row order."""
    pieces = rows.shape[0]
    cb = config.code_bytes(piece_numel)
    codes = rows[:, :cb].reshape(-1)  # one copy when pieces > 1 (the scales sit between the rows)
    scales = rows[:, cb:].contiguous().view(torch.float32).reshape(-1)
    if config.bits == 8:
        codes = codes.view(torch.int8)
    return QuantizedTensor(codes, scales, pieces * piece_numel, config.bits, config.group_size)


class _AllWorks:
    """Several pending communications (torch ``Work`` objects or zero-comm handles) as one."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = tuple(items)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for item in self.items:
            done = item.wait() if timeout is None else item.wait(timeout)
            if done is False:
                return False
        return True

    def is_completed(self) -> bool:
        return all(bool(item.is_completed()) for item in self.items)


# ----------------------------------------------------------------------------- qwZ


def quantized_all_gather_coalesced(
    shards: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    config: QuantConfig = QWZ_DEFAULT_CONFIG,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor] | AllGatherHandle:
    """qwZ all-gather (see :func:`issue_quantized_all_gather`): the result, or the handle with ``async_op``.

    Returns:
        What :func:`zero_comm.all_gather_coalesced` returns, dequantized.
    """
    handle = issue_quantized_all_gather(shards, group, config=config, async_op=async_op, out=out)
    return result_or_handle(handle, async_op)


def issue_quantized_all_gather(
    shards: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    *,
    config: QuantConfig = QWZ_DEFAULT_CONFIG,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> AllGatherHandle:
    """qwZ: gather several tensors' shards from every rank, quantized on the wire; always a handle."""
    what = "quantized_all_gather_coalesced"
    with record_function("zero.quantized_all_gather.issue"):
        _check_config(config, what)
        world, _ = group_size_and_rank(group, what)
        check_flat_inputs(shards, what, require_1d=True)
        _check_float(shards[0].dtype, what, "all_gather_coalesced")
        layout = GatherLayout.plan(shards, world, out, what)
        total = layout.total
        payload = config.payload_bytes(total)
        record(QWZ_OP, group, payload_bytes=payload, wire_bytes=ring_wire_bytes("all_gather", payload, world))
        if world == 1 or total == 0:
            if total:
                torch.cat(list(shards), out=layout.flat)
            outputs = layout.outputs
            return AllGatherHandle(QWZ_OP, None, lambda: outputs)
        flat = adjacent_flat_view(shards)
        if flat is None:
            flat = torch.cat(list(shards))
        send = _pack(quantize(flat, config), 1).view(-1)
        recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
        work = gather_rows(recv, send, group, async_op=async_op)
        return AllGatherHandle(
            QWZ_OP, work, lambda: _dequantize_gathered(recv, layout, config), keepalive=(send,)
        )


def _dequantize_gathered(recv: torch.Tensor, layout: GatherLayout, config: QuantConfig) -> list[torch.Tensor]:
    """Decode every rank's payload (rank-major) into ``layout``'s outputs."""
    world, total = layout.world, layout.total
    rows = recv.view(world, -1)
    cb = config.code_bytes(total)
    scales = rows[:, cb:].contiguous().view(torch.float32)  # (world, groups): 4-byte aligned now
    codes = rows[:, :cb] if config.bits == 4 else rows[:, :cb].view(torch.int8)
    single = len(layout.sizes) == 1
    staging = layout.flat.view(world, total) if single else layout.flat.new_empty(world, total)
    with record_function("zero.quantized_all_gather.dequantize"):
        for r in range(world):
            q = QuantizedTensor(codes[r], scales[r], total, config.bits, config.group_size)
            dequantize(q, out=staging[r])
    return layout.outputs if single else layout.copy_out(staging)


class QuantizedAllGather(OnGroup):
    """qwZ as an :class:`~zero_comm.AllGatherStrategy`: one quantized all-gather per call.

    :attr:`exact` is the plain :class:`~zero_comm.FlatAllGather` over the same group.
    """

    __slots__ = ("config", "exact")

    def __init__(self, group: ProcessGroup | None = None, config: QuantConfig = QWZ_DEFAULT_CONFIG) -> None:
        _check_config(config, type(self).__name__)
        self.config = config
        super().__init__(group)
        self.exact = FlatAllGather(group)
        """The unquantized gather over the same group, for callers that need exact values (e.g.
        ``zero_params.commit_shards`` refreshing whole parameters from updated shards)."""

    def _repr_fields(self) -> str:
        return f"{super()._repr_fields()}, bits={self.config.bits}, quant_group={self.config.group_size}"

    def all_gather_coalesced(
        self, shards: Sequence[torch.Tensor], *, async_op: bool = False, out: torch.Tensor | None = None
    ) -> AllGatherHandle:
        """See :func:`issue_quantized_all_gather`."""
        return issue_quantized_all_gather(shards, self.group, config=self.config, async_op=async_op, out=out)


def issue_prequantized_all_gather(
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
    group: ProcessGroup | None = None,
    *,
    dtype: torch.dtype,
    config: QuantConfig = QWZ_DEFAULT_CONFIG,
    async_op: bool = False,
) -> AllGatherHandle:
    """Gather shards that are already stored quantized (int8 codes + fp32 scales); always a handle."""
    what = "issue_prequantized_all_gather"
    with record_function("zero.quantized_all_gather.issue"):
        _check_config(config, what)
        _check_float(dtype, what, "all_gather_coalesced")
        if config.bits != 8:
            raise ValueError(f"{what}: stored codes are int8 (config.bits = 8), got bits = {config.bits}")
        for i, (codes, scales) in enumerate(pieces):
            if codes.dtype != torch.int8 or scales.dtype != torch.float32:
                raise ValueError(
                    f"{what}: piece {i} must be (int8 codes, float32 scales), got ({codes.dtype}, "
                    f"{scales.dtype}); quantize the shard with zero_kernels.quantize(shard, config)"
                )
            if scales.numel() != config.n_groups(codes.numel()):
                raise ValueError(
                    f"{what}: piece {i} has {codes.numel()} codes but {scales.numel()} scales; "
                    f"groups of {config.group_size} need {config.n_groups(codes.numel())}"
                )
        world, _ = group_size_and_rank(group, what)
        numels = [codes.numel() for codes, _ in pieces]
        device = pieces[0][0].device if pieces else torch.device("cpu")
        flat_out = torch.empty(world * sum(numels), dtype=dtype, device=device)
        outputs = list(flat_out.split([world * n for n in numels]))
        send = (
            torch.cat([t.reshape(-1).view(torch.uint8) for codes, scales in pieces for t in (codes, scales)])
            if pieces
            else torch.empty(0, dtype=torch.uint8, device=device)
        )
        record(
            QWZ_OP, group, payload_bytes=send.numel(),
            wire_bytes=ring_wire_bytes("all_gather", send.numel(), world),
        )  # fmt: skip
        if world == 1 or send.numel() == 0:
            _decode_pieces(send.view(1, -1), numels, outputs, config)
            return AllGatherHandle(QWZ_OP, None, lambda: outputs)
        recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=device)
        work = gather_rows(recv, send, group, async_op=async_op)
        return AllGatherHandle(
            QWZ_OP,
            work,
            lambda: _decode_pieces(recv.view(world, -1), numels, outputs, config),
            keepalive=(send,),
        )


def _decode_pieces(
    rows: torch.Tensor, numels: list[int], outputs: list[torch.Tensor], config: QuantConfig
) -> list[torch.Tensor]:
    """Dequantize row ``r`` (rank ``r``'s packed pieces) into slice ``r`` of each output."""
    with record_function("zero.quantized_all_gather.dequantize"):
        for r in range(rows.shape[0]):
            offset = 0
            for n, out in zip(numels, outputs, strict=True):
                groups = config.n_groups(n)
                codes = torch.zeros(config.code_bytes(n), dtype=torch.int8, device=rows.device)
                codes[:n].copy_(rows[r, offset : offset + n].view(torch.int8))
                offset += n
                scales = rows[r, offset : offset + 4 * groups].clone().view(torch.float32)
                offset += 4 * groups
                q = QuantizedTensor(codes, scales, n, 8, config.group_size)
                dequantize(q, out=out[r * n : (r + 1) * n])
    return outputs


# ----------------------------------------------------------------------------- qgZ


def all_to_all_quant_reduce(
    tensors: Sequence[torch.Tensor],
    topology: Topology | None = None,
    *,
    config: QuantConfig = QGZ_DEFAULT_CONFIG,
    op: ReduceOpLike = "avg",
    async_op: bool = False,
) -> list[torch.Tensor] | ReduceScatterHandle:
    """qgZ: reduce gradients over the world with quantized hierarchical all-to-alls."""
    what = "all_to_all_quant_reduce"
    topo = Topology() if topology is None else topology
    handle = _quant_reduce(tensors, topo, config, op, async_op, None, what)
    numels = [t.numel() for t in tensors]
    unpadded = handle.then(lambda parts: unpad_partitions(parts, numels, topo.world_size, topo.rank))
    return result_or_handle(unpadded, async_op)


class QuantizedReduceScatter:
    """qgZ as a :class:`~zero_comm.ReduceScatterStrategy` over the whole world of ``topology``.

    Each fallback reason (tensors with fewer than 2 dimensions: INFO; numel not divisible by the
    world size: WARNING) is logged once per strategy object on the ``zero.comm`` logger.
    """

    __slots__ = ("_logged", "config", "group_rank", "group_size", "topology")

    def __init__(self, topology: Topology, config: QuantConfig = QGZ_DEFAULT_CONFIG) -> None:
        _check_topology(topology, "QuantizedReduceScatter")
        _check_config(config, "QuantizedReduceScatter")
        self.topology = topology
        self.config = config
        self.group_size = topology.world_size
        self.group_rank = topology.rank
        self._logged: set[str] = set()

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"QuantizedReduceScatter(nodes={t.num_nodes}, per_node={t.ranks_per_node}, "
            f"group_rank={self.group_rank}, bits={self.config.bits}, quant_group={self.config.group_size})"
        )

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], *, op: ReduceOpLike = "avg", async_op: bool = False
    ) -> ReduceScatterHandle:
        """See :func:`all_to_all_quant_reduce`."""
        return _quant_reduce(
            tensors, self.topology, self.config, op, async_op, self._logged, "QuantizedReduceScatter"
        )


def _check_topology(topology: Any, what: str) -> None:
    if not isinstance(topology, Topology):
        raise TypeError(
            f"{what}: topology must be a zero_comm.Topology (e.g. Topology(ranks_per_node=8)), "
            f"got {type(topology).__name__}"
        )


def _split_eligible(
    tensors: Sequence[torch.Tensor], world: int, logged: set[str] | None, what: str
) -> tuple[list[int], list[int]]:
    """Indices of the tensors qgZ quantizes and of those that fall back; logs the fallbacks."""
    eligible: list[int] = []
    reasons: dict[str, list[int]] = {"1-D": [], "indivisible": []}
    for i, t in enumerate(tensors):
        if t.dim() < 2:
            reasons["1-D"].append(i)
        elif t.numel() % world:
            reasons["indivisible"].append(i)
        else:
            eligible.append(i)
    for reason, idx in reasons.items():
        if not idx or (logged is not None and reason in logged):
            continue
        t = tensors[idx[0]]
        if reason == "1-D":
            level = logging.INFO
            why = f"have fewer than 2 dimensions (e.g. input {idx[0]}, shape {tuple(t.shape)})"
            fix = "biases and norms are small and sensitive, as in DeepSpeed's qgZ"
        else:
            level = logging.WARNING
            why = (
                f"have a numel not divisible by the world size {world} (e.g. input {idx[0]}, shape "
                f"{tuple(t.shape)}, numel {t.numel()})"
            )
            fix = f"pad them to a multiple of {world} elements to quantize them"
        if logged is None:
            level = logging.DEBUG
        else:
            logged.add(reason)
        logger.log(
            level,
            "%s: %d tensor(s) %s are reduced exactly by reduce_scatter_coalesced, not quantized (%s)%s",
            what,
            len(idx),
            why,
            fix,
            "" if logged is None else "; logged once per strategy object",
        )
    fallback = sorted(reasons["1-D"] + reasons["indivisible"])
    return eligible, fallback


def _quant_reduce(
    tensors: Sequence[torch.Tensor],
    topology: Topology,
    config: QuantConfig,
    op: ReduceOpLike,
    async_op: bool,
    logged: set[str] | None,
    what: str,
    requantize: Callable[[torch.Tensor], QuantizedTensor] | None = None,
) -> ReduceScatterHandle:
    with record_function("zero.quantized_reduce_scatter.issue"):
        _check_topology(topology, what)
        _check_config(config, what)
        check_flat_inputs(tensors, what, require_1d=False)
        reduction = Reduction.parse(op, _RS_OPS, what)
        _check_float(tensors[0].dtype, what, "reduce_scatter_coalesced")
        world = topology.world_size
        if world == 1:
            return issue_reduce_scatter(tensors, None, op=reduction, async_op=async_op)
        eligible, fallback = _split_eligible(tensors, world, logged, what)
        fb_handle = None
        if fallback:
            fb = [tensors[i] for i in fallback]
            fb_handle = issue_reduce_scatter(fb, None, op=reduction, async_op=async_op)
            if not eligible:
                return fb_handle
        parts = [partition_numel(t.numel(), world) for t in tensors]
        chosen = [tensors[i] for i in eligible]
        work, finish_q, keep = _issue_qgz(chosen, topology, config, async_op, requantize)
        average = reduction is Reduction.AVG
        dtype = tensors[0].dtype

        def finish() -> list[torch.Tensor]:
            mine = finish_q()  # fp32 sum of this rank's row, padded to whole groups
            row = mine[: sum(parts[i] for i in eligible)]
            if average:
                row.div_(world)
            row = row if dtype == torch.float32 else row.to(dtype)
            if fb_handle is None:
                return list(torch.split(row, parts))
            by_index = dict(zip(eligible, torch.split(row, [parts[i] for i in eligible])))
            by_index.update(zip(fallback, fb_handle.wait()))
            flat = row.new_empty(sum(parts))
            torch.cat([by_index[i] for i in range(len(tensors))], out=flat)
            return list(torch.split(flat, parts))

        waits = [w for w in (work, fb_handle if async_op else None) if w is not None]
        combined = _AllWorks(waits) if waits else None
        return ReduceScatterHandle(_RS_HANDLE_OP, combined, finish, keepalive=keep)


def _issue_qgz(
    tensors: list[torch.Tensor],
    topology: Topology,
    config: QuantConfig,
    async_op: bool,
    requantize: Callable[[torch.Tensor], QuantizedTensor] | None = None,
) -> tuple[Any, Any, tuple[torch.Tensor, ...]]:
    """Issue qgZ's hops for ``tensors`` (each numel divisible by the world size).

    ``requantize`` (error feedback) replaces the fused dequantize-sum-requantize between the
    hops: it gets the fp32 node partial sum and returns its quantized form.

    Returns the pending work of the last hop (or ``None``), a function giving this rank's fp32
    summed row (padded to whole groups), and the buffers to keep alive until then.
    """
    nodes, per_node = topology.num_nodes, topology.ranks_per_node
    world = nodes * per_node
    if len(tensors) == 1:
        flat = tensors[0].view(-1)
    else:  # row p = every tensor's partition p, back to back: reduce_scatter_coalesced's layout
        flat = torch.cat([t.view(world, t.numel() // world) for t in tensors], dim=1).view(-1)
    hops: list[tuple[ProcessGroup, int]] = []
    if per_node > 1:
        hops.append((topology.intra_node_group(), per_node))
    if nodes > 1:
        hops.append((topology.inter_node_group(), nodes))
    if flat.numel() == 0:
        for group, _ in hops:  # recorded like any empty collective: nothing on the wire
            record(QGZ_OP, group, payload_bytes=0, wire_bytes=0)
        empty = torch.zeros(0, dtype=torch.float32, device=flat.device)
        return None, lambda: empty, ()
    with record_function("zero.quantized_reduce_scatter.quantize"):
        q = swizzled_quantize(flat, config, nodes, per_node)
    for i, (group, pieces) in enumerate(hops):
        last = i == len(hops) - 1
        send = _pack(q, pieces)
        record(
            QGZ_OP,
            group,
            payload_bytes=send.numel(),
            wire_bytes=ring_wire_bytes("all_to_all", send.numel(), pieces),
        )
        recv = torch.empty_like(send)
        work = watched_call(
            "all_to_all", dist.all_to_all_single, recv, send, group=group, async_op=async_op and last
        )
        piece_numel = q.numel // pieces
        if not last:
            with record_function("zero.quantized_reduce_scatter.dequant_reduce_requant"):
                if requantize is None:
                    q = dequant_reduce_requant(_unpack(recv, piece_numel, config), pieces, config)
                else:
                    q = requantize(dequant_reduce(_unpack(recv, piece_numel, config), pieces))

    def finish() -> torch.Tensor:
        with record_function("zero.quantized_reduce_scatter.dequant_reduce"):
            return dequant_reduce(_unpack(recv, piece_numel, config), pieces)

    return work, finish, (send,)
