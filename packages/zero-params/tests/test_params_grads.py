"""reduce_scatter_grads against an all-reduce reference; optimizer-owned flat buffers; commit_shards."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from params_cases import reference_partition, run
from torch import nn

import zero_params as zp
from zero_comm import CommLedger, NativeReduceScatter, Topology
from zero_testing import max_rel_to_magnitude

pytest_plugins = ("params_worlds",)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))  # numel 91, 13, 65, 5


def _reference_grads(ref_model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Full gradients averaged over the world with a plain all_reduce."""
    ref_model.zero_grad()
    ref_model(x).pow(2).sum().backward()
    out = []
    for p in ref_model.parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def _reduce_scatter_accumulates(threshold):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ref_model = copy.deepcopy(model)
    states = zp.partition(model, persistence_threshold=threshold)
    params = list(model.parameters())
    expected = [torch.zeros(s.partition_numel) for s in states]
    grads_freed, counts, errors_after_one = [], [], None
    for micro in range(2):
        torch.manual_seed(100 + 10 * rank + micro)  # different data on every rank
        x = torch.randn(4, 7)
        zp.gather(params).wait()
        model(x).pow(2).sum().backward()
        for e, g in zip(expected, _reference_grads(ref_model, x)):
            e += reference_partition(g, world, rank)
        if micro == 1:
            zp.release(params)  # as after a module's backward: only the full .grad remains
        with CommLedger(Topology()) as ledger:
            handle = zp.reduce_scatter_grads(params, async_op=micro == 1)
            grads_freed.append(all(p.grad is None for p in params))
            handle.wait()
        counts.append((ledger.count(op="reduce_scatter"), ledger.count()))
        zp.release(params)
        errs = [max_rel_to_magnitude(s.grad_partition, e) for s, e in zip(states, expected)]
        if micro == 0:
            errors_after_one = errs
    return errors_after_one, errs, grads_freed, counts, [s.persistent for s in states]


def test_reduce_scatter_grads_is_the_averaged_partition_and_accumulates(dist, world):
    for threshold in (0, 13):
        for first, second, freed, counts, persistent in run(
            dist, world, _reduce_scatter_accumulates, threshold
        ):
            assert max(first) < 1e-6 and max(second) < 1e-6, (first, second)
            assert freed == [True, True]
            assert counts == [(1, 1), (1, 1)]  # persistent parameters ride in the same collective
            assert persistent == ([False] * 4 if threshold == 0 else [False, True, False, True])


def _flat_buffers_and_commit(lr):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ref_model = copy.deepcopy(model)
    states = zp.partition(model, persistence_threshold=13)
    params = list(model.parameters())
    total = sum(s.partition_numel for s in states)
    flat_grad, flat_weight = torch.zeros(total), torch.zeros(total)
    offset = 0
    for s in states:
        n = s.partition_numel
        s.bind_grad_partition(flat_grad[offset : offset + n])
        s.bind_shard(flat_weight[offset : offset + n])
        offset += n
    torch.manual_seed(7 + rank)
    x = torch.randn(3, 7)
    zp.gather(params).wait()
    model(x).pow(2).sum().backward()
    zp.reduce_scatter_grads(params)
    zp.release(params)
    ref_grads = _reference_grads(ref_model, x)
    grad_err = max(
        max_rel_to_magnitude(s.grad_partition, reference_partition(g, world, rank))
        for s, g in zip(states, ref_grads)
    )
    in_flat = all(s.grad_partition.data_ptr() >= flat_grad.data_ptr() for s in states)
    flat_weight.sub_(lr * flat_grad)  # one fused "optimizer step" on the flat buffer
    with CommLedger(Topology()) as ledger:
        zp.commit_shards(params)  # persistent parameters are refreshed from the new shards
    refreshed = ledger.count(op="all_gather")
    zp.gather(params).wait()
    errs = [
        max_rel_to_magnitude(p.detach(), (r.detach() - lr * g))
        for p, r, g in zip(params, ref_model.parameters(), ref_grads)
    ]
    zp.release(params)
    bad = []
    for what, fn in {
        "size": lambda: states[0].bind_grad_partition(torch.zeros(states[0].partition_numel + 1)),
        "dtype": lambda: states[0].bind_shard(torch.zeros(states[0].partition_numel, dtype=torch.float64)),
    }.items():
        try:
            fn()
        except ValueError as e:
            bad.append((what, str(e)))
    return grad_err, in_flat, refreshed, errs, bad


def test_optimizer_owned_flat_buffers_and_commit_shards(dist, world):
    for grad_err, in_flat, refreshed, errs, bad in run(dist, world, _flat_buffers_and_commit, 0.5):
        assert grad_err < 1e-6 and in_flat
        assert refreshed == 1  # one coalesced all-gather refreshes both persistent biases
        assert max(errs) < 1e-6, errs
        assert [w for w, _ in bad] == ["size", "dtype"]
        assert all("partition size" in m for _, m in bad)


def _unpartitioned_rejected():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    try:
        zp.reduce_scatter_grads([p])
    except TypeError as e:
        return str(e)
    return ""


def test_reduce_scatter_grads_rejects_unpartitioned_parameters(dist, world):
    assert "not partitioned" in run(dist, world, _unpartitioned_rejected)[0]


def _native_like_the_exchange():
    """Partitioned parameters reduced by NativeReduceScatter (as on NCCL): the exchange's partitions."""
    got = []
    for strategy in (NativeReduceScatter(), None):
        model = _model()
        states = zp.partition(model, persistence_threshold=13, reduce_strategy=strategy)
        params = list(model.parameters())
        torch.manual_seed(100 + dist.get_rank())
        zp.gather(params).wait()
        model(torch.randn(4, 7)).pow(2).sum().backward()
        zp.reduce_scatter_grads(params).wait()
        zp.release(params)
        got.append([s.grad_partition.clone() for s in states])
    return [(torch.equal(a, b), torch.allclose(a, b, rtol=1e-5, atol=1e-7)) for a, b in zip(*got)]


def test_the_native_reduce_scatter_gives_the_exchange_partitions(dist, world):
    bitwise = world <= 2  # beyond two ranks gloo's sum order is its own
    for same in run(dist, world, _native_like_the_exchange):
        assert len(same) == 4 and all(equal if bitwise else close for equal, close in same), same
