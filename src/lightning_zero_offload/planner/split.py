"""The offload split of partial offload (``ZeroOffloadConfig.offload_fraction``): which buckets'
optimizer state stays on the device, and what a device-resident element costs there.

The trained state per rank is its shard of every bucket, buckets in reduction order. The
trailing buckets (whose gradients arrive last in backward: the model's first layers) stay on the
device, whole: the split whose host share is the nearest to ``offload_fraction``, or the one
above it (more on the host) where the nearer does not fit the device; the fraction reported is
the host's elements over all of them. What a device-resident element
costs the device is the engine's count (``core.buckets.device_budget``); it costs the host nothing.
The split is the engine's own (``core.buckets.placement``). ``"auto"`` keeps on the device only what
the host cannot hold (``resolve_auto``), then after the first step moves more while the device stays
within ``1 - device_memory_headroom`` of its memory (``most_on_device``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_zero_offload.core.buckets.placement import count_for, host_share
from lightning_zero_offload.planner import inputs

AUTO, DEFAULT_HEADROOM = inputs.AUTO, inputs.DEFAULT_HEADROOM


def host_fraction(shards: list[int], k: int) -> float:
    """The share of the trained elements on the host when the last ``k`` buckets stay on the
    device (the engine's ``core.buckets.placement.host_share``)."""
    return host_share(shards, k)


def device_buckets(shards: list[int], fraction: float,
                   fits: Callable[[int], bool] | None = None) -> int:
    """How many trailing buckets stay on the device for ``offload_fraction=fraction``: the
    whole-bucket split nearest to it, or the one above it (more on the host) where the nearer
    does not ``fits`` the device (the engine's ``core.buckets.placement.count_for``)."""
    return count_for(shards, fraction, fits)


def _first(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest ``k`` in ``[lo, hi]`` with ``ok(k)`` (``ok`` monotone), None if none."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def fewest(n_buckets: int, host_fits: Callable[[int], bool]) -> int:
    """The fewest device buckets whose host part fits; all of them when none does."""
    k = _first(0, n_buckets, host_fits)
    return n_buckets if k is None else k


def resolve_auto(n_buckets: int, host_fits: Callable[[int], bool],
                 device_fits: Callable[[int], bool]) -> int | None:
    """``"auto"`` at setup: the fewest device buckets whose host part fits the host, if their
    device part fits the device (``device_fits`` applies the headroom); None when none does."""
    k = _first(0, n_buckets, host_fits)
    return k if k is not None and device_fits(k) else None


def most_on_device(k: int, n_buckets: int, device_fits: Callable[[int], bool]) -> int:
    """``"auto"`` after the first step: the most device buckets, from ``k`` on, that keep the
    device within its headroom (``k`` itself when none more does)."""
    over = _first(k + 1, n_buckets, lambda j: not device_fits(j)) if k < n_buckets else None
    return n_buckets if over is None else max(k, over - 1)


def tried(sizes: Any, own: list[int], dev_mem: int | None, usable: int | None, ranks: int,
          headroom: float) -> dict[str, Any]:
    """The split "auto" came closest with: the fewest device buckets whose host part fits (all
    of them when none does), each memory's need there and what it may use."""
    def host(j: int) -> int:
        return sum(sizes(j)[1].values()) * ranks
    j = fewest(len(own), lambda i: usable is None or host(i) <= usable)
    return {"offload_fraction": host_fraction(own, j),
            "device_bytes": sum(sizes(j)[0].values()),
            "device_limit": None if dev_mem is None else int(dev_mem * (1 - headroom)),
            "host_bytes_per_node": host(j), "host_usable": usable}

