"""The engine's device: chosen at ``initialize``, the model moved to it, mismatches refused."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import record_function

import zero_comm
import zero_params

__all__ = ["engine_device", "place_model"]


def engine_device(requested: str | torch.device | None = None, example: str = "") -> torch.device:
    """The device the engine computes and keeps its shards on.

    ``example`` (``"parameter 'a.weight' is on cpu"``) opens the error message, naming a
    parameter where the group serves no device it could train on.
    """
    served = zero_comm.served_device_types()
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if requested is None:
        if current is not None and current.type in served:
            return torch.device(current.type, torch.accelerator.current_device_index())
        if "cpu" in served:
            return torch.device("cpu")
        raise ValueError(
            f"{example + ', but ' if example else ''}the process group serves only {_types(served)} "
            "tensors, and this process has no such "
            f"accelerator (torch.accelerator: {current.type if current else 'none'}): run where it is "
            "available, or use a backend that serves the CPU (init_process_group('gloo'))"
        )
    device = torch.device(requested)
    if device.type not in served:
        raise ValueError(
            f"initialize(device={str(device)!r}): the process group serves only {_types(served)} "
            "tensors; pass one of those devices or create the group with a backend for it"
        )
    if device.index is None and current is not None and device.type == current.type:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def place_model(model: nn.Module, requested: str | torch.device | None = None) -> torch.device:
    """Choose the engine's device (:func:`engine_device`), move ``model`` there and return it."""
    with record_function("zero.engine.place_model"):
        named = [*model.named_parameters(), *model.named_buffers()]
        example = f"parameter {named[0][0]!r} is on {named[0][1].device}" if named else ""
        device = engine_device(requested, example)
        first: dict[torch.device, str] = {}
        for name, t in named:
            if zero_params.is_partitioned(t):
                _check_shard(name, zero_params.state_of(t).shard, device)
                continue
            first.setdefault(t.device, name)
        if len(first) > 1:
            where = ", ".join(f"{name!r} on {d}" for d, name in first.items())
            raise ValueError(
                f"the model's parameters and buffers are on {len(first)} devices ({where}): zero keeps "
                f"every shard on the engine's device ({device}); build the model on one device"
            )
        for d, name in first.items():
            if d.type == "meta":
                raise ValueError(
                    f"parameter {name!r} is on the meta device: it has no values to train; build the "
                    f"model with values (or under zero_full.Init) before initialize ({device})"
                )
            if d != device:
                model.to(device)
        return device


def _check_shard(name: str, shard: torch.Tensor, device: torch.device) -> None:
    """A shard made by ``Init`` lives on the engine's device, or on the host (parameter offload)."""
    if shard.device != device and shard.device.type != "cpu":
        raise ValueError(
            f"parameter {name!r} was partitioned (zero_full.Init) on {shard.device}, but the engine's "
            f"device is {device}: build under Init on the same device, or pass "
            f"initialize(device={str(shard.device)!r})"
        )


def _types(served: tuple[str, ...]) -> str:
    return "/".join(served)
