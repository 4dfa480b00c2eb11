"""Stepping a torch optimizer over a flat partition in sub-groups of ``sub_group_size`` elements."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from zero_comm.profiling import profile_range
from zero_optim.flat import FlatGroup

__all__ = ["SubGroupStepper"]


class SubGroupStepper:
    """Steps ``optimizer`` over each group's flat partition, ``sub_group_size`` elements at a time."""

    __slots__ = ("_views", "groups", "optimizer", "sub_group_size")

    def __init__(
        self, optimizer: torch.optim.Optimizer, groups: Sequence[FlatGroup], sub_group_size: int
    ) -> None:
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be >= 1, got {sub_group_size}")
        self.optimizer = optimizer
        self.groups = tuple(groups)
        self.sub_group_size = int(sub_group_size)
        self._views: dict[tuple[int, int, int], _RangeViews] = {}

    def step(
        self,
        *,
        cuts: Sequence[Sequence[int]] | None = None,
        after: Callable[[int, int], None] | None = None,
    ) -> None:
        """One optimizer step of every group, sub-group by sub-group."""
        opt = self.optimizer
        saved = [pg["params"] for pg in opt.param_groups]
        try:
            for pg in opt.param_groups:
                pg["params"] = []
            for gi, (group, pg) in enumerate(zip(self.groups, opt.param_groups, strict=True)):
                self._step_group(group, pg, cuts[gi] if cuts is not None else (), after, gi)
        finally:
            for pg, params in zip(opt.param_groups, saved):
                pg["params"] = params

    def forget_state_views(self) -> None:
        """Drop the views of the flat per-element state kept between steps.

        Call it when the torch optimizer's state tensors were replaced (``load_state_dict``):
        the views would otherwise keep the replaced tensors alive until the next step. A step
        never uses views of tensors that are no longer the state (it checks), so this is about
        memory only.
        """
        self._views.clear()

    def _bounds(self, numel: int, cuts: Sequence[int]) -> list[int]:
        """The ends of the stepped ranges: every ``sub_group_size`` elements, at each cut, at ``numel``."""
        ends = set(range(self.sub_group_size, numel, self.sub_group_size))
        ends.update(c for c in cuts if 0 < c < numel)
        ends.add(numel)
        return sorted(ends)

    def _step_group(
        self,
        group: FlatGroup,
        pg: dict[str, Any],
        cuts: Sequence[int],
        after: Callable[[int, int], None] | None,
        gi: int,
    ) -> None:
        opt = self.optimizer
        if group.numel == 0:  # nothing to bound: step the empty master as torch would
            pg["params"] = [group.master]
            try:
                opt.step()
            finally:
                pg["params"] = []
            if after is not None:
                after(gi, 0)
            return
        flat_state = opt.state[group.master]
        # what each sub-group starts from: the state as it was before this step (none at the first)
        scalars = {k: _copy_scalar(v) for k, v in flat_state.items() if not _per_element(v, group.numel)}
        elementwise = [k for k, v in flat_state.items() if _per_element(v, group.numel)]
        last: dict[str, Any] | None = None
        start = 0
        try:
            for stop in self._bounds(group.numel, cuts):
                with profile_range("zero.optim.sub_group_step"):
                    last = self._step_range(gi, group, pg, flat_state, scalars, elementwise, start, stop)
                if after is not None:
                    after(gi, stop)
                start = stop
        finally:
            # Also when a range raised: the scalars (e.g. AdamW's ``step``) of the ranges stepped
            # go with the per-element state they already wrote, so a later step finds both.
            if last is not None:
                flat_state.update(last)

    def _step_range(
        self,
        gi: int,
        group: FlatGroup,
        pg: dict[str, Any],
        flat_state: dict[str, Any],
        scalars: dict[str, Any],
        elementwise: list[str],
        start: int,
        stop: int,
    ) -> dict[str, Any]:
        opt = self.optimizer
        pieces = group.pieces(start, stop)
        views = self._state_views(gi, group, flat_state, elementwise, start, stop)
        for (_, master, grad), own in zip(pieces, views, strict=True):
            master.grad = grad
            state = {k: _copy_scalar(v) for k, v in scalars.items()}
            state.update(own)
            opt.state[master] = state
        pg["params"] = [m for _, m, _ in pieces]
        try:
            opt.step()
        finally:
            pg["params"] = []
            states = [opt.state.pop(m, {}) for _, m, _ in pieces]
            for _, m, _ in pieces:
                m.grad = None
        for (off, master, _), state, own in zip(pieces, states, views, strict=True):
            for k, v in state.items():
                if own.get(k) is v:  # the optimizer updated its view of the flat state in place
                    continue
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == master.numel() > 0:
                    _store_per_element(flat_state, k, v, off, group)
                elif isinstance(v, torch.Tensor) and v.numel() > 1:
                    raise ValueError(
                        f"optimizer state {k!r} of shape {tuple(v.shape)} is neither per element nor a "
                        f"scalar; {type(opt).__name__} cannot step a flat partition"
                    )
        first = states[0] if states else {}
        return {k: v for k, v in first.items() if not (isinstance(v, torch.Tensor) and v.dim() == 1)}

    def _state_views(
        self,
        gi: int,
        group: FlatGroup,
        flat_state: dict[str, Any],
        elementwise: list[str],
        start: int,
        stop: int,
    ) -> tuple[dict[str, torch.Tensor], ...]:
        """Per piece of ``[start, stop)``, its views of the flat per-element state (made once per state).

        The views are made again only when the flat state tensors are not the ones they were
        made of (the first step creates them; loading a checkpoint replaces them).
        """
        key = (gi, start, stop)
        flats = tuple(flat_state[k] for k in elementwise)
        found = self._views.get(key)
        if found is not None and found.keys == tuple(elementwise) and _same(found.flats, flats):
            return found.views
        views = tuple(
            {k: f.narrow(0, off, master.numel()) for k, f in zip(elementwise, flats, strict=True)}
            for off, master, _ in group.pieces(start, stop)
        )
        self._views[key] = _RangeViews(tuple(elementwise), flats, views)
        return views


class _RangeViews(NamedTuple):
    """One stepped range's views of the flat per-element state, and the flat tensors they view."""

    keys: tuple[str, ...]
    flats: tuple[torch.Tensor, ...]
    views: tuple[dict[str, torch.Tensor], ...]


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _copy_scalar(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)


def _store_per_element(
    flat_state: dict[str, Any], key: str, value: torch.Tensor, off: int, group: FlatGroup
) -> None:
    """Make ``value`` (one piece's state) part of the flat state ``key`` (allocated on first sight)."""
    flat = flat_state.get(key)
    if not _per_element(flat, group.numel):
        flat = torch.zeros(group.numel, dtype=value.dtype, device=value.device)
        flat_state[key] = flat
    target = flat.narrow(0, off, value.numel())
    if target.data_ptr() != value.data_ptr():
        target.copy_(value)
