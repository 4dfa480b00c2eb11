"""Helpers shared by the zero-params tests (imported by the spawned ranks too)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zero_params as zp


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages allocated by torch ops inside the block.

    Every op output whose storage is new (not the storage of one of the op's inputs) is
    tracked from its creation until the storage is freed (a weak reference to the storage's
    Python object, which torch keeps alive exactly as long as the storage). A tracked
    storage counts with its current size, so a storage resized to 0 bytes (a released
    parameter's unsharded storage) counts 0. The peak is sampled after each op. Storages
    that existed before the block are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._tracked: dict[int, weakref.ref] = {}

    @property
    def live(self) -> int:
        """Bytes the tracked storages hold right now."""
        total = 0
        for key, ref in list(self._tracked.items()):
            s = ref()
            if s is None:
                del self._tracked[key]
            else:
                total += s.nbytes()
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            key = id(s)
            known = self._tracked.get(key)
            if key in inputs or (known is not None and known() is s) or s.nbytes() == 0:
                continue
            self._tracked[key] = weakref.ref(s)
        self.peak = max(self.peak, self.live)
        return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    with torch._C.DisableTorchFunction():
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_bytes(params: Sequence[nn.Parameter]) -> int:
    """Bytes held by parameters' data plus their shards (distinct storages)."""
    tensors: list[torch.Tensor] = []
    with torch._C.DisableTorchFunction():
        for p in params:
            tensors.append(p.data)
            if zp.is_partitioned(p):
                tensors.append(zp.state_of(p).shard)
    return storage_bytes(tensors)


def wait_freed(refs: Sequence[weakref.ref], timeout: float = 5.0) -> bool:
    """Whether every weakly referenced storage is freed within ``timeout`` seconds.

    gloo's worker thread drops its reference to a finished collective's output a moment
    after ``wait()`` returns, so a released buffer may outlive ``release()`` briefly.
    """
    deadline = time.monotonic() + timeout
    while any(r() is not None for r in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def reference_partition(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Partition ``rank`` of ``full`` flattened and zero-padded to a multiple of ``world``."""
    n = full.numel()
    part = -(-n // world)
    padded = torch.zeros(world * part, dtype=full.dtype)
    padded[:n] = full.reshape(-1)
    return padded[rank * part : (rank + 1) * part]


class Node(nn.Module):
    """A module of a random tree: parameters named ``p<i>``, children named by path segment."""


def build_tree(spec: Sequence[tuple[str, tuple[int, ...]]], seed: int) -> nn.Module:
    """``spec`` = ``[(path, shape), ...]`` with paths like ``"a.b"``; values from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    root = Node()
    for i, (path, shape) in enumerate(spec):
        mod = root
        for part in [s for s in path.split(".") if s]:
            if part not in mod._modules:
                mod.add_module(part, Node())
            mod = mod._modules[part]
        mod.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=gen)))
    return root


def world_info() -> tuple[int, int]:
    return dist.get_world_size(), dist.get_rank()


def run(dist_fixture: Any, world: int, fn: Any, *args: Any) -> list[Any]:
    """``dist.run`` with the pool layout every zero-params test shares: world 4 runs as
    2 nodes x 2 ranks (so hpZ tests reuse the same ranks), smaller worlds as one node."""
    return dist_fixture.run(world, fn, *args, ranks_per_node=2 if world == 4 else world)
