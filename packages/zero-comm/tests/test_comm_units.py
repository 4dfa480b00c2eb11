"""``zero_comm.units.format_bytes``: decimal sizes (memory formulas) and binary sizes (buffers, files)."""

from __future__ import annotations

import pytest

from zero_comm.units import format_bytes


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (999.7, "1.0 kB"),
        (1500, "1.5 kB"),
        (999_960_000, "1.0 GB"),
        (1.875e9, "1.9 GB"),
        (31.40625e9, "31.4 GB"),
        (2.5e15, "2500.0 TB"),
    ],
)
def test_format_bytes(nbytes: float, text: str) -> None:
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1024**2 - 1, "1024.00 KiB"),
        (1024**2, "1.00 MiB"),
        (5 * 1024**3 // 2, "2.50 GiB"),
        (3 * 1024**4, "3072.00 GiB"),
    ],
)
def test_format_bytes_binary(nbytes: int, text: str) -> None:
    assert format_bytes(nbytes, binary=True) == text
