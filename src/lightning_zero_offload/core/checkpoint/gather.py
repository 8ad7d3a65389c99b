"""The consolidated form's tensors as ``stream.Later`` stand-ins, made one at a time.

A parameter's fp32 master weights or moment are made from the one bucket that holds it: this
rank's shard of the bucket (the host's own array where it is fp32 there; compact moments and the
device part converted, this bucket only), all-gathered over the data-parallel ranks, then under
tensor parallelism gathered whole over that group. Stand-ins are made kind by kind, bucket by
bucket in the layout's order (the order they are created in), so each bucket is gathered once
per kind and at most one bucket plus one parameter is held at a time.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_zero_offload.core.checkpoint import formats
from lightning_zero_offload.core.checkpoint.stream import Later
from lightning_zero_offload.core.dist import collectives

if TYPE_CHECKING:
    from lightning_zero_offload.core.checkpoint.engine_state import EngineState
from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Layout, Slot


class BucketGather:
    """Collective per new bucket: whole buckets of one kind, the last one kept."""

    def __init__(self, layout: Layout, buckets: Buckets, rank: int, group: Any,
                 coll: torch.device | None) -> None:
        self.layout, self.buckets, self.rank = layout, buckets, rank
        self.group, self.coll = group, coll
        self._key: tuple[str, int] | None = None
        self._whole: Tensor | None = None

    def bucket(self, kind: str, b: int) -> Tensor:
        """Bucket ``b`` of ``kind``, every rank's shard, in fp32 on the host."""
        if self._key != (kind, b) or self._whole is None:
            self._whole = None  # the previous bucket goes before the next is gathered
            trim()
            mine = self.buckets[b].shard.export(kind)
            if self.layout.world_size == 1:
                self._whole = mine
            else:
                out = torch.empty(self.layout.buckets[b].numel, device=self.coll)
                collectives.all_gather(out, mine.to(self.coll), self.group,
                                       "gather of a checkpoint's bucket")
                self._whole = out.cpu()
            self._key = (kind, b)
        return self._whole

    def param(self, kind: str, slot: Slot) -> Tensor:
        """``slot``'s local tensor of ``kind``: a view of the gathered bucket."""
        at = slot.offset - self.layout.buckets[slot.bucket].start
        return self.bucket(kind, slot.bucket)[at : at + slot.numel].view(slot.shape)


def _libc_trim() -> Callable[[int], object]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return lambda _: None


_TRIM = _libc_trim()


def trim() -> None:
    """Give freed heap memory back to the system. glibc keeps freed blocks of a bucket's size
    in its heap (its mmap threshold grows with them), and a conversion's temporaries, scattered
    between smaller blocks, would add up to far more than one bucket over a save or load."""
    _TRIM(0)


def in_bucket_order(layout: Layout) -> list[Slot]:
    """The trained parameters in the order their buckets are gathered."""
    return [layout.slots[i] for bucket in layout.buckets for i in bucket.slots]


def later(gather: BucketGather, kind: str, slot: Slot, tp: Any) -> Later:
    """``slot``'s whole fp32 tensor of ``kind`` (gathered over the tensor-parallel group too)."""
    def make() -> Tensor:
        value = gather.param(kind, slot)
        return tp.whole_value(slot.param, value) if tp is not None else value

    return Later(tuple(slot.param.shape), torch.float32, make)


def full_later(state: EngineState, *, model: bool, optimizer: bool) -> dict:
    """``ZeroOffload.full_state_dict()``'s form with ``stream.Later`` stand-ins for the trained
    tensors: nothing is gathered or copied until each is made (collective: ``stream.write`` on
    the rank that writes, ``stream.make_all`` on the others, in the order they were created)."""
    coll = (collectives.collective_device(state.group, state.weights.dev.device)
            if state.world_size > 1 else None)
    gather = BucketGather(state.layout, state.buckets, state.rank, state.group, coll)
    slots, tp = in_bucket_order(state.layout), state.tp
    rule_state = state.host.rule.names
    kinds = (["master"] if model else []) + (list(rule_state) if optimizer else [])
    made = {kind: {s.index: later(gather, kind, s, tp) for s in slots} for kind in kinds}
    counters = state.stepper.state_dict()
    full: dict[str, Any] = {"format": formats.FULL_FORMAT}
    if model:
        index = {id(s.param): s.index for s in state.layout.slots}
        untrained = state.weights.untrained()
        names = state.module.state_dict(keep_vars=True)
        full["model"] = {
            name: made["master"][index[id(t)]] if id(t) in index else
            (tp.whole_value(t, untrained[name]) if tp is not None else untrained[name])
            for name, t in names.items()}
    if optimizer:
        per_param = {s.index: {"step": torch.tensor(float(n)),
                               **{k: made[k][s.index] for k in rule_state}}
                     for s, n in zip(state.layout.slots, counters["param_steps"], strict=True)
                     if n > 0}
        param_groups, first = [], 0
        for group, size in zip(state.param_groups, state.group_sizes, strict=True):
            param_groups.append({**formats.group_hparams(group),
                                 "params": list(range(first, first + size))})
            first += size
        full["optimizer"] = formats.optimizer_state(dict(sorted(per_param.items())),
                                                    param_groups, state.host.rule)
    full["scaler"] = counters["scaler"]
    return full

