"""The host step under the next forward, exactly: FSDP2's host weights (``CPUOffloadPolicy``).

With ``CPUOffloadPolicy`` each rank's fp32 shards live in host memory and are the master: the
kernel updates them in place (``core.buckets.pieces``), and FSDP2 copies a unit up when it
gathers it for its forward. So the next forward needs a unit's update only when that unit's
pre-forward gathers it. :class:`OverlappedStep` steps the buckets on a worker thread in the order
the next forward needs them (the root unit's own parameters first, then the units in forward
order), and a forward pre-hook on every unit, ahead of FSDP2's own, waits for the buckets that
hold that unit's parameters only. Nothing is stale, so the weights are bit for bit the
unoverlapped step's (``overlap_host_step=False``, which steps every bucket before ``step()``
returns). Everything else that reads the weights or the buckets the worker reads waits for the
whole update: the next step's gradients (``core.transfer.streaming``), ``synchronize()``,
checkpoints, ``module.state_dict()`` and teardown.

It stands in for both host parts of the step (``SyncUpdate`` and ``DelayedUpdate``: the step
hands it the decided plan, and joining it is landing it); there is no device part.

Gap in FSDP2's public API: the units a unit prefetches (``set_modules_to_forward_prefetch``)
cannot be read back, and a prefetched unit is gathered in the prefetching unit's pre-forward; so
each unit's pre-hook waits for its own buckets and those of the unit after it in forward order
(FSDP2 prefetches none in forward by default; a deeper explicit prefetch is not covered).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from torch import Tensor, nn

from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Slot
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.step.threads import CpuStepWorker
from lightning_zero_offload.core.step.update import HostUpdate, StepPlan


def forward_order(units: list[nn.Module], buckets: Buckets,
                  slots: list[Slot]) -> tuple[list[int], list[set[int]]]:
    """``(bucket order, buckets each unit waits for)``: buckets by the first unit (in
    ``units``' order: the root, then the blocks as the model registers them) whose parameters
    they hold; a parameter belongs to its innermost unit."""
    unit_of = {id(p): u for u, unit in enumerate(units) for p in unit.parameters()}
    first: dict[int, int] = {}
    holds: list[set[int]] = [set() for _ in units]
    for bucket in buckets:
        for piece in bucket.pieces:
            u = unit_of.get(id(slots[piece.slot].param), 0)
            holds[u].add(bucket.b)
            first[bucket.b] = min(first.get(bucket.b, u), u)
    order = sorted(first, key=lambda b: (first[b], b))
    return order, holds


class OverlappedStep:
    """The host step over FSDP2's host shards, overlapped with the next forward unit by unit."""

    def __init__(self, update: HostUpdate, worker: CpuStepWorker | None, buckets: Buckets,
                 units: list[nn.Module], reshard: Callable[[], None],
                 profile: ProfileRecorder, *, overlap: bool = True) -> None:
        self.update, self.worker, self.buckets, self.profile = update, worker, buckets, profile
        self.reshard, self.overlap = reshard, overlap
        self.order, holds = forward_order(units, buckets, update.layout.slots)
        self.first_unit = {b: u for u in reversed(range(len(units))) for b in holds[u]}
        # a unit's pre-forward may gather the next unit too (forward prefetch): wait for both
        self.needs = [holds[u] | (holds[u + 1] if u + 1 < len(units) else set())
                      for u in range(len(units))]
        self._cond = threading.Condition()
        self._done: set[int] = set(range(len(buckets)))  # buckets stepped (all: none pending)
        self._error: BaseException | None = None
        self._step: int | None = None  # the step running on the worker
        self._label = 0  # the step whose update the next forward waits for (its profile's)
        self.hooks = [unit.register_forward_pre_hook(self._waiter(u), prepend=True)
                      for u, unit in enumerate(units)]

    def targets(self) -> list[list[Tensor]]:
        """No device part: every bucket's state is on the host."""
        return []

    def run(self, step: int, plan: StepPlan) -> None:
        """Step ``step``'s host update: on the worker, overlapped (returns at once), else here."""
        self.join()
        self.reshard()  # no unit keeps gathered weights the update would not reach
        with self._cond:
            self._done, self._error, self._label = set(), None, step
        if not self.overlap:  # here, or on the core-bound worker, before step() returns
            with self.profile.span("stall", step):
                if self.worker is not None:
                    self.worker.run(self._update, step, plan)
                else:
                    self._update(step, plan)
            self.profile.close(step)
            return
        assert self.worker is not None, "an overlapped step without a worker"
        self._step = step
        self.worker.submit(self._update, step, plan)

    def _update(self, step: int, plan: StepPlan) -> None:
        try:
            with self.profile.span("cpu_step", step):
                self.update.run_in_place(plan, step, self.order, self._finished,
                                         lambda b: f"unit_update:{self.first_unit[b]}")
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise

    def _finished(self, b: int) -> None:
        with self._cond:
            self._done.add(b)
            self._cond.notify_all()

    def _waiter(self, u: int) -> Callable[..., None]:
        def wait(*_: object) -> None:
            need = self.needs[u]
            # recorded even when it does not wait: the timeline of the next forward
            with self.profile.span(f"unit_wait:{u}", self._label):
                if not need <= self._done:  # else the update is ahead of the forward
                    with self._cond:
                        self._cond.wait_for(lambda: need <= self._done or self._error is not None)
            if self._error is not None:
                self.join()  # raises the worker's error
        return wait

    def join(self) -> None:
        """Wait for the whole update (the wait is the step's exposed stall)."""
        step, self._step = self._step, None
        if step is None or self.worker is None:
            return
        try:
            with self.profile.span("stall", step):
                self.worker.wait()
        except Exception as e:
            raise RuntimeError(
                f"ZeroOffload: the host step of step {step} failed on its worker thread "
                f"({type(e).__name__}: {e}); FSDP2's host weights and the optimizer state may "
                "be partly updated, so resume from a checkpoint") from e
        finally:
            self.profile.close(step)

    land = join  # what the engine calls before anything reads the weights

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
