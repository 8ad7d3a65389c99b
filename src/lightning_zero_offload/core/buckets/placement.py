"""How many buckets keep their optimizer state on the device (partial offload): the split.

The buckets whose gradients arrive last in backward (the trailing ones of the layout's reduction
order: the model's first layers, whose weights the next forward needs first, so their host round
trip could never be hidden) stay on the device, whole buckets, so the device part is always a
suffix of the buckets (``core.buckets.buckets`` says which buckets a count puts there, and answers
where each bucket lives). Shares are counted in trained elements (the
fp32 master and both moments of one element are the same bytes wherever they live).

A fixed ``offload_fraction`` runs at the whole-bucket split nearest to it (a tie: the one with more
on the host); where that split keeps more on the device than asked and does not fit the device,
the split on the other side of the request (more on the host) is taken. 0.0 and 1.0 are splits
themselves: all on the device, all on the host.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_zero_offload.core.buckets.layout import Layout

_TOLERANCE = 1e-9  # of the trained elements: a fraction printed from a count maps back to it


def _at_most(shards: list[int], fraction: float) -> int:
    """The fewest trailing buckets whose elements reach ``1 - fraction``: the split whose host
    share is the largest one at most ``fraction``."""
    total = sum(shards)
    need = (1.0 - fraction) * total - _TOLERANCE * total
    k = held = 0
    while held < need and k < len(shards):
        held += shards[len(shards) - 1 - k]
        k += 1
    return k


def candidates(shards: list[int], fraction: float) -> list[int]:
    """Device-bucket counts for ``offload_fraction=fraction``, in the order they are tried: the
    whole-bucket split nearest to it (a tie: more on the host) and, where that one keeps more on
    the device than asked, the split just above it (more on the host), for when the nearer one
    does not fit the device."""
    k = _at_most(shards, fraction)
    below = fraction - host_share(shards, k)
    if k == 0 or below <= _TOLERANCE:  # on a split (0.0 and 1.0 always are)
        return [k]
    above = host_share(shards, k - 1) - fraction
    return [k, k - 1] if below < above else [k - 1]


def count_for(shards: list[int], fraction: float,
              fits: Callable[[int], bool] | None = None) -> int:
    """How many trailing buckets (of these shard sizes, in reduction order) stay on the device
    at ``offload_fraction=fraction``: the first of :func:`candidates` that ``fits`` the device
    (all of them fit without ``fits``); where none does, the one with the least on the device
    (whose device check then refuses it)."""
    options = candidates(shards, fraction)
    return next((k for k in options if fits is None or fits(k)), options[-1])


def differs(shards: list[int], on_device: int, fraction: float) -> bool:
    """Whether the split with the last ``on_device`` buckets on the device is not
    ``fraction`` itself (beyond the rounding of a fraction printed from a count)."""
    return abs(host_share(shards, on_device) - fraction) > _TOLERANCE


def host_share(shards: list[int], on_device: int) -> float:
    """Host elements over all when the last ``on_device`` buckets stay on the device."""
    total = sum(shards)
    return 1.0 if total == 0 else sum(shards[: len(shards) - on_device]) / total


def device_count(layout: Layout, fraction: float,
                 fits: Callable[[int], bool] | None = None) -> int:
    """:func:`count_for` over the layout's buckets."""
    return count_for([b.shard for b in layout.buckets], fraction, fits)


def host_fraction(layout: Layout, on_device: int) -> float:
    """The resolved ``offload_fraction``: :func:`host_share` over the layout's buckets."""
    return host_share([b.shard for b in layout.buckets], on_device)
