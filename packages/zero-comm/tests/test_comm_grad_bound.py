"""GradientBound alone: the sideband, the fp32 running sum, reset (the collectives: zero-optim's tests)."""

from __future__ import annotations

import math

import pytest
import torch

from zero_comm import GradientBound


def test_the_sideband_is_the_largest_magnitude_and_propagates_nan():
    bound = GradientBound(3)
    a, b = torch.tensor([1.0, -7.5, 2.0]), torch.tensor([[4.0, 0.5]])
    assert torch.equal(bound.sideband([a, b]), torch.full((3,), 7.5))
    assert torch.equal(bound.sideband([torch.zeros(0)]), torch.zeros(3))
    assert math.isnan(bound.sideband([a, torch.tensor([float("nan")])])[0].item())
    flat = torch.tensor([3.0, -9.0, 1.0, 2.0])
    assert bound.sideband([flat[2:], flat[:2]])[1].item() == 9.0  # regions of one buffer, either order
    assert not bound.nonfinite()  # nothing received yet
    bound.received(torch.tensor([1.0e38], dtype=torch.bfloat16))
    bound.received(torch.tensor([3.0e38]))
    assert bound.nonfinite()  # summed in fp32: 4e38 overflows
    bound.reset()
    bound.received(torch.tensor([2.0]))
    assert not bound.nonfinite()
    with pytest.raises(ValueError, match="needs the bucket's gradients"):
        bound.sideband([])


def test_carried_appends_the_sideband_and_split_takes_it_back():
    bound = GradientBound(2)
    grads = [torch.tensor([1.0, -3.0]), torch.tensor([2.0])]
    sent = bound.carried(grads)
    assert len(sent) == 3 and sent[0] is grads[0] and torch.equal(sent[2], torch.tensor([3.0, 3.0]))
    assert bound.carried([]) == []
    reduced = [torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([float("inf")])]
    assert bound.split(reduced) == reduced[:2] and bound.nonfinite()
    with pytest.raises(ValueError, match="world must be >= 1"):
        GradientBound(0)
