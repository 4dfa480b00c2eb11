"""The checkpoint's few collectives: small JSON exchanges that give up after a timeout.

Every rank reports its status (an error string or ``None``, file lists) through
:func:`exchange`; a rank that died or stopped participating makes the others raise a
:class:`~zero_full.checkpoint.io.CheckpointError` after ``timeout`` seconds instead of hanging.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

import zero_comm
from zero_comm.torch_compat import all_gather_single
from zero_full.checkpoint.io import CheckpointError

__all__ = ["exchange", "raise_if_failed"]


def exchange(obj: Any, timeout: float) -> list[Any]:
    """All-gather one JSON-able object per rank, waiting at most ``timeout`` seconds per collective.

    Raises:
        CheckpointError: a collective did not complete within ``timeout`` (a rank died or does
            not take part), naming this rank and the timeout.
    """
    data = json.dumps(obj).encode("utf-8")
    world = dist.get_world_size()
    if world == 1:
        return [obj]
    device = zero_comm.control_device()
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    try:
        with record_function("zero.checkpoint.exchange"):
            mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
            _wait(all_gather_single(sizes, mine, async_op=True), timeout)
            sizes = sizes.cpu()
            width = int(sizes.max())
            mine = torch.zeros(width, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out = torch.empty(world * width, dtype=torch.uint8, device=device)
            _wait(all_gather_single(out, mine.to(device), async_op=True), timeout)
            out = out.cpu()
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint: rank {dist.get_rank()} gave up waiting for the other ranks ({timeout:g} s "
            f"timeout, robustness.comm_timeout, or a rank died): {exc}"
        ) from exc
    rows = out.view(world, width)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode("utf-8")) for r in range(world)]


def _wait(work: dist.Work, timeout: float) -> None:
    """Wait at most ``timeout`` seconds, polling: a timed wait on NCCL would abort the communicator."""
    if not zero_comm.wait_polled(work, timeout, timeout=timeout):
        raise RuntimeError(f"no answer within {timeout:g} s")


def raise_if_failed(statuses: list[Any], what: str) -> None:
    """Raise on every rank if any rank reported an error (``statuses[r]`` truthy)."""
    errors = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
    if errors:
        raise CheckpointError(f"{what} failed:\n  " + "\n  ".join(errors))
