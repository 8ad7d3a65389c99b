"""The host part of one step: the update rule over this rank's shard, bucket by bucket.

:meth:`HostUpdate.run` is the whole CPU side of a decided step (:class:`StepPlan`): per bucket
shard, the rule's kernel over its runs (ranges cut where parameters skip), each finished bucket's
new weights queued on the step's ``WeightPush`` while the next computes. It runs on the caller's
thread or on the core-bound worker (:class:`SyncUpdate`), or (delayed update) on the worker into
the spare weights; it issues a collective (``push.gather``) only when told it is on the caller's
thread. It walks the host buckets (``core.buckets.buckets``), each stepped by its own shard. With
half weights on an asynchronous device the kernel writes them over the bucket's staging slice (in
place over the half gradient it reads, or over the staging already folded into the fp32
gradient) and the copy reads them there; on the CPU they go straight into the weights (one rank)
or are cast from the master.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.buckets.shard import Run
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.core.step.threads import CpuStepWorker
from lightning_zero_offload.core.transfer.grads import Grads
from lightning_zero_offload.core.transfer.weights import DeviceWeights, WeightPush


@dataclass
class StepPlan:
    """Everything the kernel needs, fixed at decision time."""

    rule: Rule
    grad_scale: float
    hparams: list[Any]  # per group, the rule's hyperparameters
    runs: list[list[Run]]  # per bucket, ascending; the ranges between runs are left untouched
    grads: Grads  # the step's gradients (its sources, handed back once read)


class HostUpdate:
    """The rule's host implementation over the host buckets; owns no state of its own."""

    def __init__(self, layout: Layout, buckets: Buckets, *, threads: int, seed: int,
                 asynchronous: bool, half: bool, direct: bool = True,
                 profile: ProfileRecorder) -> None:
        self.layout, self.buckets = layout, buckets
        self.threads, self.seed, self.profile = threads, seed, profile
        # Where the kernel writes the half weights: into the device's own (the CPU, one rank),
        # or over the staging slice the copy reads (an asynchronous device); else the copies
        # cast them from the master. ``direct``: the device weights are flat (not FSDP2's).
        self.out_direct = direct and half and not asynchronous and layout.world_size == 1
        self.staged_out = half and asynchronous

    def run(self, plan: StepPlan, push: WeightPush, gather: bool,
            gset: int | None = None) -> None:
        """The kernel over every host bucket shard into ``push.target`` (the live weights, or
        the spare ones on the delayed worker); ``gather``: all-gather each bucket as it is done
        (only on the caller's thread); ``gset``: the gradient set the plan's gradients came
        from (the one backward fills unless the delayed update swapped it out). The device
        buckets are stepped on the device (``DeviceUpdate``) and gathered by the push's finish."""
        gset = gset if gset is not None else self.buckets.filling
        sources = plan.grads.sources
        gather = gather and self.layout.world_size > 1  # one rank: nothing to gather
        k = push.step
        assert k is not None, "a kernel push has a profile step"
        push.wait_sources()  # the last push's copies have read the buffers rewritten here
        host = self.buckets.host()
        with self.profile.span("cpu_step", k):
            for bucket in host:
                b, (lo, hi), shard = bucket.b, bucket.range, bucket.shard
                side = bucket.grad(gset) if self.staged_out else None
                out = (push.target[bucket.group][lo:hi] if self.out_direct
                       else side.weights_out() if side is not None else None)
                shard.step(plan.rule, sources[b], plan.hparams[bucket.group], plan.runs[b],
                           plan.grad_scale, out=out, threads=self.threads, seed=self.seed)
                if not self.out_direct:
                    push.copy(b, shard.master if out is None else out)
                if side is not None and out is not None:
                    side.weights_read_by(push.hand_back(out))  # rule 6: the next d2h waits
                if gather:
                    push.gather(b)
        push.copies_done()
        # Staging slices that carry weights are handed back on the copy stream (hand_back);
        # the device buckets' gradients are DeviceUpdate's.
        plan.grads.consumed([sources[bk.b] for bk in host
                             if not self.staged_out or sources[bk.b].dtype == torch.float32])


    def run_in_place(self, plan: StepPlan, step: int, order: list[int],
                     done: Callable[[int], None], span: Callable[[int], str]) -> None:
        """The kernel over the host buckets in ``order``, writing their masters only (FSDP2's
        host shards under ``CPUOffloadPolicy``: FSDP2 copies the weights up itself); ``done(b)``
        after each, its time recorded as profile span ``span(b)`` of ``step``
        (``core.step.overlap``)."""
        sources = plan.grads.sources
        for b in order:
            bucket, t0 = self.buckets[b], self.profile.now()
            bucket.shard.step(plan.rule, sources[b], plan.hparams[bucket.group], plan.runs[b],
                              plan.grad_scale, threads=self.threads, seed=self.seed)
            self.profile.add(span(b), step, t0, self.profile.now())
            done(b)
        plan.grads.consumed([sources[b] for b in order])


class SyncUpdate:
    """Where a synchronous step's host part runs: on the core-bound worker (collectives stay on
    the caller's thread: the push gathers at its finish), else on the caller's thread, each
    bucket gathered when done. The step hands it a decided plan, as it hands the delayed one
    (``core.step.delayed.DelayedUpdate``): both say which weight buffers the device part writes
    (:meth:`targets`) and run the host part (:meth:`run`)."""

    def __init__(self, update: HostUpdate, worker: CpuStepWorker | None, weights: DeviceWeights,
                 profile: ProfileRecorder) -> None:
        self.update, self.worker, self.weights, self.profile = update, worker, weights, profile

    def targets(self) -> list[list[Tensor]]:
        return [self.weights.live]

    def run(self, step: int, plan: StepPlan) -> None:
        with self.profile.span("stall", step), self.weights.push(step, self.weights.live) as push:
            if self.worker is not None:
                self.worker.run(self.update.run, plan, push, False)
            else:
                self.update.run(plan, push, True)
        self.weights.dev.compute_point()  # what runs next (a post hook, the forward) sees them
        self.profile.close(step)


class DeviceUpdate:
    """The rule's device implementation over the device buckets (``core.buckets.buckets``): stepped
    on the caller's thread, on the compute stream, before the host part (and at once under delayed
    update); the new weights are cast into the shards of the given weight buffers, whose pushes
    gather them."""

    def __init__(self, buckets: Buckets, *, profile: ProfileRecorder) -> None:
        self.buckets, self.profile = buckets, profile

    @torch.no_grad()
    def run(self, plan: StepPlan, targets: list[list[Tensor]], step: int) -> None:
        """Every device bucket shard stepped over its runs (ranges between them left
        untouched, as the kernel leaves them), its new weights written into each of
        ``targets``' shards of it."""
        device = self.buckets.device()
        if not device:
            return
        sources = plan.grads.sources
        with self.profile.span("device_step", step):
            for bucket in device:
                shard = bucket.shard
                shard.step(plan.rule, sources[bucket.b], plan.hparams[bucket.group],
                           plan.runs[bucket.b], plan.grad_scale)
                lo, hi = bucket.range
                for target in targets:  # the push's targets: written here, gathered there
                    target[bucket.group][lo:hi].copy_(shard.master)
            plan.grads.consumed([sources[bk.b] for bk in device])
