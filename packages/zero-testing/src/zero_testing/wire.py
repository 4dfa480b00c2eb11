"""Physical bytes a process writes (to sockets, files, pipes), from ``/proc/self/io``.

gloo moves data over TCP sockets, so the ``wchar`` delta around a collective
is the bytes this rank put on the wire (plus whatever else it wrote: print
nothing inside the window).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


def read_wchar() -> int:
    """Bytes written by this process so far (``wchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line (this needs Linux)")


@dataclasses.dataclass
class WireBytes:
    """Filled in when the :func:`measure_wire_bytes` block exits."""

    written: int = 0


@contextlib.contextmanager
def measure_wire_bytes() -> Iterator[WireBytes]:
    """``with measure_wire_bytes() as w: ...`` then ``w.written`` holds the bytes written inside."""
    box = WireBytes()
    start = read_wchar()
    try:
        yield box
    finally:
        box.written = read_wchar() - start
