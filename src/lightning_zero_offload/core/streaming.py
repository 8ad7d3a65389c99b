"""Gradients from the device to this rank's host shard, bucket by bucket, during backward.

A post-accumulate-grad hook copies each parameter's gradient into its bucket's device buffer and
drops ``param.grad``. When a bucket is complete (and every bucket before it in the global order),
it is reduce-scattered across ranks (summed; the 1/N of DDP's average is folded into the step's
gradient scale), the shard's sum of squares is taken on the device, and the shard goes to the
host fp32 gradient (copied on the first micro-batch after ``zero_grad``, added after that).

On CUDA the transfer runs on a side stream into a pinned staging buffer in the compute dtype
(half precision on the wire) and lands in the fp32 gradient when it is drained; the bucket's
device buffer is released as soon as the side stream is done with it. On the CPU all of this is
plain tensor copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero_offload.core.layout import Layout

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sq_sum(shard: Tensor) -> Tensor:
    """fp32 sum of squares without a temporary of the shard's size (inf/NaN propagate)."""
    return torch.linalg.vector_norm(shard, dtype=torch.float32).square()


class GradStreamer:
    def __init__(self, layout: Layout, host_grads: list[Tensor], dtype: torch.dtype,
                 device: torch.device, rank: int, process_group: object | None,
                 pin_memory: bool) -> None:
        self.layout = layout
        self.host_grads = host_grads
        self.dtype = dtype
        self.device = device
        self.rank = rank
        self.group = process_group
        self.world_size = layout.world_size
        self.sync = True
        self.cuda = device.type == "cuda"
        nb = len(layout.buckets)
        self._bufs: list[Tensor | None] = [None] * nb
        self._ready = [0] * nb
        self._arrived = [False] * len(layout.slots)
        self._next = 0
        self._in_backward = False
        self.flushes = [0] * nb  # since zero_grad
        self.in_staging = [False] * nb  # CUDA: the bucket's gradient is only in its staging slice
        self.profile = None  # a ProfileRecorder: each bucket's transfer is a "grad_transfer" span
        self.profile_step = 1  # the optimizer step these gradients are for
        self._pool: list[Tensor] = []  # CPU only: released bucket buffers
        self._direct = not self.cuda and self.world_size == 1
        self.stats: list[Tensor] = []  # device sum of squares of every flushed shard
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, s in enumerate(layout.slots)
        ]
        if self.cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._staging = [
                torch.empty(n, dtype=dtype, pin_memory=pin_memory) for n in layout.group_shard_numel
            ]
            self._pending: list[tuple | None] = [None] * nb

    # -- hooks ---------------------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: Tensor) -> None:
            if self.sync:
                self._on_grad(i, param)
        return hook

    def _on_grad(self, i: int, param: Tensor) -> None:
        slot = self.layout.slots[i]
        grad = param.grad
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
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        self._add_to_bucket(slot, grad)
        param.grad = None
        self._arrived[i] = True
        self._ready[slot.bucket] += 1
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._ready[self._next] == len(
            buckets[self._next].slots
        ):
            self._flush(self._next)
            self._next += 1

    def _add_to_bucket(self, slot, grad: Tensor) -> None:
        bucket = self.layout.buckets[slot.bucket]
        buf = self._bufs[slot.bucket]
        if buf is None:
            buf = self._bufs[slot.bucket] = self._new_buffer(slot.bucket)
        lo = slot.offset - bucket.start
        buf[lo : lo + slot.numel].add_(grad.reshape(-1))

    def _new_buffer(self, b: int) -> Tensor:
        """A zeroed bucket buffer. On the CPU with one rank the first micro-batch accumulates
        straight into the fp32 host gradient (saving a copy). On CUDA the caching allocator
        recycles freed buckets; on the CPU a small pool does, so large buffers are not
        page-faulted in again every backward."""
        bucket = self.layout.buckets[b]
        numel = bucket.numel
        if self._direct and self.flushes[b] == 0:
            g, lo = bucket.group, bucket.host_offset
            return self.host_grads[g][lo : lo + numel].zero_()
        for i, t in enumerate(self._pool):
            if t.numel() >= numel:
                return self._pool.pop(i)[:numel].zero_()
        if self._pool:  # none fits: drop the smallest so the pool does not grow
            self._pool.pop(min(range(len(self._pool)), key=lambda i: self._pool[i].numel()))
        return torch.zeros(numel, dtype=self.dtype, device=self.device)

    def end_backward(self) -> None:
        """Flush every bucket not flushed yet, in order, with the gradients that did arrive
        (unused parameters contribute zeros, as in DDP with ``find_unused_parameters``)."""
        if not self._in_backward:
            return
        for b in range(self._next, len(self.layout.buckets)):
            for i in self.layout.buckets[b].slots:
                param = self.layout.slots[i].param
                if not self._arrived[i] and param.grad is not None:  # e.g. left by no_sync
                    self._add_to_bucket(self.layout.slots[i], param.grad)
                    param.grad = None
            self._flush(b)
        self._next = 0
        self._ready = [0] * len(self._ready)
        self._arrived = [False] * len(self._arrived)
        self._in_backward = False

    def discard(self) -> None:
        """After a failed backward: forget its partial buckets (nothing was sent for them)."""
        self._bufs = [None] * len(self._bufs)
        self._next = 0
        self._ready = [0] * len(self._ready)
        self._arrived = [False] * len(self._arrived)
        self._in_backward = False
        for s in self.layout.slots:
            s.param.grad = None

    # -- transfer ------------------------------------------------------------------------------
    def _flush(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        buf = self._bufs[b]
        self._bufs[b] = None
        if buf is None:
            buf = self._new_buffer(b)
        first = self.flushes[b] == 0
        self.flushes[b] += 1
        if not self.cuda:
            host = self._host(b)
            t0 = self.profile.now() if self.profile else 0.0
            shard = self._reduce(buf, bucket.shard)
            self.stats.append(_sq_sum(shard))
            if shard.data_ptr() != host.data_ptr():
                host.copy_(shard) if first else host.add_(shard)
                self._pool.append(buf if buf._base is None else buf._base)
            if self.profile:
                self.profile.add("grad_transfer", self.profile_step, t0, self.profile.now())
            return
        self._finish_pending(b)  # this bucket's previous flush lands before staging is reused
        self._materialize(b)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if self.profile:
                begin = (self.profile.now(), torch.cuda.Event(enable_timing=True))
                begin[1].record(stream)
            shard = self._reduce(buf, bucket.shard)
            self.stats.append(_sq_sum(shard))
            staging = self._staging[bucket.group][
                bucket.host_offset : bucket.host_offset + bucket.shard
            ]
            staging.copy_(shard, non_blocking=True)
            event = torch.cuda.Event(enable_timing=self.profile is not None)
            event.record(stream)
            if self.profile:
                self.profile.add_device("grad_transfer", self.profile_step, *begin, event)
        buf.record_stream(stream)  # the allocator reuses it once the side stream is past it
        shard.record_stream(stream)
        self._pending[b] = (event, first)

    def _reduce(self, buf: Tensor, shard_numel: int) -> Tensor:
        if self.world_size == 1:
            return buf
        out = torch.empty(shard_numel, dtype=buf.dtype, device=buf.device)
        _reduce_scatter(out, buf, group=self.group)
        return out

    def _finish_pending(self, b: int, lazy: bool = False) -> None:
        """Wait for bucket ``b``'s transfer. A first flush drained ``lazy`` stays in its staging
        slice, where the step's kernel reads it (no fp32 pass over the gradient on the host)."""
        item = self._pending[b]
        if item is not None:
            event, first = item
            event.synchronize()
            self._pending[b] = None
            if first and lazy:
                self.in_staging[b] = True
            else:
                host, staging = self._host(b), self._stage(b)
                host.copy_(staging) if first else host.add_(staging)

    def _host(self, b: int) -> Tensor:
        """Bucket ``b``'s shard of the fp32 host gradient. On CUDA that buffer is allocated on
        first use: a step whose buckets were each flushed once reads its gradient from staging
        and never needs it (4 bytes per parameter of host memory saved)."""
        bucket = self.layout.buckets[b]
        g = bucket.group
        if self.host_grads[g] is None:
            self.host_grads[g] = torch.zeros(self.layout.group_shard_numel[g])
        return self.host_grads[g][bucket.host_offset : bucket.host_offset + bucket.shard]

    def _stage(self, b: int) -> Tensor:
        bucket = self.layout.buckets[b]
        return self._staging[bucket.group][bucket.host_offset : bucket.host_offset + bucket.shard]

    def _materialize(self, b: int) -> None:
        if self.in_staging[b]:
            self.in_staging[b] = False
            self._host(b).copy_(self._stage(b))

    def materialize(self) -> None:
        """Make the fp32 host gradient complete (for a host-side norm)."""
        self.drain()
        for b in range(len(self.in_staging)):
            self._materialize(b)

    def grad_sources(self) -> list[Tensor]:
        """Per bucket, this rank's gradient shard for the kernel: the staging slice (compute
        dtype) when one flush left it there, else the fp32 host gradient."""
        self.drain()
        return [self._stage(b) if self.in_staging[b] else self._host(b)
                for b in range(len(self.in_staging))]

    def swap_buffers(self, host_grads: list[Tensor], staging: list[Tensor] | None) -> tuple:
        """Delayed update: the step just decided keeps reading the current host gradient and
        staging buffers (returned); the next backward fills these."""
        old = self.host_grads, (self._staging if self.cuda else None)
        self.host_grads = host_grads
        if self.cuda:
            self._staging = staging
        self.in_staging = [False] * len(self.in_staging)
        return old

    # -- step side -----------------------------------------------------------------------------
    def finish(self) -> bool:
        """Make the gradients complete for a step (``grad_sources`` says where they are).
        Gradients left on the device by ``no_sync`` micro-batches are reduced now; buckets that
        got nothing since ``zero_grad`` are zeroed. Returns False when no gradient arrived at all
        since ``zero_grad``."""
        if not self._in_backward and any(s.param.grad is not None for s in self.layout.slots):
            self._in_backward = True
        self.end_backward()
        self.drain()
        if not any(self.flushes):
            return False
        for b in range(len(self.layout.buckets)):
            if self.flushes[b] == 0:
                if self.cuda:  # this step reads the zeros from staging
                    self._stage(b).zero_()
                    self.in_staging[b] = True
                else:
                    self._host(b).zero_()
        return True

    def drain(self) -> None:
        """Wait for every gradient transfer in flight (first flushes stay in staging)."""
        if self.cuda:
            for b in range(len(self.layout.buckets)):
                self._finish_pending(b, lazy=True)

    def local_sq_sum(self) -> Tensor | None:
        """Sum of squares of this rank's reduced gradient shard, from the device-side statistics;
        None when they do not describe the accumulated gradient (several flushes per bucket)."""
        if not self.stats or any(f != 1 for f in self.flushes):
            return None
        return torch.stack(self.stats).sum()

    def reset(self) -> None:
        """``zero_grad``: the next flush of each bucket overwrites instead of adding."""
        self.flushes = [0] * len(self.flushes)
        self.in_staging = [False] * len(self.in_staging)
        self.stats = []
        for s in self.layout.slots:
            s.param.grad = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.drain()
        self._staging = []
