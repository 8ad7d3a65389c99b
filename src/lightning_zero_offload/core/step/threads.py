"""The CPU step's threads: the worker thread that runs a step off the caller's thread (delayed
update, core binding) and how many threads the kernel uses.

Core binding (``cpu_affinity``) applies to the worker thread and to the kernel's helper threads
it starts; the kernel's pool is per process, so helpers started earlier by another thread keep
their own affinity.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero_offload.core.config import ZeroOffloadConfig


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


def step_threads(config: ZeroOffloadConfig, world_size: int, device: torch.device) -> int:
    """The kernel's threads: ``cpu_threads``, else one per ``cpu_affinity`` core, else
    :func:`default_threads`."""
    cores = config.cpu_affinity
    overlapped = config.delayed_update or bool(config.offload_weights and config.overlap_host_step)
    return config.cpu_threads or (len(cores) if cores else default_threads(
        world_size, device, overlapped))


def default_threads(world_size: int, device: torch.device, delayed: bool) -> int:
    """The cores this process may use (``os.sched_getaffinity``, not ``torch.get_num_threads()``,
    which torchrun's OMP_NUM_THREADS=1 makes 1) shared among the ranks on this node
    (``LOCAL_WORLD_SIZE``, else one rank per visible GPU, else every rank here). With delayed
    update one core stays free for the thread that drives the device (it launches kernels and
    drains gradient transfers while the CPU step runs); so with the host step under the next
    forward (``overlap_host_step``)."""
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
