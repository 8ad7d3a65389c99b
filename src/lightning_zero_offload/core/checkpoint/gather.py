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
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core import collectives, shard_view
from lightning_zero_offload.core.checkpoint.stream import Later
from lightning_zero_offload.core.host import HostBuffers
from lightning_zero_offload.core.layout import Layout, Slot


class BucketGather:
    """Collective per new bucket: whole buckets of one kind, the last one kept."""

    def __init__(self, layout: Layout, host: HostBuffers, rank: int, group: Any,
                 coll: torch.device | None) -> None:
        self.layout, self.host, self.rank, self.group, self.coll = layout, host, rank, group, coll
        self._key: tuple[str, int] | None = None
        self._whole: Tensor | None = None

    def bucket(self, kind: str, b: int) -> Tensor:
        """Bucket ``b`` of ``kind``, every rank's shard, in fp32 on the host."""
        if self._key != (kind, b) or self._whole is None:
            self._whole = None  # the previous bucket goes before the next is gathered
            trim()
            mine = shard_view.bucket_fp32(self.host, b, kind)
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
