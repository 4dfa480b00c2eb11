"""The full weights of a partitioned model: one parameter gathered at a time.

:func:`consolidated_state_dict` (rank 0 gets ``model.state_dict()``-shaped fp32 CPU tensors);
the helpers here are shared with the checkpoint writer and ``engine.save_pretrained``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from zero_comm.torch_compat import all_gather_single
from zero_full.checkpoint.layout import LocalPiece, local_pieces
from zero_full.checkpoint.manifest import StateDictKey
from zero_full.checkpoint.state import TrainState

__all__ = [
    "consolidated_state_dict",
    "gather_full",
    "iter_consolidated",
    "state_dict_buffers",
    "state_dict_keys",
]


def state_dict_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds (persistent ones), keyed like it."""
    params = {id(p) for p in module.parameters()}
    return {
        k: v
        for k, v in module.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor) and id(v) not in params
    }


def state_dict_keys(module: nn.Module) -> list[StateDictKey]:
    """``model.state_dict()`` keys in order: parameters (with their canonical name) and buffers."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    keys = []
    for k, v in module.state_dict(keep_vars=True).items():
        if id(v) in canonical:
            keys.append(StateDictKey(k, "param", canonical[id(v)]))
        elif isinstance(v, torch.Tensor):
            keys.append(StateDictKey(k, "buffer", k))
    return keys


def gather_full(piece: LocalPiece) -> torch.Tensor:
    """The whole flattened parameter (fp32 when floating) on every rank of its group (collective)."""
    if piece.world == 1:
        full = piece.padded.narrow(0, 0, piece.numel)
    else:
        out = torch.empty(
            piece.world * piece.partition_numel, dtype=piece.padded.dtype, device=piece.padded.device
        )
        all_gather_single(out, piece.padded.contiguous(), group=piece.group)
        full = out.narrow(0, 0, piece.numel)
    if full.is_floating_point():
        full = full.float()
    return full.view(piece.shape)


def iter_consolidated(
    state: TrainState, params: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of ``model.state_dict()``, one parameter gathered at a time (every rank).

    Tensors are yielded on rank 0 only (CPU, fp32 for floating-point parameters, buffers in
    their dtype); tied parameters are yielded under each of their keys (gathered once per key).
    ``params``: only the parameters of these ``named_parameters()`` names, and no buffers
    (the same names on every rank).
    """
    pieces = local_pieces(state.module, state.optimizer)
    buffers = state_dict_buffers(state.module)
    is_root = dist.get_rank() == 0
    with torch.no_grad():
        for entry in state_dict_keys(state.module):
            if params is not None and (entry.kind != "param" or entry.source not in params):
                continue
            if entry.kind == "param":
                full = gather_full(pieces[entry.source])
            else:
                full = buffers[entry.source].detach()
            if is_root:
                yield entry.key, full.detach().to("cpu", copy=True)


def consolidated_state_dict(
    state: TrainState, params: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Full fp32 weights keyed like ``model.state_dict()`` (buffers included), on rank 0.

    Collective: call on every rank. Parameters are gathered one at a time (peak extra
    memory: one full parameter). Rank 0 gets CPU tensors loadable by
    ``model.load_state_dict`` on an unsharded model; the other ranks get ``{}``.
    Tied parameters share one tensor under each key. ``params``: only these parameters
    (``named_parameters()`` names, the same on every rank; no buffers), e.g. the trainable
    adapters of a frozen base, which is then never gathered.
    """
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    canonical = {e.key: e.source for e in state_dict_keys(state.module) if e.kind == "param"}
    with record_function("zero.checkpoint.consolidate"):
        for key, tensor in iter_consolidated(state, params):
            src = canonical.get(key)
            if src is not None and src in seen:
                out[key] = seen[src]
                continue
            out[key] = tensor
            if src is not None:
                seen[src] = tensor
    return out
