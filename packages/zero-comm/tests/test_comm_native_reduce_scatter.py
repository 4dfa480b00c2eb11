"""NativeReduceScatter (the backend's reduce_scatter_tensor) against the exchange; the choice per backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from comm_cases import DTYPES

from zero_comm import (
    AllToAllReduceScatter,
    CommLedger,
    NativeReduceScatter,
    Topology,
    has_native_reduce_scatter,
    partition_numel,
    reduce_scatter_strategy,
)

NUMELS = ([1023], [7, 0, 131, 1], [3], [4099, 2])


def _against_exchange(rank):
    """Same padded partitions as AllToAllReduceScatter: bit for bit at two ranks, fp32-close beyond."""
    world = rank.world_size
    gen = torch.Generator().manual_seed(7 + rank.rank)
    native, exchange = NativeReduceScatter(), AllToAllReduceScatter()
    checked = 0
    for dtype in DTYPES.values():
        for numels in NUMELS:
            tensors = [torch.randn(n, generator=gen).to(dtype) for n in numels]
            before = [t.clone() for t in tensors]
            for op in ("sum", "avg"):
                for async_op in (False, True):
                    got = native.reduce_scatter_coalesced(tensors, op=op, async_op=async_op).wait()
                    ref = exchange.reduce_scatter_coalesced(tensors, op=op).wait()
                    for t, b, g, r in zip(tensors, before, got, ref):
                        assert torch.equal(t, b), "NativeReduceScatter wrote into its input"
                        assert g.dtype == dtype and g.shape == (partition_numel(t.numel(), world),)
                        if world <= 2:
                            assert torch.equal(g, r), (dtype, numels, op, (g.float() - r.float()).abs().max())
                        else:
                            torch.testing.assert_close(
                                g, r, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6
                            )
                        checked += 1
    return checked


@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_the_exchange(dist, world):
    expected = sum(len(n) for n in NUMELS) * len(DTYPES) * 2 * 2
    assert dist.run(world, _against_exchange) == [expected] * world


def _reduce_dtype(rank):
    """bf16 reduced in bf16 on request (rounded per add), in fp32 by default; fp32 bytes on the wire."""
    world = rank.world_size
    t = torch.full((2 * world,), 1.0 + 2**-8, dtype=torch.float32).to(torch.bfloat16) * (rank.rank + 1)
    with CommLedger(Topology()) as ledger:
        wide = NativeReduceScatter().reduce_scatter_coalesced([t], op="sum").wait()[0]
    narrow = (
        NativeReduceScatter(reduce_dtype=torch.bfloat16).reduce_scatter_coalesced([t], op="sum").wait()[0]
    )
    full = t.float().clone()
    tdist.all_reduce(full)
    assert torch.equal(wide, full[:2].to(torch.bfloat16) if rank.rank == 0 else full[2:4].to(torch.bfloat16))
    assert narrow.dtype == torch.bfloat16
    (entry,) = ledger.select(step=0)
    assert entry.payload_bytes == t.numel() * 4  # sent as fp32
    return repr(NativeReduceScatter(reduce_dtype=torch.bfloat16))


def test_reduce_dtype_and_wire_bytes(dist):
    assert dist.run(2, _reduce_dtype) == [
        f"NativeReduceScatter(group_size=2, group_rank={r}, reduce_dtype=torch.bfloat16)" for r in range(2)
    ]


@pytest.mark.parametrize(
    ("backend", "native"),
    [
        ("nccl", True),
        ("cpu:gloo,cuda:nccl", True),
        ("xccl", True),
        ("gloo", False),
        ("cuda:fake", False),
        ("mpi", False),
    ],
)
def test_backend_names(backend, native):
    assert has_native_reduce_scatter(backend) is native


def _chosen(rank):
    on_gloo = reduce_scatter_strategy()
    on_nccl = reduce_scatter_strategy(backend="cpu:gloo,cuda:nccl", reduce_dtype=torch.float32)
    return type(on_gloo).__name__, type(on_nccl).__name__, on_nccl.reduce_dtype


def test_choice_follows_the_group_backend(dist):
    assert dist.run(2, _chosen) == [("AllToAllReduceScatter", "NativeReduceScatter", torch.float32)] * 2


def _bad(rank):
    with pytest.raises(ValueError, match="floating-point"):
        NativeReduceScatter().reduce_scatter_coalesced([torch.ones(4, dtype=torch.int64)], op="sum")
    with pytest.raises(ValueError, match="reduce_dtype"):
        NativeReduceScatter(reduce_dtype=torch.int32)
    return True


def test_bad_inputs_are_named(dist):
    assert dist.run(2, _bad) == [True, True]
