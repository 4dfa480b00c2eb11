"""The one byte formatter of the stack: reports, messages and the command line print sizes with it."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(nbytes: float, *, binary: bool = False) -> str:
    """``nbytes`` for a reader.

    Decimal (default): one decimal in kB = 1e3 ... TB = 1e12, the smallest unit that prints
    below 1000 (``31.4 GB``), as memory formulas and model sizes are quoted. Binary: two
    decimals in KiB = 2**10 ... GiB = 2**30 (``1.50 MiB``), as buffers and files are sized.
    """
    if binary:
        if nbytes < 1024:
            return f"{nbytes:.0f} B"
        value = nbytes / 1024
        for unit in ("KiB", "MiB"):
            if value < 1024:
                return f"{value:.2f} {unit}"
            value /= 1024
        return f"{value:.2f} GiB"
    if round(nbytes) < 1000:
        return f"{nbytes:.0f} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if round(nbytes / scale, 1) < 1000:  # the smallest unit that prints below 1000
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e12:.1f} TB"
