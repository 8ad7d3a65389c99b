"""Byte counts for people, in the unit that shows them (the planner's report and core's
host-memory errors): ``format_bytes(139776)`` is ``136.50 KiB``, not ``0.00 GiB``."""

from __future__ import annotations

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | float, exact: bool = False) -> str:
    """``n`` bytes in the largest binary unit it reaches (GiB at most), two decimals;
    ``exact`` appends the byte count, "12.50 MiB (13107200 bytes)"."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            text = f"{n / size:.2f} {unit}"
            return f"{text} ({int(n)} bytes)" if exact else text
    return f"{int(n)} bytes"
