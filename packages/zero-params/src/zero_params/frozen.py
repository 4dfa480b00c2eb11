"""Frozen parameters stored as int8 shards (ZeRO++ ``zero_quantized_nontrainable_weights``).

Each shard becomes int8 blockwise codes + one fp32 scale per 2048 elements, once (lossy, as in
DeepSpeed); a gather moves the codes and dequantizes them, a write re-quantizes. Needs the
optional extra ``pip install zero-params[quantized]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.profiler import record_function

from zero_comm import AllGatherHandle, FlatAllGather
from zero_params.selection import iter_states
from zero_params.state import ParamStatus, PartitionedParameterError, ShardedParam

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FrozenInt8Gather", "FrozenInt8Store", "quantize_frozen"]


def _qwz_config() -> Any:
    from zero_comm.quantized import QWZ_DEFAULT_CONFIG

    return QWZ_DEFAULT_CONFIG


@dataclasses.dataclass(eq=False, slots=True)
class _Codes:
    codes: torch.Tensor  # int8, one per shard element (not padded to whole groups)
    scales: torch.Tensor  # fp32, one per group of the shard


class FrozenInt8Store:
    """The int8 shards of frozen parameters of one model (the :class:`ShardHome` of each).

    Args:
        config: The ``zero_kernels.QuantConfig`` (8 bits; default: qwZ's, groups of 2048).
    """

    __slots__ = ("_codes", "config")

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else _qwz_config()
        if self.config.bits != 8:
            raise ValueError(
                f"FrozenInt8Store keeps int8 codes: config.bits must be 8, got {self.config.bits}"
            )
        self._codes: dict[int, _Codes] = {}

    def __repr__(self) -> str:
        return f"FrozenInt8Store(params={len(self._codes)}, nbytes={self.nbytes})"

    def __contains__(self, state: object) -> bool:
        return isinstance(state, ShardedParam) and state.id in self._codes

    @property
    def nbytes(self) -> int:
        """Bytes of every stored code and scale."""
        return sum(c.codes.nbytes + c.scales.nbytes for c in self._codes.values())

    def tensors(self) -> list[torch.Tensor]:
        """The stored code and scale tensors (for memory accounting)."""
        return [t for c in self._codes.values() for t in (c.codes, c.scales)]

    def pieces(self, states: Sequence[ShardedParam]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(codes, scales)`` of each state's shard, as ``zero_comm`` gathers them."""
        return [(c.codes, c.scales) for c in (self._get(s) for s in states)]

    def upload(self, states: Sequence[ShardedParam]) -> list[torch.Tensor]:
        """The shards' values (dequantized, in each state's dtype, :attr:`ShardedParam.partition_numel`)."""
        from zero_kernels import QuantizedTensor, dequantize

        out = []
        with record_function("zero.params.frozen.dequantize"):
            for state in states:
                c = self._get(state)
                n = c.codes.numel()
                padded = torch.zeros(self.config.code_bytes(n), dtype=torch.int8, device=c.codes.device)
                padded[:n].copy_(c.codes)
                q = QuantizedTensor(padded, c.scales, n, 8, self.config.group_size)
                out.append(dequantize(q, out_dtype=state.dtype).to(state.device))
        return out

    def replace(self, state: ShardedParam, values: torch.Tensor) -> None:
        """Quantize ``values`` (the new shard, ``partition_numel`` elements) and keep their codes."""
        from zero_kernels import quantize

        if values.numel() != state.partition_numel:
            raise ValueError(
                f"frozen int8 shard of {state.display_name!r}: expected {state.partition_numel} values "
                f"(the partition size), got {values.numel()}"
            )
        with record_function("zero.params.frozen.quantize"), torch.no_grad():
            flat = values.detach().reshape(-1)
            q = quantize(flat, self.config, backend="torch")
            codes, scales = q.codes, q.scales
            if state.id in self._codes:  # new values may be dequantized ones (a checkpoint): keep them exact
                _reencode_exact(flat, codes, scales, self.config.group_size)
            self._codes[state.id] = _Codes(codes[: values.numel()].clone(), scales.clone())

    def _get(self, state: ShardedParam) -> _Codes:
        c = self._codes.get(state.id)
        if c is None:
            raise KeyError(f"parameter {state.display_name!r} has no int8 shard in this FrozenInt8Store")
        return c


def _reencode_exact(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> None:
    """Where a group of ``values`` is exactly ``code * scale`` for some int8 codes (values that were
    dequantized before, e.g. read back from a checkpoint), store those codes instead of ``codes`` /
    ``scales`` (in place).
    """
    n = values.numel()
    rows = scales.numel()
    if n == 0:
        return
    padded = values.new_zeros(rows * group)
    padded[:n] = values
    v = padded.view(rows, group)
    absmax = v.float().abs().amax(dim=1)
    for top in (127.0, 128.0):
        cand = absmax / top
        safe = torch.where(cand == 0, 1.0, cand)
        c = torch.round(v.float() / safe.unsqueeze(1)).clamp_(-128, 127)
        exact = ((c * cand.unsqueeze(1)).to(values.dtype) == v).all(dim=1) & (cand > 0)
        if bool(exact.any()):
            codes.view(rows, group)[exact] = c[exact].to(torch.int8)
            scales[exact] = cand[exact]


class FrozenInt8Gather:
    """All-gather strategy of int8-stored frozen parameters: moves their stored codes + scales.

    :meth:`all_gather_states` is what ``zero_params.gather`` calls (no re-quantization);
    :meth:`all_gather_coalesced` (given working-precision shards) and :attr:`exact` are the plain
    gather over the same group, for callers that bring values (``commit_shards``' refresh).
    """

    __slots__ = ("exact", "group", "group_rank", "group_size", "store")

    def __init__(self, store: FrozenInt8Store, group: ProcessGroup | None = None) -> None:
        self.store = store
        self.group = group
        self.exact = FlatAllGather(group)
        self.group_size = self.exact.group_size
        self.group_rank = self.exact.group_rank

    def __repr__(self) -> str:
        return f"FrozenInt8Gather(group_size={self.group_size}, group_rank={self.group_rank})"

    def all_gather_coalesced(
        self, shards: Sequence[torch.Tensor], *, async_op: bool = False, out: torch.Tensor | None = None
    ) -> AllGatherHandle:
        """Exact gather of given values (see :class:`zero_comm.FlatAllGather`)."""
        return self.exact.all_gather_coalesced(shards, async_op=async_op, out=out)

    def all_gather_states(self, states: Sequence[ShardedParam], *, async_op: bool = False) -> AllGatherHandle:
        """Gather the stored codes of ``states`` (one dtype), dequantized into their dtype on ``wait()``."""
        from zero_comm.quantized import issue_prequantized_all_gather

        dtype = states[0].dtype if states else torch.float32
        return issue_prequantized_all_gather(
            self.store.pieces(states), self.group, dtype=dtype, config=self.store.config, async_op=async_op
        )


def quantize_frozen(
    params: nn.Module | Iterable[nn.Parameter], store: FrozenInt8Store | None = None
) -> FrozenInt8Store | None:
    """Store the shards of frozen partitioned parameters as int8 codes.

    Parameters that are trainable, persistent (kept whole), not floating point, not partitioned,
    already offloaded (``offload_param``) or already int8 are left as they are. Local, no
    communication; every rank must pass the same parameters (their shard groups must agree).
    """
    store = store if store is not None else FrozenInt8Store()
    gathers: dict[tuple[int, ...], FrozenInt8Gather] = {}
    count = 0
    with record_function("zero.params.frozen.quantize_frozen"), torch._C.DisableTorchFunction():
        source = params.parameters() if isinstance(params, nn.Module) else params
        for p, state in iter_states(source):
            if p.requires_grad or state.persistent or state.offload is not None:
                continue
            if state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                continue
            if state.status is not ParamStatus.NOT_AVAILABLE:
                raise PartitionedParameterError(
                    f"quantize_frozen: parameter {state.display_name!r} is {state.status.name}; release it "
                    "(zero_params.release) before storing its shard as int8"
                )
            store.replace(state, state.shard)
            gather = gathers.get(state.group_ranks)
            if gather is None:
                gather = gathers[state.group_ranks] = FrozenInt8Gather(store, state.group)
            state.gather_strategy = gather
            state.shard = torch.empty(0, dtype=state.dtype, device=state.shard.device)
            state.offload = store
            state.secondary_valid = False
            count += 1
    return store if count else None
