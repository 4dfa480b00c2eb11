"""Optimizer offload for any ``torch.optim`` optimizer: host copies stepped by torch itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import record_function

from zero_offload.optimizer import HostStepped, OffloadedOptimizer, OffloadTarget, OptimizerOffloadConfig
from zero_offload.placement import HostMemory, HostPlacement

__all__ = ["HostOptimizer", "PartialOffload", "offload_optimizer_for", "twin_optimizer"]


def twin_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` with its constructor options.

    ``optimizer.defaults`` may hold keys its constructor does not take (``AdamW`` records
    ``decoupled_weight_decay``); only the constructor's own keyword arguments are passed (the
    group dicts carry every option anyway).
    """
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    return type(optimizer)(groups, **kwargs)


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
    placement: HostPlacement | None = None,
) -> OffloadedOptimizer | HostOptimizer | PartialOffload:
    """:class:`OffloadedOptimizer` (CPU Adam) for ``Adam`` / ``AdamW``, :class:`HostOptimizer`
    otherwise; wrapped in :class:`PartialOffload` when ``config.ratio < 1``.

    ``placement`` (split): ``masters`` and ``grads`` are host tensors, stepped where they are.

    Raises:
        ValueError: a split placement with ``config.ratio < 1`` (the device part needs its
            master on the device).
    """
    chosen: type[OffloadedOptimizer | HostOptimizer | PartialOffload] = HostOptimizer
    if config.ratio < 1.0:
        chosen = PartialOffload
    elif _is_fast_path(optimizer):
        chosen = OffloadedOptimizer
    return chosen(optimizer, masters, grads, config, rank=rank, placement=placement)


class HostOptimizer(HostStepped):
    """Steps host copies of flat fp32 masters with a twin of any torch optimizer (see the module doc)."""

    def _place(self, memory: HostMemory, rank: int) -> None:
        optimizer = self.optimizer
        if self.config.device is OffloadTarget.NVME:
            name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
            raise ValueError(
                f"offload_optimizer.device = nvme swaps Adam / AdamW state only, got {name}; use device "
                "'cpu' (any torch optimizer steps in host memory) or Adam / AdamW"
            )
        if self.split:  # the host master and gradient partition themselves
            self.host_masters = self.masters
            self.host_grads = self.grads
        else:
            self.host_masters = tuple(memory.copy_of(m) for m in self.masters)
            self.host_grads = tuple(memory.zeros(h.numel()).view(h.shape) for h in self.host_masters)
        for h, g in zip(self.host_masters, self.host_grads, strict=True):
            h.grad = g
        self.host_optimizer = _twin_per_group(optimizer, self.host_masters)
        optimizer.state.clear()  # constructor-made state (Adagrad's sum) lives on the host twin only
        self.step_count = 0

    def state_tensors(self) -> list[torch.Tensor]:
        """The host tensors this optimizer keeps (masters and gradients unless split, the twin's state)."""
        out = [] if self.split else [*self.host_masters, *self.host_grads]
        for state in self.host_optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out

    @property
    def device_bytes_saved(self) -> int:
        """Device bytes kept off the device: the twin's state, and with a split placement the fp32
        master and gradient partition too."""
        state = sum(
            v.numel() * v.element_size()
            for s in self.host_optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        split = sum(m.numel() * m.element_size() * 2 for m in self.masters) if self.split else 0
        return state + split

    def step(self, after: Callable[[int, int, int], None] | None = None) -> None:
        """Gradients down, the twin's ``step()`` on the host copies, masters back up (split: the
        twin steps the host masters in place); then ``after(group, 0, numel)`` per group."""
        with record_function("zero.offload.host_step"), torch.no_grad():
            _refresh_hyper(self.host_optimizer, self.optimizer)
            if not self.split:
                for hgrad, grad in zip(self.host_grads, self.grads, strict=True):
                    hgrad.copy_(grad)
            self.host_optimizer.step()
            if not self.split:
                for master, host in zip(self.masters, self.host_masters, strict=True):
                    master.copy_(host)
            self.step_count += 1
            _after_whole_groups(after, self.masters)

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
                host_state = {
                    k: v.detach().to(host.device, copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in s.items()
                }
                _set_state(self.host_optimizer, host, host_state)

    def close(self) -> None:
        """Nothing to release (no swap files)."""


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _twin_per_group(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> torch.optim.Optimizer:
    """A :func:`twin_optimizer` stepping ``params[i]`` with the options of ``optimizer``'s group ``i``."""
    groups = [{**_hyper(g), "params": [p]} for g, p in zip(optimizer.param_groups, params, strict=True)]
    return twin_optimizer(optimizer, groups)


def _refresh_hyper(twin: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """Copy each group's current options (a scheduled ``lr``, say) from ``optimizer`` to its twin."""
    for tg, g in zip(twin.param_groups, optimizer.param_groups, strict=True):
        tg.update(_hyper(g))


def _after_whole_groups(
    after: Callable[[int, int, int], None] | None, masters: Sequence[torch.Tensor]
) -> None:
    """``after(group, 0, numel)`` for every group's master (when given)."""
    if after is not None:
        for gi, master in enumerate(masters):
            after(gi, 0, master.numel())


def _set_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict[str, Any]) -> None:
    """``param``'s state in ``optimizer``: ``state``, or none when it is empty (no step taken)."""
    if state:
        optimizer.state[param] = state
    else:
        optimizer.state.pop(param, None)


def offloaded_split(numel: int, sub_group_size: int, ratio: float) -> int:
    """Elements of a flat group offloaded at ``ratio``: the first ``round(ratio * n)`` of its
    ``n`` sub-groups of ``sub_group_size`` elements (the last one may be shorter)."""
    n = -(-numel // sub_group_size)
    return min(numel, round(ratio * n) * sub_group_size)


class PartialOffload(HostStepped):
    """Partial optimizer offload (``offload_optimizer.ratio`` < 1): each group's flat master is
    split at a sub-group boundary (:func:`offloaded_split`); the first part is offloaded
    (:class:`OffloadedOptimizer` or :class:`HostOptimizer`, over views of the masters), the rest
    is stepped on the device by a twin of the optimizer (same class and ``defaults``) whose state
    lives with the masters.

    Raises:
        ValueError: a split placement (the device part needs its master on the device).
    """

    def _place(self, memory: HostMemory, rank: int) -> None:
        if self.split:
            raise ValueError(
                "partial optimizer offload (offload_optimizer.ratio < 1) keeps the fp32 master on the "
                "device; it cannot take a host master"
            )
        optimizer, masters, grads, config = self.optimizer, self.masters, self.grads, self.config
        self.splits = tuple(offloaded_split(m.numel(), config.sub_group_size, config.ratio) for m in masters)
        self.offloaded_numel = sum(self.splits)
        self.device_numel = sum(m.numel() for m in masters) - self.offloaded_numel
        whole = dataclasses.replace(config, ratio=1.0)
        self.offloaded: OffloadedOptimizer | HostOptimizer | None = None
        if self.offloaded_numel:
            head = [m.narrow(0, 0, k) for m, k in zip(masters, self.splits, strict=True)]
            head_grads = [g.narrow(0, 0, k) for g, k in zip(grads, self.splits, strict=True)]
            self.offloaded = offload_optimizer_for(optimizer, head, head_grads, whole, rank=rank)
        self.tails = tuple(m.narrow(0, k, m.numel() - k) for m, k in zip(masters, self.splits, strict=True))
        for tail, g, k in zip(self.tails, grads, self.splits, strict=True):
            tail.grad = g.narrow(0, k, g.numel() - k)
        self.device_optimizer: torch.optim.Optimizer | None = None
        if self.device_numel:
            self.device_optimizer = _twin_per_group(optimizer, self.tails)
        optimizer.state.clear()

    def state_tensors(self) -> list[torch.Tensor]:
        """Host tensors of the offloaded part (the device part's state is on the device)."""
        return self.offloaded.state_tensors() if self.offloaded is not None else []

    @property
    def device_bytes_saved(self) -> int:
        """Device bytes the offloaded part keeps off the device."""
        return self.offloaded.device_bytes_saved if self.offloaded is not None else 0

    def step(self, after: Callable[[int, int, int], None] | None = None) -> None:
        """Step the offloaded part, then the device part; then ``after(group, 0, numel)`` per group."""
        with record_function("zero.offload.partial_step"), torch.no_grad():
            if self.offloaded is not None:
                self.offloaded.step()
            if self.device_optimizer is not None:
                _refresh_hyper(self.device_optimizer, self.optimizer)
                self.device_optimizer.step()
            _after_whole_groups(after, self.masters)

    def export_state(self) -> list[dict[str, Any]]:
        """Each group's state in torch's format over the whole master (the two parts joined)."""
        heads = self.offloaded.export_state() if self.offloaded is not None else [{} for _ in self.masters]
        out = []
        for head, tail_param, k in zip(heads, self.tails, self.splits, strict=True):
            tail = (
                self.device_optimizer.state.get(tail_param, {}) if self.device_optimizer is not None else {}
            )
            out.append(_join(head, tail, k, tail_param.numel()))
        return out

    def import_state(self, state: Sequence[dict[str, Any]]) -> None:
        """Split each group's torch-format state between the offloaded and the device part."""
        if len(state) != len(self.masters):
            raise ValueError(f"{len(state)} saved optimizer groups, this optimizer has {len(self.masters)}")
        heads, n = [], 0
        for s, master, tail, k in zip(state, self.masters, self.tails, self.splits, strict=True):
            heads.append({key: _part(v, master.numel(), 0, k) for key, v in s.items()})
            if self.device_optimizer is not None:
                tail_state = {key: _part(v, master.numel(), k, master.numel()) for key, v in s.items()}
                _set_state(self.device_optimizer, tail, tail_state)
            n += 1
        if self.offloaded is not None:
            self.offloaded.import_state(heads)

    def close(self) -> None:
        """Release the offloaded part's resources."""
        if self.offloaded is not None:
            self.offloaded.close()


def _part(value: Any, numel: int, start: int, stop: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel:
        return value.narrow(0, start, stop - start).clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _join(head: dict[str, Any], tail: dict[str, Any], k: int, tail_numel: int) -> dict[str, Any]:
    if not head or not tail:
        return dict(head or tail)
    out = {}
    for key, h in head.items():
        t = tail.get(key)
        elementwise = isinstance(h, torch.Tensor) and h.dim() == 1 and h.numel() == k
        if elementwise and isinstance(t, torch.Tensor) and t.numel() == tail_numel:
            out[key] = torch.cat([h.to(t.device), t])
        else:
            out[key] = h
    return out
