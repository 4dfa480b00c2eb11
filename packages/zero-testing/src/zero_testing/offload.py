"""Recording doubles of ``zero_offload``'s host placement, for offloaded-optimizer tests on a CPU.

A CPU is its own host, so a split placement runs there with these doubles: a host memory
that keeps every buffer it allocated, and a side stream whose streams and events log to
the same list as :mod:`zero_testing.streams`' doubles. Needs ``zero-offload`` (extra
``[offload]``); ``import zero_testing`` alone does not import this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zero_testing.streams import RecordingStreamSource

try:
    from zero_offload import HostMemory, SideStream
except ImportError as exc:  # the extra is not installed
    raise ImportError("zero_testing.offload needs zero-offload: pip install 'zero-testing[offload]'") from exc

__all__ = ["RecordingMemory", "recording_side_stream"]


@dataclasses.dataclass(frozen=True)
class RecordingMemory(HostMemory):
    """Host memory that remembers every buffer it allocated."""

    allocated: list = dataclasses.field(default_factory=list, compare=False)

    def empty(self, numel, dtype=torch.float32):
        out = super().empty(numel, dtype)
        self.allocated.append(out)
        return out


def recording_side_stream(log: list[tuple[Any, ...]]) -> SideStream:
    """A side stream (named ``side``) on a :class:`RecordingStreamSource` logging on ``log``,
    whose compute stream is named ``compute``."""
    return SideStream(RecordingStreamSource(("side",), log))
