"""Gradients from the device to this rank's host shard, bucket by bucket, during backward.

A post-accumulate-grad hook copies each gradient into its bucket's device buffer (a ring,
``core.transfer.ring``) and drops ``param.grad``. A complete bucket (and every one before it) is
reduce-scattered (summed; DDP's 1/N is folded into the step's gradient scale), its shard's sum of
squares taken on the device, and the shard handed to the bucket's gradient side
(``bucket.grad(set)``, ``core.buckets.buckets``): on an asynchronous device copied by a side stream
into the bucket's staging slice, which the kernel reads (or added into its device gradient).
When micro-batches accumulate, a host task moves the previous flush into the fp32 gradient.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Layout, Slot, padding
from lightning_zero_offload.core.device.device import Event, SyncDevice
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.dist import collectives, tensor_parallel
from lightning_zero_offload.core.transfer.grads import Grads
from lightning_zero_offload.core.transfer.ring import BucketRing


def _sq_sum(shard: Tensor) -> Tensor:
    """fp32 sum of squares without a temporary of the shard's size (inf/NaN propagate)."""
    return torch.linalg.vector_norm(shard, dtype=torch.float32).square()


class Pass(enum.Enum):
    """Where the streamer is in a backward pass, as its hooks see it (``no_sync()`` is idle)."""

    IDLE = "idle"  # none: a backward now sends its gradients
    NO_SYNC = "no_sync"  # none, inside ``no_sync()``: a backward keeps its gradients local
    SYNC = "sync"  # an engine backward that reduces and sends its gradients; no hook yet
    LOCAL = "local"  # an engine backward whose gradients stay on the device (hooks do nothing)
    RUNNING = "running"  # hooks are sending; ``end_backward`` is queued for the pass's end


_SENDS = {p: p not in (Pass.NO_SYNC, Pass.LOCAL) for p in Pass}


def _make_hook(streamer: GradStreamer, i: int) -> Callable[[Tensor], None]:
    ref = weakref.ref(streamer)  # the module's hooks must not keep a dropped engine alive

    def hook(param: Tensor) -> None:
        s = ref()
        if s is not None and s.sync:
            s.on_grad(i, param)
    return hook


class GradStreamer:
    def __init__(self, layout: Layout, buckets: Buckets, dtype: torch.dtype, dev: SyncDevice,
                 rank: int, process_group: object | None, profile: ProfileRecorder,
                 reducing: Callable[[bool], Any] | None = None) -> None:
        self.layout, self.buckets, self.dtype, self.dev = layout, buckets, dtype, dev
        self._reducing = reducing or (lambda sync: contextlib.nullcontext())  # FSDP2's passes
        self.rank, self.group, self.profile = rank, process_group, profile
        self.world_size = layout.world_size
        self._pass = Pass.IDLE
        self.before_grads: Callable[[], None] = lambda: None  # see wait_before_writes
        self.profile_step = 1  # the optimizer step these gradients are for
        nb = len(layout.buckets)
        self._gaps = [padding(layout, b) for b in range(nb)]
        self._bufs: list[Tensor | None] = [None] * nb
        self._written: list[set[int]] = [set() for _ in range(nb)]
        self._ready = [0] * nb
        self._arrived = [False] * len(layout.slots)
        # Per parameter: a gradient arrived since zero_grad (the step skips the others, as torch's
        # AdamW skips parameters whose grad is None).
        self.had_grad = [False] * len(layout.slots)
        # zero_grad(set_to_none=False) after a backward: the parameters keep a zero gradient, so
        # a step without a backward still steps them (as torch's AdamW steps zeroed grads)
        self.zeroed = False
        self._next = 0
        self.flushes = [0] * nb  # since zero_grad
        self.stats: list[Tensor] = []  # device sum of squares of every flushed shard
        self._direct = not dev.asynchronous and self.world_size == 1
        self._stream = dev.side_stream("d2h") if dev.asynchronous else None
        self._reduce = (dev.side_stream("reduce") if dev.asynchronous and self.world_size > 1
                        else self._stream)
        self._ring = BucketRing(dev, max((bk.numel for bk in layout.buckets), default=0),
                                max((bk.shard for bk in layout.buckets), default=0)
                                if self.world_size > 1 else 0, dtype)
        self._tasks: list = [None] * nb  # host task moving the previous flush to fp32
        self._filling: set[int] = set()  # buckets whose copy into their stage may still run
        self._grads: Grads | None = None  # what finish() handed over, until the next flush
        self._handles = [
            s.param.register_post_accumulate_grad_hook(_make_hook(self, i))
            for i, s in enumerate(layout.slots)
        ]

    def wait_before_writes(self, wait: Callable[[], None]) -> None:
        """``wait()`` runs before a pass writes the host buckets and before the step reads them:
        a host update still reading them ends first (``core.step.overlap``)."""
        self.before_grads = wait

    # -- the sync mode ---------------------------------------------------------------------------
    @property
    def sync(self) -> bool:
        """Whether the hooks reduce and send gradients now (else they stay on the device)."""
        return _SENDS[self._pass]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``ZeroOffload.no_sync``: backward passes inside keep gradients on the device."""
        self._pass = Pass.NO_SYNC
        try:
            with self._reducing(False):
                yield
        finally:
            self._pass = Pass.IDLE

    @contextlib.contextmanager
    def backward_pass(self, sync: bool) -> Iterator[None]:
        """One backward through the engine; ``sync=False`` keeps its gradients on the device.
        The fp32 gradient it will add into exists before autograd starts (never in a hook); a
        failed pass is forgotten (:meth:`discard`)."""
        idle = self._pass  # IDLE, or NO_SYNC: where the pass returns
        self._pass = Pass.SYNC if sync and idle is not Pass.NO_SYNC else Pass.LOCAL
        if self._pass is Pass.SYNC and self.will_accumulate():
            self.buckets.need_fp32_grads()  # a flush adds to an earlier one: allocated once
        try:
            with self._reducing(self._pass is not Pass.LOCAL or idle is Pass.NO_SYNC):
                yield
        except BaseException:
            self.discard()
            raise
        finally:
            self._pass = idle

    # -- hooks ---------------------------------------------------------------------------------
    def on_grad(self, i: int, param: Tensor) -> None:
        slot = self.layout.slots[i]
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(
                f"ZeroOffload: parameter {slot.name!r} got a sparse gradient; sparse gradients are "
                "not supported (use nn.Embedding(sparse=False))"
            )
        if self._arrived[i] or slot.bucket < self._next:
            raise RuntimeError(
                f"ZeroOffload: the gradient of {slot.name!r} arrived twice in one backward pass "
                "(reentrant activation checkpointing?); use checkpoint(..., use_reentrant=False)"
            )
        if self._pass is not Pass.RUNNING:
            self.before_grads()
            self._pass = Pass.RUNNING
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        self._add_to_bucket(i, slot, grad)
        param.grad = None
        self._arrived[i] = True
        self._ready[slot.bucket] += 1
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._ready[self._next] == len(
            buckets[self._next].slots
        ):
            self._flush(self._next)
            self._next += 1

    def _add_to_bucket(self, i: int, slot: Slot, grad: Tensor) -> None:
        b, grad = slot.bucket, tensor_parallel.local_grad(slot.param, grad)  # DTensor: local
        buf = self._bufs[b]
        if buf is None:
            buf = self._bufs[b] = self._new_buffer(b)
        lo = slot.offset - self.layout.buckets[b].start
        dst = buf[lo : lo + slot.numel]
        if i in self._written[b]:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            self._written[b].add(i)
        self.had_grad[i] = True

    def _new_buffer(self, b: int) -> Tensor:
        """Bucket ``b``'s buffer, contents undefined (all written or zeroed before the flush); on
        the CPU with one rank the first flush lands in the fp32 host gradient (saving a copy)."""
        numel = self.layout.buckets[b].numel
        if self._direct and self.flushes[b] == 0:
            landing = self.buckets[b].grad(self.buckets.filling).landing()
            if landing is not None:
                return landing
        if not self.dev.asynchronous:
            return self.dev.empty(numel, self.dtype)
        return self._ring.take(b, numel)

    def end_backward(self) -> None:
        """Flush every bucket not flushed yet, in order, with the gradients that did arrive
        (unused parameters contribute zeros, as in DDP with ``find_unused_parameters``, and keep
        ``had_grad`` False: the step leaves them alone unless another rank's gradient came)."""
        if self._pass is not Pass.RUNNING:
            return
        self._flush_rest()
        self._end_pass()

    def _flush_rest(self) -> None:
        for b in range(self._next, len(self.layout.buckets)):
            for i in self.layout.buckets[b].slots:
                param = self.layout.slots[i].param
                if not self._arrived[i] and param.grad is not None:  # e.g. left by no_sync
                    self._add_to_bucket(i, self.layout.slots[i], param.grad)
                    param.grad = None
            self._flush(b)

    def _end_pass(self) -> None:
        self._next = 0
        self._ready = [0] * len(self._ready)
        self._arrived = [False] * len(self._arrived)
        self._pass = Pass.NO_SYNC if self._pass is Pass.NO_SYNC else Pass.IDLE

    def discard(self) -> None:
        """After a failed backward: forget its partial buckets (nothing was sent for them)."""
        for b in range(self._next, len(self._bufs)):
            if self.flushes[b] == 0:  # nothing of an earlier backward in it either
                for i in self.layout.buckets[b].slots:
                    self.had_grad[i] = False
        self._ring.dropped()
        self._bufs = [None] * len(self._bufs)
        self._written = [set() for _ in self._bufs]
        self._end_pass()
        for s in self.layout.slots:
            s.param.grad = None

    # -- transfer ------------------------------------------------------------------------------
    def _flush(self, b: int) -> None:
        buf = self._bufs[b]
        self._bufs[b] = None
        if buf is None:
            buf = self._new_buffer(b)
        unwritten = [i for i in self.layout.buckets[b].slots if i not in self._written[b]]
        self._written[b] = set()
        start = self.layout.buckets[b].start
        for i in unwritten:
            s = self.layout.slots[i]
            buf[s.offset - start : s.offset - start + s.numel].zero_()
        for lo, hi in self._gaps[b]:
            buf[lo:hi].zero_()
        first = self.flushes[b] == 0
        self.flushes[b] += 1
        self._grads = None
        if self.dev.asynchronous:
            self._flush_async(b, buf, first)
        else:
            self._flush_sync(b, buf, first)

    def _shard_of(self, b: int, buf: Tensor, ring: bool = False) -> Tensor:
        """Where bucket ``b``'s reduced shard goes: ``buf`` itself with one rank."""
        shard = self.layout.buckets[b].shard
        if self.world_size == 1:
            return buf
        return self._ring.shard(b, shard) if ring else self.dev.empty(shard, buf.dtype)

    def _flush_sync(self, b: int, buf: Tensor, first: bool) -> None:
        t0 = self.profile.now()
        shard = self._shard_of(b, buf)
        if shard is not buf:
            collectives.reduce_scatter(shard, buf, self.group)
        self.stats.append(_sq_sum(shard))
        if self.buckets[b].grad(self.buckets.filling).receive(shard, first):
            self.dev.release(buf, None)
            if shard is not buf:
                self.dev.release(shard, None)
        self.profile.add("grad_transfer", self.profile_step, t0, self.profile.now())

    def _flush_async(self, b: int, buf: Tensor, first: bool) -> None:
        dev, stream, reducing, step = self.dev, self._stream, self._reduce, self.profile_step
        ring = self._ring.owns(b)
        shard = self._shard_of(b, buf, ring)
        stat = torch.full((), float("nan"), device=dev.device)
        # After the allocations: backward wrote the bucket (and the allocator's previous users
        # of this memory ran) on the compute stream.
        dev.stream_waits_compute(reducing)
        begin = (self.profile.now(), dev.record(reducing))

        def reduce(group: object) -> None:
            if shard is not buf:
                collectives.reduce_scatter(shard, buf, group)
            stat.copy_(_sq_sum(shard))
        dev.collective(reducing, reduce)
        if shard is not buf:  # several ranks, on a stream of their own: the copy waits for it
            reduced = dev.record(reducing)  # the last read of the bucket
            dev.stream_waits(stream, reduced)
            if not ring:
                dev.release(buf, reducing)
        self.stats.append(stat)
        side = self.buckets[b].grad(self.buckets.filling)
        self._filling.add(b)

        def release() -> None:  # a ring slot (bucket and shard) is free once the copy ends
            if not ring:
                dev.release(shard, stream)

        def copy_in() -> Event:
            end = side.copy_in(dev, stream, shard, release)
            self.profile.add_device("grad_transfer", step, begin[0], begin[1], end)
            return end

        if first or not side.folds_on_host:  # a device side adds on the stream
            end = copy_in()
            self._ring.flushed(b, lambda: end)
            return
        # A later flush: the previous one leaves staging for the fp32 gradient first, on a host
        # task (waiting for its copy and adding on the autograd thread would starve the device).
        # Host tasks run one at a time in submission order, so this bucket's previous task (and
        # with it the copy it queued) is done when this one starts.
        self.buckets.need_fp32_grads()  # normally done by backward_pass, before autograd

        def move_then_copy() -> Event:
            side.fold_previous(dev)
            return copy_in()
        task = self._tasks[b] = dev.host_task(move_then_copy)
        self._ring.flushed(b, task.result)  # reuse waits until the task queued the copy

    # -- step side -----------------------------------------------------------------------------
    def will_accumulate(self) -> bool:
        """Whether the next backward adds to buckets already flushed since ``zero_grad``."""
        return any(self.flushes)

    def drain(self) -> None:
        """Wait for every gradient transfer in flight."""
        for b in range(len(self.layout.buckets)):
            task, self._tasks[b] = self._tasks[b], None
            if task is not None:
                task.result()
        filling = self.buckets.filling
        for b in sorted(self._filling):
            self.buckets[b].grad(filling).wait_filled()
        self._filling.clear()

    def finish(self, next_step: int | None = None) -> Grads | None:
        """The gradients of a step, complete, handed to the step (None when no gradient arrived
        at all since ``zero_grad``). Gradients left on the device by ``no_sync`` micro-batches
        are reduced now, every transfer waited for, and per bucket the kernel's source made: the
        staging slice (compute dtype) when the bucket was flushed once, else the fp32 gradient,
        into which the last flush, still in staging, is added (the staging is then handed back,
        so poisoned on the emulated device); buckets that got nothing are zeroed. Later calls
        before another flush return the same. ``next_step``: gradients arriving from here on
        are for that optimizer step (the profile's)."""
        self.before_grads()
        if self._pass is Pass.RUNNING or any(s.param.grad is not None
                                             for s in self.layout.slots):
            self._flush_rest()  # those left by no_sync too (an accumulating flush allocates
            self._end_pass()  # the fp32 gradient)
        self.drain()
        if next_step is not None:
            self.profile_step = next_step
        if not (any(self.flushes) or self.zeroed):
            return None
        if self._grads is None:
            exact = self.stats and all(f == 1 for f in self.flushes)
            self._grads = Grads(self.buckets.sources(self.flushes), list(self.had_grad),
                                list(self.stats) if exact else None, self.dev)
        return self._grads

    def buffers_replaced(self) -> None:
        """The host gradient sets may be rebuilt (``offload_fraction="auto"`` moves buckets):
        the step's sources are made anew, and this side keeps no view of the old ones."""
        self._grads = None

    def reset(self, set_to_none: bool = True) -> None:
        """``zero_grad``, after the transfers in flight: the next flushes overwrite, not add.
        ``set_to_none=False`` keeps which parameters have a (now zero) gradient, as torch does."""
        self.drain()
        self.zeroed = not set_to_none and (self.zeroed or any(self.flushes))
        self.flushes = [0] * len(self.flushes)
        if set_to_none:
            self.had_grad = [False] * len(self.had_grad)
        self.buckets.reset()
        self.stats = []
        self._grads = None
        for s in self.layout.slots:
            s.param.grad = None

    def remove(self, drain: bool = True) -> None:
        """Hooks off, ring freed; ``drain=False`` after a failed transfer (it would raise)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if drain:
            self.drain()
        self._ring.close()
        self._grads = None  # staging views: the pinned blocks must be free at teardown

