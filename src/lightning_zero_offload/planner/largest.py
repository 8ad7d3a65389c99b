"""The largest model that fits with a plan's settings, and which memory bounds it.

Bytes grow with the model, so a bisection on the parameter count finds the largest that fits
(to 1 part in 10^4), as far as the planner counts (``inputs.MAX_PARAMS``). The memory short at
the first count that does not fit is what bounds it: ``"device"``, ``"host"``, or both (also
where no offload split fits both memories at once).
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_zero_offload.planner import inputs

Fit = tuple[bool | None, bool | None]  # (device fits, host fits); None: not known


def largest(fits_at: Callable[[int], Fit]) -> tuple[int, str | None]:
    """(the largest count ``n`` with both of ``fits_at(n)`` true, 0 if none; the memory that
    bounds it: ``"device"``, ``"host"`` or ``"device and host"``, None at the planner's limit)."""
    def ok(n: int) -> bool:
        return all(fits_at(n))

    lo, hi = 0, 1
    while ok(hi):
        if hi == inputs.MAX_PARAMS:  # as far as the planner counts
            return hi, None
        lo, hi = hi, min(hi * 2, inputs.MAX_PARAMS)
    while hi - lo > max(1, lo // 10**4):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    device, host = fits_at(hi)
    short = [name for name, fit in (("device", device), ("host", host)) if fit is False]
    return lo, " and ".join(short) or None
