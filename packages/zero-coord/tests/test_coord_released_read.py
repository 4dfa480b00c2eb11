"""Backward reading a saved view of a parameter that was released and not gathered again raises
a ``PartitionedParameterError`` naming the parameter and the fix (not torch's opaque
``setStorage ... out of bounds for storage of size 0``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from coord_cases import build, coordinate, over_worlds, rank_input
from torch import nn

import zero_params


class Escape(nn.Module):
    """Uses ``b.weight`` outside ``b``'s forward (gathered by hand), so ``b``'s backward hooks never run."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with zero_params.GatheredParameters([self.b.weight]):
            return F.linear(h, self.b.weight)


def _escaping_read(rank):
    model, _ = build(Escape)
    coord = coordinate(model)
    loss = model(rank_input(0, rank.rank, (4, 5))).square().sum()
    released = zero_params.state_of(model.b.weight).unsharded.nbytes
    try:
        loss.backward()
    except zero_params.PartitionedParameterError as exc:
        message = str(exc)
    else:
        message = None
    coord.remove()
    return released, message


@over_worlds
def test_backward_reading_a_released_parameter_names_it(dist, world):
    for released, message in dist.run(world, _escaping_read):
        assert released == 0
        assert message is not None, "backward read a released parameter without a PartitionedParameterError"
        assert "'b.weight'" in message and "GatheredParameters" in message, message
