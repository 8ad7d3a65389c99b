"""A bucket's gradient side: where its reduced shard lands between backward and the step.

A side is the only owner of what happens to its bucket's gradient between backward and the next
forward. :class:`HostGradSide` (a bucket whose state is on the host, one per gradient set): where
the shard lands (the staging slice on an asynchronous device, the fp32 gradient on the CPU), the
fp32 gradient slice it is folded into when micro-batches accumulate, the event of the
device-to-host copy that filled the staging slice, and the event of the host-to-device copy that
reads the new weights the kernel wrote over it (rule 6 of ``core.device.device``: the next copy into
the slice waits for that one). :class:`DeviceGradSide` (a bucket whose state is on the device,
``core.buckets.placement``; both gradient sets share it, since the device part steps at once): the
reduced gradient on the device, filled on the same side stream, never crossing to the host.

Both answer the same calls: the streamer hands shards to a side (:meth:`receive`,
:meth:`copy_in`, :meth:`fold_previous` where a flush is still in staging, :meth:`wait_filled`,
:meth:`reset`), the step asks it for the kernel's source (:meth:`source`) and, on the host, for
where the kernel writes the half weights (:meth:`weights_out`) and tells it which copy reads them
(:meth:`weights_read_by`). A bucket (``core.buckets.buckets``) holds its sides; nobody else touches
their fields. The host memory itself (pinned arena blocks, fp32 arrays per group) is allocated and
budgeted by ``core.buckets.host``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from lightning_zero_offload.core.device.device import Event, SyncDevice


class HostArrays(Protocol):
    """What a host side reads of ``core.buckets.host.HostBuffers``: per gradient set, the staging
    slice of each host bucket (None on a synchronous device) and the fp32 gradient per group (None
    until allocated)."""

    staging: list[dict[int, Tensor] | None]
    fp32: list[list[Tensor] | None]


class HostGradSide:
    """Bucket ``b``'s gradient in host gradient set ``gset`` (two sets under delayed update):
    its staging slice (asynchronous device) and its slice of the fp32 gradient (once
    allocated), read from the host arrays (``core.buckets.host``) when used, so it never holds a
    view of arrays the host has replaced or freed."""

    def __init__(self, arrays: HostArrays, gset: int, b: int, group: int, offset: int,
                 numel: int) -> None:
        self._arrays, self._set, self.b = arrays, gset, b
        self._where = (group, offset, offset + numel)
        self._filled: Event | None = None  # the latest device-to-host copy into staging
        self._read_by: Event | None = None  # the copy reading the weights out of staging
        self._moved = 0  # flushes folded into the fp32 gradient since reset

    # A later flush first moves the previous one from staging into the fp32 gradient, on a host
    # task (adding on the autograd thread would starve the device).
    folds_on_host = True

    def landing(self) -> Tensor | None:
        """Where a first flush may be written directly instead of a device buffer (the CPU
        with one rank): the fp32 gradient."""
        return self.fp32_grad()

    # -- the streamer's side -------------------------------------------------------------------
    def receive(self, shard: Tensor, first: bool) -> bool:
        """A synchronous device: ``shard`` lands in the fp32 gradient (added from the second
        flush since reset on). False when it was reduced in place there (nothing to free)."""
        host = self.fp32_grad()
        if shard.data_ptr() == host.data_ptr():
            return False
        host.copy_(shard) if first else host.add_(shard)
        return True

    def copy_in(self, dev: SyncDevice, stream: object, shard: Tensor,
                then: Callable[[], None]) -> Event:
        """An asynchronous device: queue the copy of ``shard`` into staging on ``stream``, after
        the copy that still reads the weights written over it, then ``then`` (the shard's
        release on the stream); returns the end of both."""
        stage, reader = self._staging(), self._take_reader()
        if reader is not None:
            dev.stream_waits(stream, reader, "staging_reuse")
        dev.run(stream, lambda: stage.copy_(shard, non_blocking=True))
        then()
        end = self._filled = dev.record(stream)
        return end

    def fold_previous(self, dev: SyncDevice) -> None:
        """On a host task, before the next copy in: the previous flush leaves staging for the
        fp32 gradient (copied into an empty one, else added)."""
        if self._filled is not None:
            self._filled.wait()
        stage, fp32 = self._staging(), self.fp32_grad()
        fp32.copy_(stage) if self._moved == 0 else fp32.add_(stage)
        self._moved += 1
        dev.handed_back(stage)

    def wait_filled(self) -> None:
        """The copy into staging is done (the host may read it)."""
        filled, self._filled = self._filled, None
        if filled is not None:
            filled.wait()

    def reset(self) -> None:
        """``zero_grad``: the next flush overwrites, not adds."""
        self._moved = 0

    # -- the step's side ----------------------------------------------------------------------
    def source(self, dev: SyncDevice, flushes: int) -> Tensor:
        """The kernel's gradient after ``flushes`` flushes since reset (after ``wait_filled``):
        zeros when none came; the staging slice (compute dtype) after one; else the fp32
        gradient, into which the last flush, still in staging, is added here (the staging is
        then handed back, so poisoned on the emulated device)."""
        if not dev.asynchronous:
            src = self.fp32_grad()
            return src.zero_() if flushes == 0 else src
        stage = self._staging()
        if flushes == 0:
            if (reader := self._take_reader()) is not None:  # rule 6 on the host
                reader.wait()
            return stage.zero_()
        if self._moved == 0:
            return stage
        fp32 = self.fp32_grad().add_(stage)
        dev.handed_back(stage)
        self._moved += 1
        return fp32

    def weights_out(self) -> Tensor:
        """Where the kernel writes the new half weights for the copy up: the staging slice."""
        return self._staging()

    def fp32_grad(self) -> Tensor:
        """The fp32 gradient slice (allocated when the run accumulates, or on the CPU)."""
        fp32 = self._arrays.fp32[self._set]
        if fp32 is None:
            raise RuntimeError("ZeroOffload internal error: fp32 gradient used before allocation")
        g, lo, hi = self._where
        return fp32[g][lo:hi]

    def _staging(self) -> Tensor:
        staging = self._arrays.staging[self._set]
        assert staging is not None, "staging on a synchronous device"
        return staging[self.b]

    def tensors(self) -> list[Tensor]:
        """Device memory it holds: none (its buffers are the host arrays')."""
        return []

    def free(self) -> None:
        """Nothing to give back: the host arrays are ``core.buckets.host``'s."""

    def weights_read_by(self, event: Event | None) -> None:
        """The weights written over staging are read by the copy ending at ``event``."""
        self._read_by = event

    def _take_reader(self) -> Event | None:
        reader, self._read_by = self._read_by, None
        return reader


class DeviceGradSide:
    """Bucket ``b``'s reduced gradient kept on the device (compute dtype after one flush; fp32,
    allocated at the first flush that adds, when micro-batches accumulate). Every write is
    queued on the stream the streamer gives (after the reduce-scatter), and
    :meth:`wait_filled` orders the compute stream after the last one."""

    def __init__(self, dev: SyncDevice, b: int, numel: int, dtype: torch.dtype) -> None:
        self.dev, self.b = dev, b
        self._grad = dev.zeros(numel, dtype, "device-resident gradient")
        dev.track(self._grad, "device-resident gradient")  # named by the race detector
        self._fp32: Tensor | None = None  # the sum over flushes, where they accumulate
        self._filled: Event | None = None
        self._flushes = 0

    folds_on_host = False  # every flush adds on the stream

    def landing(self) -> Tensor | None:
        """None: a bucket is always reduced into a device buffer first."""
        return None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self._grad, self._fp32) if t is not None]

    def free(self) -> None:
        """Give the device memory back (nothing of it stays referenced)."""
        for t in self.tensors():
            self.dev.free(t)
        self._grad, self._fp32, self._filled = self._grad.new_empty(0), None, None

    # -- the streamer's side -------------------------------------------------------------------
    def _add(self, shard: Tensor) -> None:
        """The reduced ``shard`` joins the gradient since reset (on the stream queueing it)."""
        if self._flushes == 0:
            self._grad.copy_(shard)
        elif self._grad.dtype == torch.float32:
            self._grad.add_(shard)
        else:
            if self._fp32 is None:
                self._fp32 = self.dev.zeros(self._grad.numel(), torch.float32,
                                            "device-resident fp32 gradient")
                self.dev.track(self._fp32, "device-resident fp32 gradient")
            if self._flushes == 1:
                self._fp32.copy_(self._grad)
            self._fp32.add_(shard)
        self._flushes += 1

    def receive(self, shard: Tensor, first: bool) -> bool:
        """A synchronous device: ``shard`` joins the gradient; it may be released."""
        self._add(shard)
        return True

    def copy_in(self, dev: SyncDevice, stream: object, shard: Tensor,
                then: Callable[[], None]) -> Event:
        """An asynchronous device: ``shard`` joins the gradient on ``stream``, then ``then``."""
        dev.run(stream, lambda: self._add(shard))
        then()
        end = self._filled = dev.record(stream)
        return end

    def fold_previous(self, dev: SyncDevice) -> None:
        """Nothing waits in staging: every flush adds on the stream."""

    def wait_filled(self) -> None:
        """Compute work from here on (the step) runs after the last write into the gradient."""
        filled, self._filled = self._filled, None
        if filled is not None:
            self.dev.compute_waits_event(filled, "device_stage_filled")

    def reset(self) -> None:
        self._flushes = 0

    # -- the step's side ----------------------------------------------------------------------
    def weights_out(self) -> Tensor:
        """None written here: a device bucket's new weights are cast from its master."""
        raise RuntimeError("ZeroOffload internal error: a device bucket's weights are cast "
                           "from its master, not written over its gradient")

    def weights_read_by(self, event: Event | None) -> None:
        """No copy reads weights out of its gradient."""

    def source(self, dev: SyncDevice, flushes: int) -> Tensor:
        """The gradient after ``flushes`` flushes since reset: zeros when none came."""
        if flushes == 0:
            return self._grad.zero_()
        return self._grad if self._fp32 is None or self._flushes == 1 else self._fp32
