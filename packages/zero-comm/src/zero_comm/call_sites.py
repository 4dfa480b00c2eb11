"""Engine-call signatures: ranks agree on which engine call they make before its collectives run.

A rank that makes an engine call the others do not (``engine.consolidated_state_dict()`` under
``if rank == 0:``, a save after one batch less, an extra forward) would issue collectives whose
sizes differ from the peers', and gloo aborts the process in C++ ("Received data size doesn't
match expected size") before any timeout fires. :meth:`zero_comm.CommWatchdog.check_call`
therefore starts each engine call with one all-gather of a fixed-size signature built here:
every engine call on every rank starts with the same 56 bytes, so the first call that differs
meets the peers' own signature, never a payload of another size, and every rank names both
call sites from the gathered rows alone.

Row layout (int64): ``[optimizer step, micro-step, collective count, site as 32 UTF-8 bytes]``.
The site is carried exactly (bytes, not a hash), so a mismatch message needs no second exchange.
The collective count is reported, not compared (groups of different sizes count differently).
"""

from __future__ import annotations

import torch

__all__ = ["FIELDS", "calls_differ", "describe_call", "mismatch_text", "signature"]

_SITE_BYTES = 32
FIELDS = 3 + _SITE_BYTES // 8
_COMPARED = [0, 1, *range(3, FIELDS)]


def signature(site: str, step: int, micro: int, call: int) -> torch.Tensor:
    """The int64 row of one engine call (``site`` is cut to 32 UTF-8 bytes)."""
    raw = site.encode("utf-8")[:_SITE_BYTES].ljust(_SITE_BYTES, b"\0")
    head = torch.tensor([step, micro, call], dtype=torch.int64)
    return torch.cat([head, torch.frombuffer(bytearray(raw), dtype=torch.int64)])


def calls_differ(rows: torch.Tensor) -> bool:
    """Whether the gathered rows (``world x FIELDS``) name different calls, steps or micro-steps."""
    picked = rows[:, _COMPARED]
    return not bool((picked == picked[0]).all())


def describe_call(rank: int, row: torch.Tensor) -> str:
    """``rank 0 calls engine.save_checkpoint at optimizer step 3, micro-step 3 (after call 41)``."""
    step, micro, call = (int(v) for v in row[:3])
    site = bytes(row[3:].contiguous().view(torch.uint8).tolist()).rstrip(b"\0").decode("utf-8", "replace")
    return f"rank {rank} calls {site} at optimizer step {step}, micro-step {micro} (after call {call})"


def mismatch_text(rows: torch.Tensor, ranks: list[int]) -> str:
    """The error every rank raises when the gathered calls differ (every rank's call, in rank order)."""
    lines = " while ".join(describe_call(r, rows[i]) for i, r in enumerate(ranks))
    return (
        f"{lines}: ranks took different paths (an engine call made on some ranks only, e.g. under "
        "`if rank == 0:`, or a different number of steps per rank: uneven data). Make every rank "
        "call the engine's collective methods (forward, backward, step, checkpoint and "
        "consolidation calls) in the same order"
    )
