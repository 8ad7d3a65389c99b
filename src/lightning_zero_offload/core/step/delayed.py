"""Delayed parameter update (ZeRO-Offload, section 5) as one unit.

With ``delayed_update=True`` the step hands the CPU step of step i to :meth:`DelayedUpdate.submit`,
which swaps in one place what the next backward and the worker must not share: the host gradient
sets (the worker reads the one just filled, the next backward fills the other) and the device
weights (the worker's push writes the spare buffers; the live ones keep the weights through step
i-1 for step i+1's forward and backward). The kernel (``core.step.update.HostUpdate``) runs on one
worker thread while the caller goes on. The next ``step()`` (or ``synchronize()``) joins the
worker; :meth:`DelayedUpdate.land` then all-gathers the other ranks' shards into the spare buffer
and swaps the two, so step i's weights are in place before step i+2's forward. Everything that
involves other ranks or the user's live state (gradient wait, global norm, loss scale, clip
coefficient, learning rate) is settled on the caller's thread before the worker starts,
collectives stay on the caller's thread, and the worker touches only buffers no one else uses
until it is joined.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from torch import Tensor

from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.step.threads import CpuStepWorker
from lightning_zero_offload.core.step.update import HostUpdate, StepPlan
from lightning_zero_offload.core.transfer.weights import DeviceWeights, WeightPush

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a pending delayed update is (none pending: it landed, or none was submitted)."""

    RUNNING = "running"  # its CPU step may still run on the worker
    JOINED = "joined"  # the worker is done; its weights land at the next collective call


@dataclass(frozen=True)
class Pending:
    """A step's host part handed to the worker: the step, the push writing its weights and
    where it is."""

    step: int
    push: WeightPush
    phase: Phase = Phase.RUNNING


class DelayedUpdate:
    """The one step whose CPU step runs on the worker: submitted by the step (:meth:`submit`:
    both swaps' first half, the worker started), joined locally (:meth:`join`, never a
    collective), landed by the next collective call (:meth:`land`: the device weights finish the
    push, gathering the other ranks' shards, and swap it in)."""

    def __init__(self, worker: CpuStepWorker | None, profile: ProfileRecorder,
                 weights: DeviceWeights, buckets: Buckets, update: HostUpdate) -> None:
        self.worker, self.profile, self.weights = worker, profile, weights
        self.buckets, self.update = buckets, update
        self.pending: Pending | None = None  # the step submitted, until it lands: one value

    def targets(self) -> list[list[Tensor]]:
        """The device part writes both weight sets: the spare one lands with the host part."""
        assert self.weights.spare is not None, "delayed update without spare weights"
        return [self.weights.live, self.weights.spare]

    def run(self, step: int, plan: StepPlan) -> None:
        """The host part of a step, its device part done: on the worker (:meth:`submit`)."""
        self.weights.publish([bucket.b for bucket in self.buckets.device()])
        self.submit(step, plan)

    def submit(self, step: int, plan: StepPlan) -> None:
        """Step ``step``'s kernel on the worker: it reads the gradient set the step decided on
        and writes the spare weights; the next backward fills the other set meanwhile."""
        assert self.worker is not None, "delayed update without a worker"
        assert self.weights.spare is not None, "delayed update without spare weights"
        used = self.buckets.swap()
        push = self.weights.push(step, self.weights.spare)
        self.worker.submit(self.update.run, plan, push, False, used)
        self.pending = Pending(step, push)

    def join(self) -> None:
        """Wait for the worker (the wait is the step's exposed stall)."""
        pending = self.pending
        if pending is None or pending.phase is not Phase.RUNNING:
            return
        self.pending = Pending(pending.step, pending.push, Phase.JOINED)
        with self.profile.span("stall", pending.step):
            try:
                assert self.worker is not None
                self.worker.wait()
            except Exception as e:
                self.pending = None
                pending.push.abandon()
                self.profile.close(pending.step)
                raise RuntimeError(
                    f"ZeroOffload: the delayed CPU step of step {pending.step} failed on its "
                    f"worker thread ({type(e).__name__}: {e}); the host optimizer state may be "
                    "partly updated, so resume from a checkpoint") from e

    def land(self) -> None:
        """Collective with several ranks: step i's weights become the module's."""
        self.join()
        pending, self.pending = self.pending, None
        if pending is None:
            return
        k = pending.step
        logger.debug("delayed update: step %d lands (gather and swap)", k)
        try:
            with self.profile.span("stall", k):
                self.weights.land(pending.push)
        finally:
            self.profile.close(k)
        logger.debug("delayed update: step %d landed", k)
