"""Engine-call signatures: ranks agree on which engine call they make before its collectives run.

A rank that makes an engine call the others do not (``engine.consolidated_state_dict()`` under
``if rank == 0:``, a save after one batch less, an extra forward) would issue collectives whose
sizes differ from the peers', and gloo aborts the process in C++ ("Received data size doesn't
match expected size") before any timeout fires. :meth:`zero_comm.CommWatchdog.check_call`
therefore starts each engine call with one all-gather of a fixed-size signature built here:
every engine call on every rank starts with the same 64 bytes, so the first call that differs
meets the peers' own signature, never a payload of another size, and every rank names both
call sites from the gathered rows alone.

Row layout (int64): ``[optimizer step, micro-step, collective count, quiet calls, site as 32
UTF-8 bytes]``. The site is carried exactly (bytes, not a hash), so a mismatch message needs no
second exchange. The collective count is reported, not compared (groups of different sizes
count differently). *Quiet calls* are the engine calls since the last check that issued no
collective (a forward outside stage 3) and so were not checked themselves: compared, a rank
that skipped one (a backward skipped on a non-finite loss) is still named, at its next check.

The check runs at every forward, backward and optimizer step, so its per-call work is kept to
the exchange itself: :class:`CallExchange` fixes a group's ranks, device, output buffer and
site words once, and compares the gathered rows as Python integers.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import torch.distributed as dist

from zero_comm.devices import control_device
from zero_comm.torch_compat import all_gather_single

__all__ = ["FIELDS", "CallExchange", "calls_differ", "describe_call", "mismatch_text", "signature"]

_SITE_BYTES = 32
FIELDS = 4 + _SITE_BYTES // 8
_COMPARED = [0, 1, *range(3, FIELDS)]
_SITE_WORDS = struct.Struct(f"={_SITE_BYTES // 8}q")  # native order, as torch reads the bytes
_CACHED_SITES = 64


def _site_words(site: str) -> tuple[int, ...]:
    """``site`` cut to 32 UTF-8 bytes, zero-padded, as four int64 words."""
    return _SITE_WORDS.unpack(site.encode("utf-8")[:_SITE_BYTES].ljust(_SITE_BYTES, b"\0"))


def signature(site: str, step: int, micro: int, call: int, quiet: int = 0) -> torch.Tensor:
    """The int64 row of one engine call (``site`` is cut to 32 UTF-8 bytes)."""
    return torch.tensor([step, micro, call, quiet, *_site_words(site)], dtype=torch.int64)


def calls_differ(rows: torch.Tensor) -> bool:
    """Whether the gathered rows (``world x FIELDS``) name different calls, steps or micro-steps."""
    picked = rows[:, _COMPARED]
    return not bool((picked == picked[0]).all())


def describe_call(rank: int, row: torch.Tensor) -> str:
    """``rank 0 calls engine.save_checkpoint at optimizer step 3, micro-step 3 (after call 41)``."""
    step, micro, call, quiet = (int(v) for v in row[:4])
    site = bytes(row[4:].contiguous().view(torch.uint8).tolist()).rstrip(b"\0").decode("utf-8", "replace")
    after = f"after call {call}"
    if quiet:
        after += f"; {quiet} unchecked engine calls since its last checked call"
    return f"rank {rank} calls {site} at optimizer step {step}, micro-step {micro} ({after})"


def mismatch_text(rows: torch.Tensor, ranks: list[int]) -> str:
    """The error every rank raises when the gathered calls differ (every rank's call, in rank order)."""
    lines = " while ".join(describe_call(r, rows[i]) for i, r in enumerate(ranks))
    return (
        f"{lines}: ranks took different paths (an engine call made on some ranks only, e.g. under "
        "`if rank == 0:` or a backward skipped on one rank, or a different number of steps per "
        "rank: uneven data). Make every rank call the engine's collective methods (forward, "
        "backward, step, checkpoint and consolidation calls) in the same order"
    )


def _timed_wait_safe(group: Any, device: torch.device) -> bool:
    """Whether the exchange's work is gloo's (its timed wait carries on when it expires)."""
    name = str(dist.get_backend(group))
    return device.type == "cpu" and (name == "gloo" or "cpu:gloo" in name)


class CallExchange:
    """One group's engine-call all-gather, set up once: ranks, device, output buffer, site words.

    Per call only the row is built (one small tensor from a list) and the gathered rows are
    compared as Python integers. The output buffer is reused; :meth:`renew` replaces it after a
    wait that failed (the backend may still write into it).

    Args:
        group: The process group (``None``: the default group).
        ranks: Its global ranks, in group order.
    """

    __slots__ = ("_out", "_sites", "device", "group", "ranks", "timed")

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group = group
        self.ranks = ranks
        self.device = control_device(group)
        self.timed = _timed_wait_safe(group, self.device)
        self._out = torch.empty(len(ranks) * FIELDS, dtype=torch.int64, device=self.device)
        self._sites: dict[str, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return f"CallExchange(ranks={self.ranks}, device={self.device}, timed_wait={self.timed})"

    def start(self, site: str, step: int, micro: int, call: int, quiet: int = 0) -> Any:
        """Issue the all-gather of this call's row (asynchronous); returns its work."""
        words = self._sites.get(site)
        if words is None:
            words = _site_words(site)
            if len(self._sites) < _CACHED_SITES:
                self._sites[site] = words
        row = torch.tensor([step, micro, call, quiet, *words], dtype=torch.int64, device=self.device)
        return all_gather_single(self._out, row, group=self.group, async_op=True)

    def renew(self) -> None:
        """A fresh output buffer (the last wait failed: its work may still write the old one)."""
        self._out = torch.empty_like(self._out)

    def mismatch(self) -> str:
        """``""`` when the gathered rows name the same call; else the error text (:func:`mismatch_text`)."""
        flat = self._out.tolist()
        first = flat[:FIELDS]
        for at in range(FIELDS, len(flat), FIELDS):
            row = flat[at : at + FIELDS]
            if row[0] != first[0] or row[1] != first[1] or row[3:] != first[3:]:
                return mismatch_text(self._out.cpu().view(len(self.ranks), FIELDS), self.ranks)
        return ""
