"""One bucket shard's optimizer-side life in host memory: :class:`HostStage`.

A stage is the only owner of what happens to its bucket shard between backward and the next
forward: where the shard lands (the staging slice on an asynchronous device, the fp32 gradient
on the CPU), the fp32 gradient slice it is folded into when micro-batches accumulate, the event
of the device-to-host copy that filled the staging slice, and the event of the host-to-device
copy that reads the new weights the kernel wrote over it (rule 6 of ``core.device``: the next
copy into the slice waits for that one). The streamer hands shards to stages (:meth:`receive`,
:meth:`copy_in`, :meth:`fold_previous`), the step asks a stage for the kernel's source
(:meth:`source`) and for where the kernel writes the half weights (:meth:`weights_out`), and
tells it which copy reads them (:meth:`weights_read_by`); nobody else touches its fields.

The memory itself (pinned arena blocks, fp32 arrays per group) is allocated and budgeted by
``core.host``; a stage holds views of its bucket's slices, given by its gradient set.
:class:`DeviceStage` is its sibling for a bucket whose optimizer state is kept on the device
(``core.placement``): it holds that state (fp32 master and moments) and the bucket's reduced
gradient there, filled on the same side stream, and never crosses to the host; it is also that
bucket's ``core.shard.Shard`` (the host's is ``shard.HostShard``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.device import Event, SyncDevice
from lightning_zero_offload.core.rule import Rule
from lightning_zero_offload.core.shard import Run


class HostStage:
    """Bucket ``b``'s shard in one host gradient set (two sets under delayed update): views of
    the set's staging slice (asynchronous device) and fp32 gradient (once allocated), held from
    the set's making and allocation on."""

    resident = False  # its optimizer state lives on the host

    def __init__(self, b: int, staging: Tensor | None) -> None:
        self.b, self.staging = b, staging
        self.fp32: Tensor | None = None  # set by the gradient set's allocation
        self._filled: Event | None = None  # the latest device-to-host copy into staging
        self._read_by: Event | None = None  # the copy reading the weights out of staging
        self._moved = 0  # flushes folded into the fp32 gradient since reset

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
        if self.fp32 is None:
            raise RuntimeError("ZeroOffload internal error: fp32 gradient used before allocation")
        return self.fp32

    def _staging(self) -> Tensor:
        assert self.staging is not None, "staging on a synchronous device"
        return self.staging

    def weights_read_by(self, event: Event | None) -> None:
        """The weights written over staging are read by the copy ending at ``event``."""
        self._read_by = event

    def _take_reader(self) -> Event | None:
        reader, self._read_by = self._read_by, None
        return reader


class DeviceStage:
    """Bucket ``b``'s shard kept on the device: its fp32 master and the rule's state (fp32, in
    the order of the rule's ``names``: :attr:`state`), and its reduced
    gradient (compute dtype after one flush; fp32, allocated at the first flush that adds, when
    micro-batches accumulate). Both gradient sets share it: the device part steps at once, also
    under delayed update. Every write is queued on the stream the streamer gives (after the
    reduce-scatter), and :meth:`wait_filled` orders the compute stream after the last one."""

    resident = True

    def __init__(self, dev: SyncDevice, b: int, shard: int, dtype: torch.dtype,
                 names: tuple[str, ...]) -> None:
        self.dev, self.b, self.names = dev, b, names
        made: list[Tensor] = []
        try:  # an allocation that fails frees the ones before it
            for what, dt in (("master weights", torch.float32),
                             *((name, torch.float32) for name in names),
                             ("gradient", dtype)):
                made.append(dev.zeros(shard, dt, f"device-resident {what}"))
                dev.track(made[-1], f"device-resident {what}")  # named by the race detector
        except BaseException:
            for t in made:
                dev.free(t)
            raise
        self.master, self._grad, self.state = made[0], made[-1], made[1:-1]
        self._fp32: Tensor | None = None  # the sum over flushes, where they accumulate
        self._filled: Event | None = None
        self._flushes = 0

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.master, *self.state, self._grad, self._fp32) if t is not None]

    # -- the shard's side (``core.shard.Shard``) ----------------------------------------------
    def step(self, rule: Rule, source: Tensor, hp: Any, runs: Sequence[Run], grad_scale: float,
             *, out: Tensor | None = None, threads: int = 1, seed: int = 0) -> None:
        """The rule's device update over each run, on the compute stream (torch ops: no host
        threads, no seed; the caller casts the new weights from :attr:`master`, no ``out``)."""
        assert out is None, "the device part's weights are cast from its master"
        for begin, end, k in runs:
            sl = slice(begin, end)
            rule.device_update(self.master[sl], source[sl], [t[sl] for t in self.state], hp,
                               step=k, grad_scale=grad_scale)

    def export(self, kind: str) -> Tensor:
        """``"master"`` or one of the rule's state tensors by its name, on the host."""
        return (self.master if kind == "master" else self.state[self.names.index(kind)]).cpu()

    def export_state(self) -> tuple[Tensor, ...]:
        return tuple(t.cpu() for t in self.state)

    def own_fp32(self) -> tuple[Tensor, ...] | None:
        """The state tensors themselves where they are host memory (the CPU compute device)."""
        return tuple(self.state) if self.master.device.type == "cpu" else None

    def load(self, master: Tensor | None = None, state32: Sequence[Tensor] | None = None,
             at: int = 0) -> None:
        """fp32 ``master`` and ``state32`` (the rule's order) from element ``at`` on."""
        if master is not None:
            self.master[at : at + master.numel()].copy_(master)
        if state32 is not None:
            for t, value in zip(self.state, state32, strict=True):
                t[at : at + value.numel()].copy_(value)

    def free(self) -> None:
        """Give the device memory back: nothing of it stays referenced (a gradient set, or an
        engine kept alive, still points at this stage)."""
        for t in self.tensors():
            self.dev.free(t)
        empty = self.master.new_empty(0)
        self.master, self._grad, self.state = empty, empty, [empty for _ in self.state]
        self._fp32 = self._filled = None

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

    def wait_filled(self) -> None:
        """Compute work from here on (the step) runs after the last write into the gradient."""
        filled, self._filled = self._filled, None
        if filled is not None:
            self.dev.compute_waits_event(filled, "device_stage_filled")

    def reset(self) -> None:
        self._flushes = 0

    # -- the step's side ----------------------------------------------------------------------
    def source(self, dev: SyncDevice, flushes: int) -> Tensor:
        """The gradient after ``flushes`` flushes since reset: zeros when none came."""
        if flushes == 0:
            return self._grad.zero_()
        return self._grad if self._fp32 is None or self._flushes == 1 else self._fp32
