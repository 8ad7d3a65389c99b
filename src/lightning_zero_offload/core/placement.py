"""Where each bucket shard's optimizer state lives: the host, or the device (partial offload).

The buckets whose gradients arrive last in backward (the trailing ones of the layout's reduction
order: the model's first layers, whose weights the next forward needs first, so their host round
trip could never be hidden) stay on the device, whole buckets, so the device part is always a
suffix of the buckets, and within each group a suffix of its host arrays: the host keeps a prefix
of every group, at the offsets of the full layout. Shares are counted in trained elements (the
fp32 master and both moments of one element are the same bytes wherever they live).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from lightning_zero_offload.core.layout import Layout

T = TypeVar("T")

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


def where(layout: Layout, resident: Sequence[T], b: int) -> T | None:
    """Where bucket ``b``'s state lives: its stage among the device's trailing ``resident``
    ones, or None where the host holds it. The one place that answers it."""
    first = len(layout.buckets) - len(resident)
    return resident[b - first] if b >= first else None
