"""The buckets: one record per bucket, made once at setup, and where each one lives.

A :class:`Bucket` owns everything about one bucket of this rank: its group and its range (of
the group's flat buffer, and of the group's host arrays), its pieces (each parameter's part of
the shard), its gradient side for each gradient set (``core.buckets.stage``: where its reduced
gradient lands) and its state shard (``core.buckets.shard``: the fp32 master and the rule's state),
and its place, host or device. Host and device buckets have the same two sides, so nothing else asks
where a bucket lives: the streamer hands gradients to ``bucket.grad(set)``, the step walks
:meth:`Buckets.host` and :meth:`Buckets.device`, checkpoints read and load ``bucket.shard``.

Placement is answered here and nowhere else: with ``count`` buckets on the device they are the
trailing ones of the reduction order (:func:`on_device`; ``core.buckets.placement`` chooses the
count), and the auto move (:meth:`Buckets.to_device`) takes the host's last ones next. The host
arrays themselves (master, moments, gradients, staging) are ``core.buckets.host``'s: a host bucket's
sides read its slices of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.buckets.shard import DeviceShard, HostShard, Shard
from lightning_zero_offload.core.buckets.stage import DeviceGradSide, HostGradSide
from lightning_zero_offload.core.device.device import SyncDevice
from lightning_zero_offload.core.rules.rule import Rule

if TYPE_CHECKING:  # the host arrays are built after the records (setup's order)
    from lightning_zero_offload.core.buckets.host import HostBuffers

GradSide = HostGradSide | DeviceGradSide
HOST, DEVICE = "host", "device"


def on_device(layout: Layout, count: int) -> list[int]:
    """The buckets whose state lives on the device when ``count`` do: the trailing ones (the
    model's first layers, whose weights the next forward needs first)."""
    n = len(layout.buckets)
    return list(range(n - count, n)) if count else []


def on_host(layout: Layout, count: int) -> list[int]:
    """The other buckets, in order."""
    device = set(on_device(layout, count))
    return [b for b in range(len(layout.buckets)) if b not in device]


@dataclass(frozen=True)
class Piece:
    """One parameter's part of a bucket shard: ``[begin, end)`` relative to the shard, ``end``
    padded up to the next multiple of the shard alignment (int8 moments cut only at blocks)."""

    slot: int
    begin: int
    end: int
    shape: torch.Size


class Bucket:
    """Bucket ``b`` of this rank: ``range`` of its group's flat buffer, ``host_offset`` and
    ``numel`` in the group's host arrays, ``pieces`` in offset order, its gradient sides, its
    shard and its place (``"host"`` or ``"device"``)."""

    def __init__(self, layout: Layout, b: int, rank: int, align: int) -> None:
        bucket = layout.buckets[b]
        self.b, self.group = b, bucket.group
        self.range = bucket.shard_range(rank)
        self.host_offset, self.numel = bucket.host_offset, bucket.shard
        # where its elements start in the whole model (groups back to back): compact moments
        # round by it, so ranks do not round alike and a layout that is the same at another
        # world size rounds the same
        self.base = sum(layout.group_numel[: self.group]) + self.range[0]
        a, z = self.range
        pieces = []
        for i in sorted(bucket.slots, key=lambda i: layout.slots[i].offset):
            s = layout.slots[i]
            lo, hi = max(s.offset, a), min(s.offset + s.numel, z)
            if lo < hi:
                pieces.append(Piece(i, lo - a, min(-(-hi // align) * align, z) - a, s.shape))
        self.pieces = pieces
        self.place = HOST
        self.shard: Shard  # its place's, given by Buckets (held)
        self._grads: tuple[GradSide, ...] = ()

    def grad(self, gset: int) -> GradSide:
        """Its gradient side in gradient set ``gset`` (one shared by both on the device)."""
        return self._grads[gset]

    def sides(self) -> tuple[GradSide, ...]:
        return self._grads

    def held(self, place: str, shard: Shard, sides: tuple[GradSide, ...]) -> None:
        """It lives at ``place`` from now on, with ``shard`` and ``sides``."""
        self.place, self.shard, self._grads = place, shard, sides

    def device_tensors(self) -> list[Tensor]:
        """The device memory it holds (none on the host)."""
        return [*self.shard.tensors(), *(t for s in set(self._grads) for t in s.tensors())]

    def free(self) -> None:
        """Its device memory goes (a host bucket has none)."""
        self.shard.free()
        for side in set(self._grads):
            side.free()


class Buckets:
    """Every bucket of this rank, in reduction order, and which gradient set backward fills.

    Made in two steps, in setup's order: the records and the device buckets' memory first
    (:meth:`__init__`, before the host allocates), the host buckets once the host arrays exist
    (:meth:`attach`)."""

    def __init__(self, layout: Layout, rank: int, dev: SyncDevice, dtype: torch.dtype,
                 rule: Rule, *, count: int, sets: int, align: int) -> None:
        self.layout, self.dev, self.dtype, self.rule, self.sets = layout, dev, dtype, rule, sets
        self._all = [Bucket(layout, b, rank, align) for b in range(len(layout.buckets))]
        self.filling = 0  # the gradient set backward fills (the other one: delayed update)
        self.arrays: HostBuffers | None = None
        made = self.made_for_device(on_device(layout, count), copy=False)
        for b, (shard, side) in made.items():
            self._all[b].held(DEVICE, shard, (side,) * sets)
        self._places()

    def attach(self, arrays: HostBuffers) -> None:
        """The host buckets' shards and sides, over ``arrays`` (``core.buckets.host``)."""
        self.arrays = arrays
        for bucket in self.host():
            self._on_host(bucket)

    def _on_host(self, bucket: Bucket) -> None:
        arrays = self.arrays
        assert arrays is not None
        where = (bucket.b, bucket.group, bucket.host_offset, bucket.numel)
        bucket.held(HOST, HostShard(arrays, *where, bucket.base, self.rule),
                    tuple(HostGradSide(arrays, s, *where) for s in range(self.sets)))

    def _places(self) -> None:
        self._host = [bk for bk in self._all if bk.place == HOST]
        self._device = [bk for bk in self._all if bk.place == DEVICE]

    # -- the questions --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Bucket]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, b: int) -> Bucket:
        return self._all[b]

    def host(self) -> list[Bucket]:
        """The buckets whose state is on the host, in order."""
        return self._host

    def device(self) -> list[Bucket]:
        """The buckets whose state is on the device, in order."""
        return self._device

    def in_group(self, g: int) -> list[Bucket]:
        """Group ``g``'s buckets, host and device, in the order of their host offsets."""
        return sorted((bk for bk in self._all if bk.group == g), key=lambda bk: bk.host_offset)

    @property
    def moment_dtype(self) -> str:
        assert self.arrays is not None
        return self.arrays.moment_dtype

    # -- gradients ------------------------------------------------------------------------------
    def sources(self, flushes: list[int]) -> list[Tensor]:
        """Per bucket, the kernel's gradient in the set backward filled, after ``flushes[b]``
        flushes since ``zero_grad`` (``core.buckets.stage``'s ``source``)."""
        s = self.filling
        return [bk.grad(s).source(self.dev, flushes[bk.b]) for bk in self._all]

    def need_fp32_grads(self) -> None:
        """A backward is about to accumulate (``HostBuffers.need_fp32_grads``)."""
        assert self.arrays is not None
        self.arrays.need_fp32_grads()

    def reset(self) -> None:
        """``zero_grad``: every side of every set starts over."""
        for bk in self._all:
            for side in bk.sides():
                side.reset()

    def swap(self) -> int:
        """Delayed update: returns the set the step just decided reads; the next backward fills
        the other one."""
        if self.sets < 2:
            raise RuntimeError("ZeroOffload internal error: swap without delayed update")
        used, self.filling = self.filling, 1 - self.filling
        return used

    # -- the auto move --------------------------------------------------------------------------
    def next_to_device(self) -> list[Bucket]:
        """Host buckets in the order a move takes them onto the device (the last one first)."""
        return self._host[::-1]

    def made_for_device(self, buckets: list[int], copy: bool = True
                        ) -> dict[int, tuple[DeviceShard, DeviceGradSide]]:
        """Device memory for ``buckets`` (their state copied in when ``copy``), not yet theirs
        (:meth:`to_device`); a failed allocation frees what was made and raises."""
        made: dict[int, tuple[DeviceShard, DeviceGradSide]] = {}
        try:
            for b in buckets:
                n = self._all[b].numel
                shard = DeviceShard(self.dev, b, n, self.rule)
                try:
                    made[b] = (shard, DeviceGradSide(self.dev, b, n, self.dtype))
                except BaseException:
                    shard.free()
                    raise
                if copy:
                    self._copy_state(self._all[b], shard)
        except BaseException:
            self.drop(made)
            raise
        return made

    @staticmethod
    def _copy_state(bucket: Bucket, to: DeviceShard) -> None:
        # A function of its own: the host views die with it (a view left in the caller would
        # keep the host's whole old arrays alive while they shrink).
        to.load(bucket.shard.master, bucket.shard.export_state())

    @staticmethod
    def drop(made: dict[int, tuple[DeviceShard, DeviceGradSide]]) -> None:
        """Free what :meth:`made_for_device` made (another rank could not move)."""
        for shard, side in made.values():
            shard.free()
            side.free()

    def to_device(self, made: dict[int, tuple[DeviceShard, DeviceGradSide]],
                  release: Callable[[], None] = lambda: None) -> dict[str, int]:
        """The buckets of ``made`` live on the device from now on, the host arrays shrinking to
        the others (between steps, nothing in flight; ``release`` as ``HostBuffers.shrink``).
        Returns the host's new sizes."""
        for b, (shard, side) in made.items():
            self._all[b].held(DEVICE, shard, (side,) * self.sets)
        self._places()
        assert self.arrays is not None
        sizes = self.arrays.shrink([bk.b for bk in self._host], release)
        for bucket in self._host:  # sides start afresh over the new arrays
            self._on_host(bucket)
        return sizes

    def free(self) -> None:
        """The device buckets' memory and the host arrays go."""
        for bk in self._device:
            bk.free()
        if self.arrays is not None:
            self.arrays.free()
