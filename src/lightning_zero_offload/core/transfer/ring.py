"""The gradient streamer's fixed ring of device bucket buffers.

Backward fills a bucket's buffer while the side streams reduce and copy earlier ones. A buffer
is reused once the copy that last read it is done, and that wait is the compute stream's, not
the host's (:meth:`SyncDevice.compute_waits_event`): backward never blocks on a transfer. Only
when the copy is queued by a host task (an accumulating flush: the previous one leaves staging
first) does reuse wait for that task to have queued it. :data:`BUCKET_BUFFERS` slots, each a
buffer of the largest bucket's size and, with several ranks, one of the largest shard's (the
reduce-scatter's output, read by the copy): the device memory ``core.buckets.device_budget`` counts.
A slot is reused once the copy is done, so no more shards than slots are ever alive. A bucket
whose gradients arrive while every slot is being filled gets buffers of its own (released on the
streams that read them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero_offload.core.device.device import Event, SyncDevice
from lightning_zero_offload.core.limits import BUCKET_BUFFERS


class BucketRing:
    def __init__(self, dev: SyncDevice, numel: int, shard_numel: int, dtype: torch.dtype) -> None:
        self.dev, self.numel, self.shard_numel, self.dtype = dev, numel, shard_numel, dtype
        self._bufs: list[Tensor | None] = [None] * BUCKET_BUFFERS
        self._shards: list[Tensor | None] = [None] * BUCKET_BUFFERS
        self._last: list[Callable[[], Event] | None] = [None] * BUCKET_BUFFERS  # its last use
        self._filling: dict[int, int] = {}  # bucket -> the slot it fills
        self._next = 0

    def take(self, b: int, numel: int) -> Tensor:
        """A buffer of ``numel`` elements for bucket ``b`` (contents undefined): a ring slot, or
        when every slot is being filled, one of its own (:meth:`owns` is False for it)."""
        n, busy = len(self._bufs), set(self._filling.values())
        free = [i for i in ((self._next + k) % n for k in range(n)) if i not in busy]
        if not free:
            return self.dev.empty(numel, self.dtype)
        i = self._filling[b] = free[0]
        self._next = (i + 1) % n
        last, self._last[i] = self._last[i], None
        if last is not None:
            self.dev.compute_waits_event(last())  # the copy that read it is done first
        buf = self._bufs[i]
        if buf is None:
            buf = self._bufs[i] = self.dev.empty(self.numel, self.dtype)
        return buf[:numel]

    def shard(self, b: int, numel: int) -> Tensor:
        """The shard buffer of the slot bucket ``b`` fills (:meth:`owns` must be True)."""
        i = self._filling[b]
        buf = self._shards[i]
        if buf is None:
            buf = self._shards[i] = self.dev.empty(self.shard_numel, self.dtype)
        return buf[:numel]

    def owns(self, b: int) -> bool:
        """Whether bucket ``b``'s buffer is a ring slot (else release it on its stream)."""
        return b in self._filling

    def flushed(self, b: int, last_use: Callable[[], Event]) -> None:
        """Bucket ``b``'s buffer is handed to the side streams; ``last_use()`` is the event after
        the last work that reads it."""
        i = self._filling.pop(b, None)
        if i is not None:
            self._last[i] = last_use

    def dropped(self) -> None:
        """A failed backward: its partial buckets' slots are free again (nothing read them)."""
        self._filling = {}

    def close(self) -> None:
        n = len(self._bufs)
        self._bufs, self._shards, self._last, self._filling = [None] * n, [None] * n, [None] * n, {}
