"""The CPU step's thread: delayed parameter update (ZeRO-Offload, section 5) and core binding.

With ``delayed_update=True`` the engine hands the CPU step of step i (the kernel over this rank's
shard, chunk by chunk, each chunk's new weights written into a spare device weight buffer: by the
kernel itself on the CPU, by an asynchronous copy from pinned staging on a side stream on CUDA) to
one worker thread and returns; forward and backward of step i+1 run meanwhile on the live buffer,
which holds the weights through step i-1. The next ``step()`` (or ``synchronize()``) joins the
worker, all-gathers the other ranks' shards into the spare buffer and swaps the two, so step i's
weights are in place before step i+2's forward. Everything that involves other ranks or the
user's live state (gradient wait, global norm, loss scale, clip coefficient, learning rate) is
settled on the caller's thread before the worker starts, collectives stay on the caller's thread,
and the worker touches only buffers no one else uses until it is joined. The worker never runs a
collective, also when it runs a warm-up step or a step bound to ``cpu_affinity`` cores: the
all-gathers of those steps follow on the caller's thread once the kernel is done.

Core binding (``cpu_affinity``) applies to the worker thread and to the kernel's helper threads
it starts; the kernel's pool is per process, so helpers started earlier by another thread keep
their own affinity.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from lightning_zero_offload.core.profile import ProfileRecorder

if TYPE_CHECKING:
    from lightning_zero_offload.core.config import ZeroOffloadConfig
    from lightning_zero_offload.core.weights import DeviceWeights, WeightPush

logger = logging.getLogger(__name__)


def _init_thread(cores: Sequence[int] | None, device: torch.device | None) -> None:
    if cores:  # Linux: pid 0 is the calling thread; threads it starts (the kernel's) inherit it
        os.sched_setaffinity(0, cores)
    if device is not None and device.type == "cuda":  # a new thread starts on device 0
        torch.cuda.set_device(device)


class CpuStepWorker:
    """One background thread running one CPU step at a time; its errors re-raise in ``wait``."""

    def __init__(self, cores: Sequence[int] | None = None,
                 device: torch.device | None = None) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lzo-cpu-step",
                                        initializer=_init_thread,
                                        initargs=(tuple(cores) if cores else None, device))
        self._future: Future | None = None

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        if self._future is not None:
            raise RuntimeError("ZeroOffload: a CPU step is already running; wait() first")
        self._future = self._pool.submit(fn, *args)

    def run(self, fn: Callable[..., None], *args: object) -> None:
        """Run on the worker (bound cores) and wait: the synchronous step with core binding."""
        self.submit(fn, *args)
        self.wait()

    def wait(self) -> bool:
        """Join the running step; True if there was one. Its exception, if any, is raised here."""
        future, self._future = self._future, None
        if future is None:
            return False
        future.result()
        return True

    def close(self) -> None:
        self._future = None
        self._pool.shutdown(wait=True)


class DelayedUpdate:
    """The one step whose CPU step runs on the worker: submitted by the step with its weight
    push, joined locally (``join``, never a collective), landed by the next collective call
    (``land``: the device weights finish the push, gathering the other ranks' shards, and swap
    it in)."""

    def __init__(self, worker: CpuStepWorker | None, profile: ProfileRecorder,
                 weights: DeviceWeights) -> None:
        self.worker, self.profile, self.weights = worker, profile, weights
        self.pending: int | None = None
        self._push: WeightPush | None = None
        self._joined = False

    def submit(self, step: int, push: WeightPush, fn: Callable[..., None],
               *args: object) -> None:
        """Run ``fn(*args)`` on the worker: step ``step``'s kernel, filling ``push``."""
        assert self.worker is not None, "delayed update without a worker"
        self.worker.submit(fn, *args)
        self.pending, self._push, self._joined = step, push, False

    def join(self) -> None:
        """Wait for the worker (the wait is the step's exposed stall)."""
        k = self.pending
        if k is None or self._joined:
            return
        self._joined = True
        with self.profile.span("stall", k):
            try:
                assert self.worker is not None
                self.worker.wait()
            except Exception as e:
                self.pending = None
                if self._push is not None:
                    self._push.abandon()
                self._push = None
                self.profile.close(k)
                raise RuntimeError(
                    f"ZeroOffload: the delayed CPU step of step {k} failed on its worker thread "
                    f"({type(e).__name__}: {e}); the host optimizer state may be partly "
                    "updated, so resume from a checkpoint") from e

    def land(self) -> None:
        """Collective with several ranks: step i's weights become the module's."""
        self.join()
        k, self.pending = self.pending, None
        push, self._push = self._push, None
        if k is None or push is None:
            return
        logger.debug("delayed update: step %d lands (gather and swap)", k)
        try:
            with self.profile.span("stall", k):
                self.weights.land(push)
        finally:
            self.profile.close(k)
        logger.debug("delayed update: step %d landed", k)


def check_cores(cores: Sequence[int] | None) -> tuple[int, ...] | None:
    """``cpu_affinity`` must name cores this process may run on."""
    if cores is None:
        return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = tuple(cores)
    bad = [c for c in cores if not isinstance(c, int) or (allowed is not None and c not in allowed)]
    if not cores or bad:
        raise ValueError(
            f"ZeroOffloadConfig: cpu_affinity={cores!r} must be a non-empty list of core ids this "
            f"process may use ({sorted(allowed) if allowed else 'unknown'}); bad: {bad}"
        )
    if allowed is None:
        raise ValueError("ZeroOffloadConfig: cpu_affinity needs os.sched_setaffinity (Linux)")
    return cores


def step_threads(config: ZeroOffloadConfig, world_size: int, device: torch.device) -> int:
    """The kernel's threads: ``cpu_threads``, else one per ``cpu_affinity`` core, else
    :func:`default_threads`."""
    cores = config.cpu_affinity
    return config.cpu_threads or (len(cores) if cores else default_threads(
        world_size, device, config.delayed_update))


def default_threads(world_size: int, device: torch.device, delayed: bool) -> int:
    """The cores this process may use (``os.sched_getaffinity``, not ``torch.get_num_threads()``,
    which torchrun's OMP_NUM_THREADS=1 makes 1) shared among the ranks on this node
    (``LOCAL_WORLD_SIZE``, else one rank per visible GPU, else every rank here). With delayed
    update one core stays free for the thread that drives the device (it launches kernels and
    drains gradient transfers while the CPU step runs)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        ranks = int(local)
    elif device.type == "cuda":
        ranks = min(world_size, max(1, torch.cuda.device_count()))
    else:
        ranks = world_size
    share = max(1, (cores or 1) // max(1, ranks))
    return max(1, share - 1) if delayed else share
