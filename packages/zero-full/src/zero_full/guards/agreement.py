"""Rank agreement at ``initialize``: same parameters, same config on every rank, or an error on all.

Ranks that built different models (a hidden size of 64 on one, 65 on another) would pass
construction and then abort the process inside the communication library at the first
collective whose sizes differ. :func:`check_agreement` compares, before any other
collective, every rank's

* parameter names, full shapes, dtypes and ``requires_grad`` flags, and
* the config's effective values (every key, defaults included),

as one digest per item. The common case costs ONE all-gather of three int64 per rank (item
count and one combined digest per kind). Only on a mismatch a second exchange fetches the
per-item digests, so every rank names the same first differing parameter or key and the
ranks that differ, and raises :class:`RankMismatchError` (a Python error on every rank, no
abort, no hang).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

import zero_comm
import zero_params
from zero_full.config.zero_config import ZeroConfig

__all__ = ["RankMismatchError", "agree_on_robustness", "agreement_items", "check_agreement", "exchange_json"]


class RankMismatchError(RuntimeError):
    """Ranks disagree on the model or the config; raised on every rank at ``initialize``."""


def _digest(text: str) -> int:
    """A signed 63-bit digest of ``text`` (fits an int64 tensor)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, str]]:
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            yield from _flatten(f"{prefix}.{k}" if prefix else str(k), value[k])
    else:
        yield prefix, json.dumps(value, default=str, sort_keys=True)


def _param_description(name: str, p: nn.Parameter) -> str:
    if zero_params.is_partitioned(p):
        state = zero_params.state_of(p)
        shape, dtype = tuple(state.shape), state.dtype
    else:
        shape, dtype = tuple(p.shape), p.dtype
    return f"shape {shape}, dtype {str(dtype).removeprefix('torch.')}, requires_grad={p.requires_grad}"


def agreement_items(
    model: nn.Module, config: ZeroConfig
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(parameters, config)``: ``(name, description)`` items this rank must agree on.

    Parameters are described by full shape, dtype and ``requires_grad`` (in
    ``named_parameters`` order); the config by every effective value (defaults included),
    keyed by its dotted path.
    """
    params = [(n, _param_description(n, p)) for n, p in model.named_parameters()]
    cfg = list(_flatten("", config.model_dump(mode="json")))
    return params, cfg


def exchange_json(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """All-gather one JSON-able object per rank (two zero-comm all-gathers: sizes, then bytes)."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    data = json.dumps(obj).encode("utf-8")
    device = zero_comm.control_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    (sizes,) = zero_comm.all_gather_coalesced([size], group)
    sizes = sizes.cpu()
    width = max(int(sizes.max()), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    (out,) = zero_comm.all_gather_coalesced([mine.to(device)], group)
    rows = out.cpu().view(world, width)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode("utf-8")) for r in range(world)]


def _summary(items: list[tuple[str, str]]) -> tuple[int, int]:
    return len(items), _digest("\n".join(f"{k}={v}" for k, v in items))


def check_agreement(model: nn.Module, config: ZeroConfig) -> None:
    """Raise :class:`RankMismatchError` on every rank unless all ranks agree (collective).

    One all-gather of ``(parameter count, parameter digest, config digest)`` per rank; on a
    mismatch, one more exchange of the per-item descriptions to name the first difference.

    Raises:
        RankMismatchError: names the first differing parameter (or config key), each
            rank's value of it and which ranks differ from rank 0.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with record_function("zero.engine.agreement"):
        params, cfg = agreement_items(model, config)
        n_params, d_params = _summary(params)
        _, d_cfg = _summary(cfg)
        mine = torch.tensor([n_params, d_params, d_cfg], dtype=torch.int64, device=zero_comm.control_device())
        (flat,) = zero_comm.all_gather_coalesced([mine], None)
        rows = flat.cpu().view(dist.get_world_size(), 3)
        if bool((rows == rows[0]).all()):
            return
        details = exchange_json({"params": params, "config": cfg})
    raise RankMismatchError(_describe(details))


def agree_on_robustness(config: ZeroConfig) -> None:
    """Raise :class:`RankMismatchError` on every rank unless all ranks have the same ``robustness``.

    Always run, first, whatever the section says (``check_rank_agreement`` included): the
    checks it configures (``check_calls``, ``check_paths``, the watchdog) add collectives, and a
    check on one rank only would pair its collective with another rank's different one. One
    all-gather of one int64 digest per key (the same count on every rank); on a mismatch one
    more exchange of the values, so every rank names the same keys and values.

    Raises:
        RankMismatchError: names each differing ``robustness`` key and every rank's value.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with record_function("zero.engine.agreement"):
        items = list(_flatten("robustness", config.robustness.model_dump(mode="json")))
        mine = torch.tensor([_digest(f"{k}={v}") for k, v in items], dtype=torch.int64)
        (flat,) = zero_comm.all_gather_coalesced([mine.to(zero_comm.control_device())], None)
        rows = flat.cpu().view(dist.get_world_size(), len(items))
        if bool((rows == rows[0]).all()):
            return
        values = [dict(r) for r in exchange_json(items)]
    differ = [k for k, _ in items if len({json.dumps(v.get(k)) for v in values}) > 1]
    lines = "\n  ".join(
        f"{k}: " + ", ".join(f"rank {r}: {v.get(k)}" for r, v in enumerate(values)) for k in differ
    )
    raise RankMismatchError(
        f"ranks disagree at initialize on robustness key(s) {', '.join(differ)}:\n  {lines}\n"
        "pass the same config to every rank (the checks it turns on are collectives every rank must make)"
    )


def _describe(details: list[dict[str, list[list[str]]]]) -> str:
    for kind, what in (("params", "parameter"), ("config", "config key")):
        per_rank = [dict(d[kind]) for d in details]
        orders = [[k for k, _ in d[kind]] for d in details]
        longest = max(orders, key=len)
        for i, key in enumerate(longest):
            values = [rank.get(key, "<missing>") for rank in per_rank]
            names = [o[i] if i < len(o) else "<none>" for o in orders]
            if len(set(values)) > 1 or len(set(names)) > 1:
                differ = [r for r, v in enumerate(values) if v != values[0] or names[r] != names[0]]
                lines = "\n  ".join(f"rank {r}: {values[r]}" for r in range(len(values)))
                fix = (
                    "build the same model on every rank (same sizes, dtypes and frozen parameters)"
                    if kind == "params"
                    else "pass the same config to every rank"
                )
                return (
                    f"ranks disagree at initialize: {what} {key!r} differs on rank(s) "
                    f"{', '.join(map(str, differ))} from rank 0:\n  {lines}\n{fix}"
                )
    return "ranks disagree at initialize (digests differ, items equal: a hash collision?); retry"
