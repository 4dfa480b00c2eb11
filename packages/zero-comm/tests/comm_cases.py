"""Shared cases of the zero-comm tests (imported by the test modules and by the spawned ranks)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zero_comm import CommWatchdog

# (world_size, ranks_per_node). Session scope makes pytest run every test of one world
# size together, so the pooled ranks are reused instead of restarted.
WORLDS = [pytest.param((1, 1), id="w1"), pytest.param((2, 2), id="w2"), pytest.param((4, 2), id="2x2")]
over_worlds = pytest.mark.parametrize("spec", WORLDS, scope="session")


def run_on(dist, spec: tuple[int, int], fn, *args):
    """Run ``fn(*args)`` on the ranks of ``spec`` (world size, ranks per node); the per-rank results."""
    world, ranks_per_node = spec
    return dist.run(world, fn, *args, ranks_per_node=ranks_per_node)


# Shard / tensor numels: empty, one, small odd, primes, one below a power of two.
ODD_SIZES = [0, 1, 7, 131, 1023, 4099]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rank_tensor(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype, integer: bool = False):
    """Deterministic data that differs per rank and per seed."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if integer:
        return torch.randint(-64, 64, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def same_buffer(views: list[torch.Tensor], flat_ptr: int | None = None) -> bool:
    """All views live in one buffer, laid out one after another (from ``flat_ptr`` if given).

    Empty views have no address (``data_ptr() == 0``) and are skipped.
    """
    es = views[0].element_size()
    offsets, offset = [], 0
    for v in views:
        offsets.append(offset)
        offset += v.numel()
    located = [(v.data_ptr(), off) for v, off in zip(views, offsets) if v.numel()]
    if not located:
        return True
    base = located[0][0] - located[0][1] * es if flat_ptr is None else flat_ptr
    return all(ptr == base + off * es for ptr, off in located)


def result_of(returned, async_op: bool):
    """The result of a zero-comm call: a handle with ``async_op`` (waited here), the result itself otherwise.

    Checks the convention of ``torch.distributed``: a synchronous call returns its result, an
    asynchronous one a handle whose repeated ``wait()`` returns the same object.
    """
    if not async_op:
        assert not hasattr(returned, "wait"), f"a synchronous call returned {type(returned).__name__}"
        return returned
    result = returned.wait()
    assert returned.wait() is result and returned.is_completed()
    return result


def one_storage(views: list[torch.Tensor]) -> bool:
    """All non-empty views share one storage (unpadded partitions: one buffer, with gaps)."""
    ptrs = {v.untyped_storage().data_ptr() for v in views if v.numel()}
    return len(ptrs) <= 1


def unpad(padded: list[torch.Tensor], tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """The real elements of this rank's padded partitions (the reference for the unpadded results)."""
    import torch.distributed as tdist

    from zero_comm import shard_range

    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    out = []
    for p, t in zip(padded, tensors):
        start, stop = shard_range(t.numel(), world, rank)
        out.append(p[: stop - start])
    return out


@contextlib.contextmanager
def watchdog_pair(
    timeout: float = 0.6, interval: float = 0.05, beat_peer: bool = True
) -> Iterator[tuple[CommWatchdog, CommWatchdog]]:
    """Watchdogs of "ranks" 0 and 1 of world 2 in this process, sharing one ``HashStore``; both
    closed on exit. ``beat_peer=False``: rank 1 is closed at once (its last report stays in the
    store, its heartbeat stops)."""
    store = dist.HashStore()
    me = CommWatchdog(store, 0, 2, timeout=timeout, heartbeat_interval=interval)
    peer = CommWatchdog(store, 1, 2, timeout=timeout, heartbeat_interval=interval)
    if not beat_peer:
        peer.close()
    try:
        yield me, peer
    finally:
        me.close()
        peer.close()


class NeverDone:
    """A collective's work that never completes; with ``error``, one that failed at once (``wait`` raises)."""

    def __init__(self, error: str = "") -> None:
        self.error = error

    def is_completed(self) -> bool:
        return bool(self.error)

    def wait(self, timeout=None):
        if not self.error:
            raise AssertionError("polled, never waited on")
        raise RuntimeError(self.error)


class Done:
    """A collective's work that has completed."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def failed_wait(
    wd: CommWatchdog, error: type[Exception], work: Any = None, *, match: str | None = None
) -> tuple[str, float]:
    """``wd.wait(work)`` (``work``: a :class:`NeverDone` unless given) must raise ``error`` (its
    message matching ``match``): the message and the seconds the wait took."""
    start = time.monotonic()
    with pytest.raises(error, match=match) as info:
        wd.wait(NeverDone() if work is None else work)
    return str(info.value), time.monotonic() - start
