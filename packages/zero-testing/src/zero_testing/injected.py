"""Failures injected into training, for tests of what zero does when user code raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class InjectedFailure(RuntimeError):
    """What :func:`failing_adamw`'s optimizers raise."""


def failing_adamw(
    fail_at: list[int], lr: float = 1e-2
) -> Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]:
    """An AdamW factory whose optimizers raise :class:`InjectedFailure` on the ``fail_at[0]``-th
    ``step`` call, counted over every optimizer it made (set ``fail_at[0] = 0``: never again).

    zero steps a flat partition range by range, one torch ``step`` call each, so ``fail_at``
    picks the range that fails.
    """
    calls = [0]

    class Failing(torch.optim.AdamW):
        def step(self, closure=None):  # type: ignore[override]
            calls[0] += 1
            if calls[0] == fail_at[0]:
                raise InjectedFailure("injected optimizer failure")
            return super().step(closure)

    return lambda ps: Failing(ps, lr=lr)
