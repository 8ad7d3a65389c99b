"""Every device allocation the engine makes, counted in one place.

The setup check of a fixed ``offload_fraction`` (and the smallest fraction its error names),
``"auto"`` at setup and the planner (``lzo-plan``) all count with :func:`parts`: the flat device
weights (a spare set under delayed update), the gradient streamer's ring (``core.transfer.ring``:
:data:`BUCKET_BUFFERS` slots of the largest bucket and, with several ranks, of its largest
shard) and the device part's state, per element (:func:`element_bytes`: the fp32 master and
the update rule's state). What is not the
engine's (activations, the CUDA context, the model's frozen weights) is what
``device_memory_headroom`` keeps free.
"""

from __future__ import annotations

import logging

import torch

from lightning_zero_offload._units import format_bytes
from lightning_zero_offload.core.buckets.buckets import on_device as device_buckets
from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.buckets.placement import device_count, host_fraction
from lightning_zero_offload.core.limits import BUCKET_BUFFERS
from lightning_zero_offload.core.rules.rule import Rule

logger = logging.getLogger(__name__)

STATE_PARTS = ("optimizer state (device)", "gradients (device)")  # the device part's, in parts()


def state(rule: Rule) -> int:
    """Device bytes of one device-resident element's state: the fp32 master, the rule's."""
    return 4 + rule.device_bytes()


def element_bytes(elem: int, accumulate: bool, rule: Rule) -> int:
    """Device bytes of one device-resident element: :func:`state`, a gradient in the compute
    dtype (``elem``), and an fp32 sum where the run can accumulate in a half dtype (an fp32
    gradient adds in place)."""
    return state(rule) + elem + (4 if accumulate and elem != 4 else 0)


def bucket_bytes(shard: int, dtype: torch.dtype, accumulate: bool, rule: Rule) -> int:
    """Device bytes of one device-resident bucket shard (:func:`element_bytes` each)."""
    return shard * element_bytes(torch.empty((), dtype=dtype).element_size(), accumulate, rule)


def parts(*, trained: int, max_bucket: int, max_shard: int, world_size: int, resident: int,
          elem: int, delayed: bool, accumulate: bool, rule: Rule) -> dict[str, int]:
    """Device bytes per part (none zero) of ``trained`` elements in ``elem``-byte weights,
    buckets of at most ``max_bucket`` elements (shards of ``max_shard``), ``resident`` of this
    rank's shard elements on the device; ``accumulate``: whether the run can accumulate."""
    out = {"weights": elem * trained,
           "delayed: spare weights": elem * trained if delayed else 0,
           f"gradient buckets ({BUCKET_BUFFERS})": BUCKET_BUFFERS * elem * (
               max_bucket + (max_shard if world_size > 1 else 0)),
           "optimizer state (device)": state(rule) * resident,
           "gradients (device)": (element_bytes(elem, accumulate, rule) - state(rule)) * resident}
    return {k: v for k, v in out.items() if v}


def engine_parts(layout: Layout, on_device: int, dtype: torch.dtype, *, delayed: bool,
                 accumulate: bool, rule: Rule, host_weights: bool = False) -> dict[str, int]:
    """:func:`parts` of an engine over ``layout`` with its last ``on_device`` buckets' state on
    the device; ``host_weights``: the weights live on the host (FSDP2's ``CPUOffloadPolicy``)."""
    buckets = layout.buckets
    return parts(trained=0 if host_weights else sum(layout.group_numel),
                 max_bucket=max((b.numel for b in buckets), default=0),
                 max_shard=max((b.shard for b in buckets), default=0),
                 world_size=layout.world_size,
                 resident=sum(buckets[b].shard for b in device_buckets(layout, on_device)),
                 elem=torch.empty((), dtype=dtype).element_size(), delayed=delayed,
                 accumulate=accumulate, rule=rule)


def state_bytes(layout: Layout, on_device: int, dtype: torch.dtype, accumulate: bool,
                rule: Rule) -> int:
    """Device bytes of the trailing ``on_device`` buckets' state (:func:`bucket_bytes`)."""
    return sum(bucket_bytes(layout.buckets[b].shard, dtype, accumulate, rule)
               for b in device_buckets(layout, on_device))


def fixed_count(layout: Layout, fraction: float, dtype: torch.dtype, *, delayed: bool,
                accumulate: bool, free: int | None, rule: Rule, host_weights: bool = False) -> int:
    """The device buckets of a fixed ``offload_fraction`` (``placement.count_for``): the split
    nearest to it whose engine device bytes fit in ``free`` (None: no memory of its own)."""
    def fits(n: int) -> bool:
        return free is None or sum(engine_parts(
            layout, n, dtype, delayed=delayed, accumulate=accumulate, rule=rule,
            host_weights=host_weights).values()) <= free
    return device_count(layout, fraction, fits)


def _listed(p: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in p.items())


def check_fixed(layout: Layout, on_device: int, dtype: torch.dtype, *, delayed: bool,
                accumulate: bool, free: int | None, capacity: int | None, headroom: float,
                fraction: float, rank: int, rule: Rule, host_weights: bool = False) -> None:
    """Setup, before any allocation, a fixed ``offload_fraction``: everything the engine will
    allocate on the device fits in its ``free`` bytes (None: no memory of its own), else
    MemoryError naming the smallest fraction that does; a device part that leaves less than
    ``headroom`` of the ``capacity`` for the rest (activations) gets a warning."""
    if free is None:
        return

    def at(n: int) -> dict[str, int]:
        return engine_parts(layout, n, dtype, delayed=delayed, accumulate=accumulate, rule=rule,
                            host_weights=host_weights)
    total = sum(at(on_device).values())
    if total > free:
        fits = next((n for n in range(on_device, -1, -1) if sum(at(n).values()) <= free), None)
        if fits is None:
            raise MemoryError(
                f"ZeroOffload: rank {rank}'s device has {format_bytes(max(free, 0))} free, but "
                "the engine needs more even with all of the optimizer state on the host ("
                f"{_listed(at(0))}); use a smaller bucket_size_mb, delayed_update=False, "
                "tensor parallelism or a larger device")
        raise MemoryError(
            f"ZeroOffload: offload_fraction={fraction} needs {format_bytes(total)} on rank "
            f"{rank}'s device ({_listed(at(on_device))}), "
            f"but only {format_bytes(max(free, 0))} of it is free; the smallest fraction whose "
            f"device part fits is {host_fraction(layout, fits):.4f} "
            f"(offload_fraction={_ceil4(host_fraction(layout, fits))}), or use "
            'offload_fraction="auto" to choose it')
    if on_device and capacity and free - total < headroom * capacity:
        logger.warning(
            "ZeroOffload: offload_fraction=%g leaves %s (%.1f%%) of rank %d's device free for "
            "activations, less than device_memory_headroom=%g of it (%s); a larger fraction "
            "leaves more, or 'auto' keeps the headroom", fraction, format_bytes(free - total),
            100 * (free - total) / capacity, rank, headroom,
            format_bytes(int(headroom * capacity)))


def _ceil4(x: float) -> float:
    """``x`` rounded up to 4 decimals (a fraction the user can pass that still fits)."""
    return min(1.0, -(-round(x * 1e4, 6) // 1) / 1e4)
