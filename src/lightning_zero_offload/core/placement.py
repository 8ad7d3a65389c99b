"""Where each bucket shard's optimizer state lives: the host, or the device (partial offload).

The buckets whose gradients arrive last in backward (the trailing ones of the layout's reduction
order: the model's first layers, whose weights the next forward needs first, so their host round
trip could never be hidden) stay on the device, whole buckets, so the device part is always a
suffix of the buckets, and within each group a suffix of its host arrays: the host keeps a prefix
of every group, at the offsets of the full layout. Shares are counted in trained elements (the
fp32 master and both moments of one element are the same bytes wherever they live).
"""

from __future__ import annotations

import torch

from lightning_zero_offload._units import format_bytes
from lightning_zero_offload.core.layout import Layout

_TOLERANCE = 1e-9  # of the trained elements: a fraction printed from a count maps back to it


def count_for(shards: list[int], fraction: float) -> int:
    """How many trailing buckets (of these shard sizes, in reduction order) stay on the device
    at ``offload_fraction=fraction``: the fewest whose elements reach ``1 - fraction``."""
    total = sum(shards)
    need = (1.0 - fraction) * total - _TOLERANCE * total
    k = held = 0
    while held < need and k < len(shards):
        held += shards[len(shards) - 1 - k]
        k += 1
    return k


def host_share(shards: list[int], on_device: int) -> float:
    """Host elements over all when the last ``on_device`` buckets stay on the device."""
    total = sum(shards)
    return 1.0 if total == 0 else sum(shards[: len(shards) - on_device]) / total


def element_bytes(elem: int, accumulate: bool) -> int:
    """Device bytes of one device-resident element: fp32 master and both fp32 moments (12), a
    gradient in the compute dtype (``elem``), and an fp32 sum where the run accumulates in a
    half dtype (an fp32 gradient adds in place)."""
    return 12 + elem + (4 if accumulate and elem != 4 else 0)


def device_count(layout: Layout, fraction: float) -> int:
    """:func:`count_for` over the layout's buckets."""
    return count_for([b.shard for b in layout.buckets], fraction)


def host_fraction(layout: Layout, on_device: int) -> float:
    """The resolved ``offload_fraction``: :func:`host_share` over the layout's buckets."""
    return host_share([b.shard for b in layout.buckets], on_device)


def host_numel(layout: Layout, on_device: int) -> list[int]:
    """Per group, the elements of the host's prefix (all but the device's trailing buckets)."""
    out = [0] * len(layout.group_shard_numel)
    for bucket in layout.buckets[: len(layout.buckets) - on_device]:
        out[bucket.group] = max(out[bucket.group], bucket.host_offset + bucket.shard)
    return out


def bucket_device_bytes(shard: int, dtype: torch.dtype, accumulate: bool) -> int:
    """Device bytes of one device-resident bucket shard: fp32 master and both fp32 moments, a
    gradient buffer in the compute dtype, and an fp32 gradient where the run accumulates."""
    return shard * element_bytes(torch.empty((), dtype=dtype).element_size(), accumulate)


def device_bytes(layout: Layout, on_device: int, dtype: torch.dtype, accumulate: bool) -> int:
    """Device bytes of the trailing ``on_device`` buckets' state (:func:`bucket_device_bytes`)."""
    n = len(layout.buckets)
    return sum(bucket_device_bytes(b.shard, dtype, accumulate)
               for b in layout.buckets[n - on_device:] if on_device)


def check_device_part(layout: Layout, on_device: int, dtype: torch.dtype, accumulate: bool,
                      free: int | None, fraction: float, rank: int) -> None:
    """Setup, before any allocation: the fixed fraction's device part fits in ``free`` bytes
    (None: the device has no memory of its own; the caller has taken off what the weights will
    hold); else MemoryError naming the smallest fraction whose device part does fit."""
    need = device_bytes(layout, on_device, dtype, accumulate)
    if free is None or need <= free:
        return
    free = max(free, 0)
    fits = next(n for n in range(on_device, -1, -1)
                if device_bytes(layout, n, dtype, accumulate) <= free)
    raise MemoryError(
        f"ZeroOffload: offload_fraction={fraction} keeps {format_bytes(need)} of optimizer state "
        f"on rank {rank}'s device, but only {format_bytes(free)} of it is free; the smallest "
        f"fraction whose device part fits is {host_fraction(layout, fits):.4f} "
        f"(offload_fraction={_ceil4(host_fraction(layout, fits))}), or use "
        'offload_fraction="auto" to choose it')


def _ceil4(x: float) -> float:
    """``x`` rounded up to 4 decimals (a fraction the user can pass that still fits)."""
    return min(1.0, -(-round(x * 1e4, 6) // 1) / 1e4)
