"""Optimizer offload for any ``torch.optim`` optimizer: host copies stepped by torch itself.

:class:`zero_offload.OffloadedOptimizer` is the fast path for ``Adam`` / ``AdamW`` (its CPU
Adam, sub-groups, NVMe swap). Every other optimizer (SGD, Adagrad, RMSprop, Adam with
``amsgrad``, ...) is offloaded by :class:`HostOptimizer`: the flat fp32 masters are copied to
host memory once, a twin of the user's optimizer (same class, same ``defaults``) is built
over the host copies and holds all of the state there; each step copies the gradient
partitions down, copies the user's current hyperparameters (an LR scheduler's ``lr``) into
the twin's groups, runs the twin's ``step()`` — torch's own implementation, so the numbers
are the ones torch computes — and copies the updated masters back. Host memory only:
``offload_optimizer.device = nvme`` needs the Adam layout and is refused for other optimizers.

:func:`offload_optimizer_for` picks the implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import record_function

from zero_offload.optimizer import OffloadedOptimizer, OffloadTarget, OptimizerOffloadConfig

__all__ = ["HostOptimizer", "offload_optimizer_for"]


def _is_fast_path(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not any(
        g.get("amsgrad") for g in optimizer.param_groups
    )


def offload_optimizer_for(
    optimizer: torch.optim.Optimizer,
    masters: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    config: OptimizerOffloadConfig,
    *,
    rank: int = 0,
) -> OffloadedOptimizer | HostOptimizer:
    """:class:`OffloadedOptimizer` (CPU Adam) for ``Adam`` / ``AdamW``, :class:`HostOptimizer` otherwise."""
    if _is_fast_path(optimizer):
        return OffloadedOptimizer(optimizer, masters, grads, config, rank=rank)
    return HostOptimizer(optimizer, masters, grads, config)


class HostOptimizer:
    """Steps host copies of flat fp32 masters with a twin of any torch optimizer (see the module doc).

    Args:
        optimizer: The user's torch optimizer, one flat master per group (its groups supply
            the hyperparameters at every step; it keeps no state).
        masters: One flat fp32 tensor per group (updated in place after each step).
        grads: One flat fp32 gradient partition per group.
        config: :class:`OptimizerOffloadConfig` (``device`` must be ``cpu``; ``pin_memory``
            is honoured; the Adam-only knobs have no effect).

    Raises:
        ValueError: ``nvme`` offload, or mismatched masters / gradients / groups.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        config: OptimizerOffloadConfig,
    ) -> None:
        name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        if config.device is OffloadTarget.NVME:
            raise ValueError(
                f"offload_optimizer.device = nvme swaps Adam / AdamW state only, got {name}; use device "
                "'cpu' (any torch optimizer steps in host memory) or Adam / AdamW"
            )
        if len(masters) != len(optimizer.param_groups) or len(grads) != len(masters):
            raise ValueError(
                f"{len(masters)} masters and {len(grads)} gradients for "
                f"{len(optimizer.param_groups)} param groups"
            )
        pin = config.pin_memory and torch.cuda.is_available()
        self.optimizer = optimizer
        self.masters = tuple(masters)
        self.grads = tuple(grads)
        self.host_masters = tuple(_host_copy(m, pin) for m in masters)
        self.host_grads = tuple(torch.zeros_like(h) for h in self.host_masters)
        for h, g in zip(self.host_masters, self.host_grads, strict=True):
            h.grad = g
        groups = [
            {**_hyper(g), "params": [h]}
            for g, h in zip(optimizer.param_groups, self.host_masters, strict=True)
        ]
        self.host_optimizer = type(optimizer)(groups, **optimizer.defaults)
        optimizer.state.clear()  # constructor-made state (Adagrad's sum) lives on the host twin only
        self.step_count = 0

    def state_tensors(self) -> list[torch.Tensor]:
        """The host tensors this optimizer keeps (masters, gradients, the twin's state)."""
        out = [*self.host_masters, *self.host_grads]
        for state in self.host_optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out

    @property
    def resident_state_bytes(self) -> int:
        """Host bytes held (from storages)."""
        return sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.state_tensors()
            }.values()
        )

    def step(self) -> None:
        """Gradients down, the twin's ``step()`` on the host copies, masters back up."""
        with record_function("zero.offload.host_step"), torch.no_grad():
            for hg, g in zip(self.host_optimizer.param_groups, self.optimizer.param_groups, strict=True):
                hg.update(_hyper(g))
            for hgrad, grad in zip(self.host_grads, self.grads, strict=True):
                hgrad.copy_(grad)
            self.host_optimizer.step()
            for master, host in zip(self.masters, self.host_masters, strict=True):
                master.copy_(host)
            self.step_count += 1

    def export_state(self) -> list[dict[str, Any]]:
        """Each group's state in the optimizer's own format (the twin's state, host tensors)."""
        return [dict(self.host_optimizer.state.get(h, {})) for h in self.host_masters]

    def import_state(self, state: Sequence[dict[str, Any]]) -> None:
        """Replace the twin's state (torch format per group) and refresh the host masters.

        Raises:
            ValueError: another number of groups.
        """
        if len(state) != len(self.host_masters):
            raise ValueError(
                f"{len(state)} saved optimizer groups, this optimizer has {len(self.host_masters)}"
            )
        with torch.no_grad():
            for host, master, s in zip(self.host_masters, self.masters, state, strict=True):
                host.copy_(master)
                if s:
                    self.host_optimizer.state[host] = {
                        k: v.detach().to(host.device, copy=True) if isinstance(v, torch.Tensor) else v
                        for k, v in s.items()
                    }
                else:
                    self.host_optimizer.state.pop(host, None)

    def close(self) -> None:
        """Nothing to release (no swap files)."""


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t)
    return out
