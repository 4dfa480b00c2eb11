"""Global-norm clipping over gradient partitions equals torch.nn.utils.clip_grad_norm_ on the whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_optim import PartitionedOptimizer, ReplicaPartitioning, clip_grad_norm_, global_grad_norm

SHAPES = [(0,), (1,), (7,), (3, 5), (1023,), (13, 11), (2,)]


def _model():
    torch.manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in SHAPES)


def _full_grads(scale):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(*s, generator=g) * scale for s in SHAPES]


def _clip(rank, max_norm, scale, replicated):
    """This rank's partitions of the whole gradients; clip; gather the clipped partitions back."""
    world, r = (1, 0) if replicated else (rank.world_size, rank.rank)
    model = _model()
    part = ReplicaPartitioning(world, r)
    opt = PartitionedOptimizer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), part)
    grads = _full_grads(scale)
    for group, seg in opt.segments():
        p = seg.param
        p.grad = grads[int(seg.name.split(".")[-1])]
        full = torch.zeros(seg.numel * world)
        full[: p.numel()] = p.grad.reshape(-1)
        group.grad_view(seg).copy_(full[r * seg.numel : (r + 1) * seg.numel])
    norm = clip_grad_norm_(opt.groups, max_norm, partitioned=not replicated)
    clipped = {}
    for group, seg in opt.segments():
        n = seg.param.numel()
        start = min(r * seg.numel, n)
        stop = min(start + seg.numel, n)
        clipped[seg.name] = (start, stop, group.grad_view(seg)[: stop - start].clone())
    return norm, clipped


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("max_norm,scale", [(1e3, 1.0), (0.5, 1e-3)])
def test_clipping_equals_torch_clip_grad_norm_on_the_whole_model(dist, world, max_norm, scale):
    ref = _model()
    for p, g in zip(ref, _full_grads(scale)):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    expected = {str(i): p.grad.reshape(-1) for i, p in enumerate(ref)}
    for replicated in (False, True):
        results = dist.run(world, _clip, max_norm, scale, replicated)
        covered = {name: 0 for name in expected}
        for norm, clipped in results:
            assert norm == pytest.approx(ref_norm, rel=1e-6)
            for name, (start, stop, values) in clipped.items():
                torch.testing.assert_close(values, expected[name][start:stop], rtol=1e-6, atol=0)
                covered[name] += stop - start
        for name, count in covered.items():
            assert count == expected[name].numel() * (world if replicated else 1)


def _norm_without_sum(rank):
    model = _model()
    opt = PartitionedOptimizer(model, None, ReplicaPartitioning(rank.world_size, rank.rank))
    for g in opt.groups:
        g.grad.fill_(1.0)
    return global_grad_norm(opt.groups), global_grad_norm(opt.groups, partitioned=False)


def test_partitioned_norm_sums_over_ranks_once(dist):
    (a, b), (c, d) = dist.run(2, _norm_without_sum)
    assert a == c and b == d
    assert a == pytest.approx((2 * b * b) ** 0.5)


def test_non_positive_max_norm_is_refused():
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_grad_norm_([], 0.0)
