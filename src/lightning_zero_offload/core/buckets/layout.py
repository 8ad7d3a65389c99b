"""Where every trainable parameter lives: flat aligned buffers, buckets, rank partitions.

Each optimizer param group gets one flat buffer (so one kernel call covers one set of
hyperparameters). The group's parameters are laid out in expected backward order (reverse of
registration order) and cut into buckets of about ``bucket_numel`` elements. Buckets of all groups
get one global order, the order in which their last parameter is expected to receive its gradient;
gradients are reduced bucket by bucket in exactly that order on every rank, which keeps collective
calls matched even when ranks see different unused parameters.

Every parameter starts on a multiple of ``shard_align`` elements and every bucket is padded to a
multiple of ``world_size * shard_align`` (``ALIGN`` by default; ``ops.BLOCK`` for 8-bit moments,
whose per-block scales need every shard, bucket shard and parameter to start on a block boundary:
a step that skips a parameter without a gradient then touches no block of its neighbours), and
split into ``world_size`` equal shards; rank r owns shard r of every bucket. A rank's host arrays
for a group are its shards of that group's buckets, back to back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_zero_offload.core.dist.tensor_parallel import local
from lightning_zero_offload.ops.moments import BLOCK

ALIGN = 16  # elements; parameter and shard starts are multiples of this (64 B in fp32)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class Slot:
    """One managed parameter: its place in its group's flat buffer."""

    param: nn.Parameter
    name: str
    group: int
    index: int  # position in torch's optimizer state_dict numbering
    offset: int
    numel: int
    shape: torch.Size
    bucket: int = -1


@dataclass
class Bucket:
    group: int
    start: int  # offset in the group's flat buffer
    numel: int  # padded; divisible by world_size * shard_align
    shard: int  # numel // world_size
    host_offset: int  # offset of this rank's shard in the group's host arrays
    slots: list[int] = field(default_factory=list)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """This rank's part of the bucket, as a range of the group's flat buffer."""
        begin = self.start + rank * self.shard
        return begin, begin + self.shard


@dataclass
class Layout:
    slots: list[Slot]
    buckets: list[Bucket]  # global reduction order
    group_numel: list[int]  # padded flat size per group
    group_shard_numel: list[int]  # host elements per group on each rank
    world_size: int
    group_sizes: list[int]  # number of parameters in each optimizer group (torch numbering)
    tp: Any = None  # core.dist.tensor_parallel.TensorParallel: slots are DTensors' local shards

    @property
    def shard_numel(self) -> int:
        return sum(self.group_shard_numel)

    @property
    def param_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def describe(self) -> dict:
        """Plain-data description saved with sharded checkpoints (to rebuild full tensors)."""
        return {
            "world_size": self.world_size,
            "group_numel": list(self.group_numel),
            "group_sizes": list(self.group_sizes),
            "buckets": [(b.group, b.start, b.numel, b.host_offset) for b in self.buckets],
            "params": [
                (s.name, s.group, s.index, s.offset, s.numel, tuple(s.shape)) for s in self.slots
            ],
        }


def shard_pieces(layout: Layout, rank: int):
    """Yield ``(slot, lo, hi, host)``: elements ``[lo, hi)`` of the slot's flattened parameter
    live on ``rank`` at ``host`` in the group's host arrays."""
    for bucket in layout.buckets:
        a, b = bucket.shard_range(rank)
        for i in bucket.slots:
            slot = layout.slots[i]
            lo, hi = max(slot.offset, a), min(slot.offset + slot.numel, b)
            if lo < hi:
                yield slot, lo - slot.offset, hi - slot.offset, bucket.host_offset + lo - a


def build_layout(
    groups: list[list[nn.Parameter]],
    trainable: list[list[bool]],
    order: dict[int, int],
    names: dict[int, str],
    world_size: int,
    bucket_numel: int,
    shard_align: int = ALIGN,
    tp: Any = None,
) -> Layout:
    """Lay out the trainable parameters of ``groups``.

    ``order`` maps ``id(param)`` to its registration position in the module; ``trainable`` marks
    the parameters the engine manages (the others keep their torch index but get no slot).
    ``shard_align`` (a multiple of ``ALIGN``): every parameter's offset and every bucket shard's
    size, so every shard start, is a multiple of it.
    """
    if shard_align < ALIGN or shard_align % ALIGN:
        raise ValueError(f"build_layout: shard_align={shard_align} must be a multiple of {ALIGN}")
    slots: list[Slot] = []
    per_group: list[list[Slot]] = []
    index = 0
    for g, params in enumerate(groups):
        mine = []
        for p, train in zip(params, trainable[g], strict=True):
            if train:
                mine.append(
                    Slot(p, names[id(p)], g, index, 0, local(p).numel(), local(p).shape)
                )
            index += 1
        mine.sort(key=lambda s: -order[id(s.param)])
        per_group.append(mine)
        slots.extend(mine)

    # Walk all groups together in backward order, closing a group's open bucket when it is full.
    walk = sorted(slots, key=lambda s: -order[id(s.param)])
    open_slots: dict[int, list[Slot]] = {}
    open_numel: dict[int, int] = {}
    closed: list[tuple[int, list[Slot]]] = []
    for s in walk:
        cur = open_slots.setdefault(s.group, [])
        size = _round_up(s.numel, shard_align)
        if cur and open_numel[s.group] + size > bucket_numel:
            closed.append((s.group, cur))
            cur = open_slots[s.group] = []
            open_numel[s.group] = 0
        cur.append(s)
        open_numel[s.group] = open_numel.get(s.group, 0) + size
    closed.extend((g, cur) for g, cur in open_slots.items() if cur)

    group_numel = [0] * len(groups)
    group_shard = [0] * len(groups)
    buckets: list[Bucket] = []
    slot_pos = {id(s): i for i, s in enumerate(slots)}
    for g, members in closed:
        start = group_numel[g]
        offset = start
        for s in members:
            s.offset = offset
            s.bucket = len(buckets)
            offset += _round_up(s.numel, shard_align)
        numel = _round_up(offset - start, world_size * shard_align)
        bucket = Bucket(g, start, numel, numel // world_size, group_shard[g])
        bucket.slots = [slot_pos[id(s)] for s in members]
        buckets.append(bucket)
        group_numel[g] += numel
        group_shard[g] += bucket.shard
    return Layout(slots, buckets, group_numel, group_shard, world_size, [len(p) for p in groups],
                  tp)


def shard_align(moment_dtype: str) -> int:
    """The parameter and bucket-shard alignment a moment format needs: ``ops.BLOCK`` for
    ``"int8"`` (its kernel calls start on block boundaries), else ``ALIGN``."""
    return BLOCK if moment_dtype == "int8" else ALIGN


def frozen_params(module: nn.Module, trained: dict[int, str],
                  dtype: torch.dtype) -> list[nn.Parameter]:
    """The frozen parameters the compute dtype would round: the host keeps their exact copies."""
    return [p for p in module.parameters() if id(p) not in trained
            and p.is_floating_point() and p.dtype != dtype]


def frozen_bytes(module: nn.Module, trained: dict[int, str], dtype: torch.dtype) -> int:
    """Host bytes of the exact copies of frozen parameters the compute dtype would round."""
    return sum(p.numel() * p.element_size() for p in frozen_params(module, trained, dtype))


def untrained_bytes(module: nn.Module, trained: dict[int, str], dtype: torch.dtype) -> int:
    """Bytes of the module's other tensors once floats are cast to the compute dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (elem if t.is_floating_point() else t.element_size())
               for t in [*module.parameters(), *module.buffers()] if id(t) not in trained)


def padding(layout: Layout, b: int) -> list[tuple[int, int]]:
    """Padding ranges of bucket ``b`` (from its start), zeroed at each flush (not the buffer)."""
    bucket = layout.buckets[b]
    ranges, pos = [], 0
    for i in sorted(bucket.slots, key=lambda i: layout.slots[i].offset):
        s = layout.slots[i]
        lo = s.offset - bucket.start
        if lo > pos:
            ranges.append((pos, lo))
        pos = lo + s.numel
    if pos < bucket.numel:
        ranges.append((pos, bucket.numel))
    return ranges
