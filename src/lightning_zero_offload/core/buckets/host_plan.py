"""What the host buffers of this rank's shard take: the sizing ``core.buckets.host`` allocates by.

:func:`plan` sizes exactly what ``HostBuffers`` can ever allocate, pinned rounding included:
torch's pinned allocator rounds every block up to a power of two, so staging and output slices
are packed into a few power-of-two blocks (a few percent lost at most, :func:`arena_blocks`),
and the one pinned whole-group buffer (the fp32 master in ``"32-true"`` on CUDA, the source of
its copies) is budgeted rounded. On an asynchronous device the fp32 gradient exists only where
the run accumulates (``ZeroOffloadConfig.accumulate``): True budgets it at setup; None budgets
the run without it (``HostBuffers.need_fp32_grads`` adds it when it comes); False refuses it.
:func:`budget` adds what is not a host buffer but lives in host memory (exact frozen weights and,
with the CPU as compute device, the device's own memory); :func:`plan_counts` is the same from
the numbers alone (the planner's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_zero_offload.core.buckets.buckets import on_host
from lightning_zero_offload.core.buckets.device_budget import state_bytes
from lightning_zero_offload.core.buckets.layout import Layout, frozen_bytes, untrained_bytes
from lightning_zero_offload.core.limits import BUCKET_BUFFERS
from lightning_zero_offload.core.rules.rule import Rule

SLICE_ALIGN = 64  # bytes: every staging/output slice starts on a cache line
_MAX_BLOCK = 2**30  # pinned blocks of at most 1 GiB (or one slice, if a bucket is larger)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def pinned_size(nbytes: int) -> int:
    """What torch's pinned (caching host) allocator really reserves for ``nbytes``."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def arena_blocks(slices: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Pack slices (bytes) in order into power-of-two blocks: (block sizes, [(block, offset)]).
    Full blocks of ``_MAX_BLOCK``; the rest in one rounded block when that wastes little, else
    in halving blocks, so what is reserved stays within a few percent of what is used."""
    padded = [round_up(s, SLICE_ALIGN) for s in slices]
    # What is left from each slice on (its sum and its largest), so packing stays linear in the
    # slice count: the planner packs models of 10^12 parameters, hundreds of times per plan.
    rests, bigs = [0] * (len(padded) + 1), [0] * (len(padded) + 1)
    for j in range(len(padded) - 1, -1, -1):
        rests[j], bigs[j] = rests[j + 1] + padded[j], max(bigs[j + 1], padded[j])
    blocks: list[int] = []
    places: list[tuple[int, int]] = []
    i = 0
    while i < len(padded):
        rest, big = rests[i], pinned_size(bigs[i])
        if rest >= _MAX_BLOCK:
            size = max(_MAX_BLOCK, big)
        elif pinned_size(rest) <= rest * 1.03:
            size = pinned_size(rest)
        else:
            size = max(big, 1 << (rest.bit_length() - 1))  # the largest power of two <= rest
        off = 0
        while i < len(padded) and off + padded[i] <= size:
            places.append((len(blocks), off))
            off += padded[i]
            i += 1
        blocks.append(size)
    return blocks, places


@dataclass
class Sizes:
    """Bytes of every host buffer an engine can allocate (what the preflight check budgets)."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def held_numel(layout: Layout, host: list[int]) -> list[int]:
    """Per group, the elements of host arrays that hold buckets ``host`` (each at its offset of
    the full layout)."""
    out = [0] * len(layout.group_shard_numel)
    for b in host:
        bucket = layout.buckets[b]
        out[bucket.group] = max(out[bucket.group], bucket.host_offset + bucket.shard)
    return out


def plan(layout: Layout, dtype: torch.dtype, *, asynchronous: bool, delayed: bool,
         pinned: bool, rule: Rule, moment_dtype: str = "fp32",
         accumulate: bool | None = False, on_device: int = 0,
         host: list[int] | None = None, own_master: bool = True) -> Sizes:
    """Sizes of ``HostBuffers`` built with the same arguments (see the module docstring;
    ``accumulate=None`` counts the run that does not accumulate) over the buckets ``host``, by
    default those on the host when ``on_device`` are on the device (``core.buckets.buckets``)."""
    host = on_host(layout, on_device) if host is None else host
    return plan_counts(held_numel(layout, host), [layout.buckets[b].shard for b in host], dtype,
                       asynchronous=asynchronous, delayed=delayed, pinned=pinned,
                       rule=rule, moment_dtype=moment_dtype, accumulate=accumulate is True,
                       own_master=own_master)


def plan_counts(group_shards: list[int], bucket_shards: list[int], dtype: torch.dtype, *,
                asynchronous: bool, delayed: bool, pinned: bool, rule: Rule,
                moment_dtype: str = "fp32", accumulate: bool = False,
                own_master: bool = True) -> Sizes:
    """:func:`plan` from the numbers alone (also the planner's, for a model not built yet):
    this rank's elements per group and per bucket. ``"moments"`` is the rule's state with its
    scales, exactly as ``rule.zeros`` allocates it per group; ``"grad_fp32"`` the fp32
    gradient of every set (on an asynchronous device only when ``accumulate``: the run adds
    several backward passes per step); ``"staging"`` the half gradient staging of every set,
    which also carries the new weights to the device (the kernel writes them over the gradient
    it consumed: no separate output buffer). ``own_master=False``: the master is FSDP2's host
    shards (``CPUOffloadPolicy``), not the engine's."""
    n, elem = sum(group_shards), torch.empty((), dtype=dtype).element_size()
    sets = 2 if delayed else 1
    parts = {"master": 4 * n,
             "moments": sum(rule.host_bytes(k, moment_dtype) for k in group_shards),
             "grad_fp32": 4 * n * sets if accumulate or not asynchronous else 0}
    if pinned and dtype == torch.float32:  # "32-true" on CUDA: the master is the pinned source
        parts["master"] = sum(pinned_size(4 * k) for k in group_shards)
    if not own_master:
        parts["master"] = 0
    shard_bytes = [k * elem for k in bucket_shards]
    parts["staging"] = _arena_bytes(shard_bytes, pinned) * sets if asynchronous else 0
    return Sizes(parts)


def fp32_grad_bytes(group_numel: list[int], delayed: bool) -> int:
    """Bytes the fp32 gradient of every set takes (what a lazy allocation checks for)."""
    return 4 * sum(group_numel) * (2 if delayed else 1)


def _arena_bytes(slices: list[int], pinned: bool) -> int:
    if not pinned:
        return sum(round_up(s, SLICE_ALIGN) for s in slices)
    return sum(arena_blocks(slices)[0])


def budget(sizes: Sizes, device_numel: int, max_bucket_numel: int, dtype: torch.dtype, *,
           cpu: bool, delayed: bool, frozen_bytes: int, untrained_bytes: int,
           buckets_in_flight: int) -> Sizes:
    """All host bytes of an engine: its buffers, the exact copies of frozen parameters and, with
    the CPU as compute device, what lives on that "device": the weights (``device_numel``,
    twice with delayed update), the module's other tensors in the compute dtype and the bucket
    buffers in flight."""
    parts = {**sizes.parts, "frozen_exact": frozen_bytes}
    if cpu:
        elem = torch.empty((), dtype=dtype).element_size()
        parts["device_weights"] = device_numel * elem * (2 if delayed else 1)
        parts["device_untrained"] = untrained_bytes
        parts["buckets_in_flight"] = buckets_in_flight * max_bucket_numel * elem
    return Sizes(parts)


def engine_budget(sizes: Sizes, layout: Layout, module: torch.nn.Module, trained: dict[int, str],
                  dtype: torch.dtype, *, cpu: bool, delayed: bool, rule: Rule,
                  on_device: int = 0, accumulate: bool | None = False) -> Sizes:
    """:func:`budget` for an engine over ``module`` (``trained``: its managed parameters;
    ``on_device``: trailing buckets whose state is on the device, host memory too on the CPU)."""
    out = budget(sizes, sum(layout.group_numel),
                 max((b.numel for b in layout.buckets), default=0), dtype, cpu=cpu,
                 delayed=delayed, frozen_bytes=frozen_bytes(module, trained, dtype),
                 untrained_bytes=untrained_bytes(module, trained, dtype),
                 buckets_in_flight=BUCKET_BUFFERS)  # on the CPU, host memory too
    if cpu and on_device:
        out.parts["device_state"] = state_bytes(layout, on_device, dtype, accumulate is not False,
                                                rule)
    return out


def budget_at(layout: Layout, module: torch.nn.Module, trained: dict[int, str],
              dtype: torch.dtype, *, cpu: bool, **kw: object):
    """``(on_device, accumulate) -> host bytes per part`` of an engine built with ``kw``
    (:func:`plan`'s arguments) and that many device-resident buckets."""
    def at(on_device: int, accumulate: bool | None) -> dict[str, int]:
        sizes = plan(layout, dtype, **{**kw, "accumulate": accumulate},  # type: ignore[arg-type]
                     on_device=on_device)
        parts = engine_budget(sizes, layout, module, trained, dtype, cpu=cpu,
                              delayed=bool(kw["delayed"]), on_device=on_device,
                              rule=kw["rule"],  # type: ignore[arg-type]
                              accumulate=accumulate).parts
        if kw.get("own_master") is False:  # FSDP2's host shards: the weights and the master
            parts.pop("device_weights", None)
        return parts
    return at


