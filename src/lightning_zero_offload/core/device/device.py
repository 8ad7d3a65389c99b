"""Device asynchrony, in one place: side streams, work queued on them, events, waits.

The engine and the gradient streamer never touch ``torch.cuda`` streams or events; they speak
this interface, which has three implementations:

- :class:`SyncDevice`: the CPU as compute device. Queued work runs at once, events are complete
  when recorded, waits do nothing. Released bucket buffers go to a small pool, so large buffers
  are not page-faulted in again every backward.
- :class:`CudaDevice`: a line-by-line mapping onto ``torch.cuda.Stream``/``Event``.
- ``testing.emulated_device.EmulatedDevice``: for tests on the CPU
  (``lightning_zero_offload.testing.emulated_async_device``, or ``LZO_EMULATED_DEVICE_SEED``),
  which ``core.device.device_factory.make_device`` loads only when asked for it. Each side stream is
  a worker thread running its queue in FIFO order, each item after a seeded random delay; an event
  completes when its stream reaches it; released buffers are filled with NaN before anyone can
  have them again, so reading one too early or too late shows up in the result.

The ordering rules the engine must follow, and which of them the emulation checks:

1. A host buffer written by a side stream (gradient staging) is read only after a host wait on
   the event recorded after the write (:meth:`Event.wait`). Checked.
2. Work the compute stream runs after a side stream's work it depends on (the next forward after
   the weights' host-to-device copies) is preceded by :meth:`compute_waits`. Checked: the
   emulation blocks the main thread at the next :meth:`compute_point` (every forward, and the
   end of ``step()``) until the stream has drained up to the wait, and not earlier, as a GPU's
   compute stream would.
3. A side stream that reads what the compute stream wrote (a bucket after backward, weights that
   backward still reads) is preceded by :meth:`stream_waits_compute`. Checked by the race
   detector (``testing.race_detector``, on by default on the emulated device): the main thread's
   torch ops are recorded with a ``TorchDispatchMode`` as the compute stream's, each side
   stream's items as that stream's, with vector clocks of what each stream and the host waited
   for; an access to a registered buffer (bucket, staging slice, device weights, 0-d statistic)
   that no wait orders after another stream's conflicting one raises
   ``testing.StreamOrderError`` naming both streams, the buffer's role and the rule (it re-checks
   rules 1, 2 and 4 the same way).
4. A device buffer handed to a side stream is released with :meth:`release` on that stream
   (CUDA's ``record_stream``), never dropped while the stream may still use it. Checked: the
   emulation poisons the buffer at that point of the stream and then hands it out again.
5. A host buffer whose contents were consumed is passed to :meth:`handed_back` before it is
   reused. Checked: the emulation fills it with NaN at once.
6. **Staging reuse** (wait kind ``"staging_reuse"``): a gradient staging slice also carries the
   new half weights to the device (the kernel writes them over the gradient it consumed), so the
   next device-to-host copy into it waits for the event after the host-to-device copy that reads
   it (:meth:`stream_waits` of kind ``"staging_reuse"``; a host write waits on the host), and
   the slice is handed back on the copy stream after that copy. Checked: the emulation poisons
   it there, the waiting stream blocks until the copy stream has passed the event, and the race
   detector sees a copy into the slice that no wait orders after the weights' copy out of it.

Collectives queued on a side stream (:meth:`collective`) run, on the emulated device, on the
stream's own thread with the stream's own process group (created at setup on every rank), so
ranks agree on the order of every group's collectives; on CUDA they are issued by the calling
thread on that stream, in program order, as NCCL requires.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.limits import BUCKET_BUFFERS

POOL_SIZE = BUCKET_BUFFERS  # released bucket buffers kept for reuse (what the budget counts)

# The waits a mutation test may drop on the emulated device (``testing.emulated_async_device(
# skip_waits=...)``), named after the methods that queue them; ``:d2h``/``:h2d`` name one stream.
WAIT_KINDS = (
    "stream_waits_compute",  # rule 3, every side stream
    "stream_waits_compute:d2h",  # rule 3, the gradient (device-to-host) stream only
    "stream_waits_compute:h2d",  # rule 3, the weight (host-to-device) stream only
    "compute_waits",  # rule 2
    "stream_waits",  # a side stream waits for another's event (the copy after the reduce)
    "compute_waits_event",  # compute waits for a bucket buffer's last use before reusing it
    "device_stage_filled",  # the device part's step waits for the last write of its gradient
    "staging_reuse",  # rule 6: the copy into a staging slice waits for the weights' copy out
    "event_wait",  # rule 1: host waits (Event.wait)
    "release",  # rule 4: the buffer goes back at once, not at the stream's point
    "synchronize",  # the whole-device waits (end of a step's drain, state_dict, close)
)


def check_skip_waits(skip: object) -> frozenset[str]:
    """``skip`` as a set of wait kinds; an unknown name is a ValueError listing the valid ones."""
    names = frozenset([skip] if isinstance(skip, str) else skip or ())  # type: ignore[arg-type]
    unknown = sorted(names - set(WAIT_KINDS))
    if unknown:
        raise ValueError(f"skip_waits: unknown wait kind(s) {unknown}; the valid ones are "
                         f"{list(WAIT_KINDS)}")
    return names


class Event:
    """A point in a stream's queue. ``wait`` blocks the host until the stream has passed it;
    ``seconds_since(other)`` is the device time between two events (for profiles)."""

    def wait(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def seconds_since(self, earlier: Event) -> float:
        return 0.0


class _DoneEvent(Event):
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def seconds_since(self, earlier: Event) -> float:
        return self.t - getattr(earlier, "t", self.t)


class SyncDevice:
    """The CPU as compute device: everything happens at once."""

    asynchronous = False

    def __init__(self, device: torch.device, process_group: Any = None) -> None:
        self.device = device
        self.group = process_group
        self._pool: list[Tensor] = []

    def side_stream(self, name: str) -> object:
        return None

    def track(self, t: Tensor, role: str) -> None:
        """Name the device buffer ``t`` (e.g. "device weights") for the emulated device's race
        detector; nothing elsewhere."""

    def run(self, stream: object, fn: Callable[[], object]) -> None:
        fn()

    def collective(self, stream: object, fn: Callable[[object], None]) -> None:
        fn(self.group)

    def record(self, stream: object) -> Event:
        return _DoneEvent()

    def stream_waits_compute(self, stream: object) -> None:
        pass

    def stream_waits(self, stream: object, event: Event, kind: str = "stream_waits") -> None:
        """Work queued on ``stream`` from now on runs after ``event`` (another side stream's:
        the copy after the reduce-scatter, or rule 6's ``"staging_reuse"``: the copy into a
        slice after the weights' copy out of it), without blocking the host. ``kind`` names
        the wait for ``skip_waits``."""

    def compute_waits(self, stream: object) -> None:
        pass

    def compute_waits_event(self, event: Event, kind: str = "compute_waits_event") -> None:
        """Compute work from the next compute point on runs after ``event`` (a bucket buffer
        reused once the copy that read it is done), without blocking the host on a GPU."""

    def compute_point(self) -> None:
        pass

    def host_task(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the host off the calling thread; tasks run one at a time, in order."""
        f: Future = Future()
        f.set_result(fn())
        return f

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A device buffer of at least ``numel`` elements (contents undefined)."""
        for i, t in enumerate(self._pool):
            if t.numel() >= numel and t.dtype == dtype:
                return self._pool.pop(i)[:numel]
        if self._pool:  # none fits: drop the smallest, so the pool does not grow
            self._pool.pop(min(range(len(self._pool)), key=lambda i: self._pool[i].numel()))
        return torch.empty(numel, dtype=dtype, device=self.device)

    def release(self, t: Tensor, stream: object) -> None:
        """``t`` may be reused once ``stream`` has passed this point."""
        self._pool.append(t if t._base is None else t._base)
        if len(self._pool) > POOL_SIZE:  # what the host-memory budget counts
            self._pool.pop(min(range(len(self._pool)), key=lambda i: self._pool[i].numel()))

    def handed_back(self, t: Tensor) -> None:
        """The host buffer ``t`` was consumed; its contents are dead from here on."""

    def synchronize(self) -> None:
        pass

    # -- long-lived device memory (the weights, optimizer state kept on the device) -------------
    def zeros(self, numel: int, dtype: torch.dtype, role: str) -> Tensor:
        """A zeroed device tensor that lives until :meth:`free` (``role`` names it)."""
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def free(self, t: Tensor) -> None:
        """``t`` from :meth:`zeros` is no longer used (its memory goes with its last view)."""

    def memory(self) -> tuple[int, int] | None:
        """``(peak, capacity)`` bytes: the most held since :meth:`reset_peak_memory`, and the
        device's memory. None where the device has no memory of its own (the CPU)."""
        return None

    def free_memory(self) -> int | None:
        """Bytes the device can still allocate (None: no memory of its own)."""
        return None

    def reset_peak_memory(self) -> None:
        pass

    def release_host_cache(self) -> None:
        """Freed pinned host blocks back to the system (only CUDA caches them)."""

    def close(self) -> None:
        self._pool = []


class _CudaEvent(Event):
    def __init__(self, stream: torch.cuda.Stream) -> None:
        # blocking: a host wait sleeps instead of spinning against the CPU step's threads
        self.e = torch.cuda.Event(enable_timing=True, blocking=True)
        self.e.record(stream)

    def wait(self) -> None:
        self.e.synchronize()

    def query(self) -> bool:
        return self.e.query()

    def seconds_since(self, earlier: Event) -> float:
        return earlier.e.elapsed_time(self.e) / 1000.0  # type: ignore[attr-defined]


class CudaDevice(SyncDevice):
    """A thin mapping onto CUDA streams and events; the compute stream is the one current when
    compute work is queued (a forward under the user's own ``torch.cuda.stream(s)`` included)."""

    asynchronous = True

    def __init__(self, device: torch.device, process_group: Any = None) -> None:
        super().__init__(device, process_group)
        # What compute work must wait for (the weights' copies): each stream current at a compute
        # point waits once for the latest of them, not only the stream current at step().
        self._waits: dict[int, tuple[Any, set[int]]] = {}  # side stream -> event, waiters
        self._tasks = ThreadPoolExecutor(1, thread_name_prefix="lzo-host-task",
                                         initializer=torch.cuda.set_device, initargs=(device,))

    def side_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def run(self, stream: object, fn: Callable[[], object]) -> None:
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            fn()

    def collective(self, stream: object, fn: Callable[[object], None]) -> None:
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            fn(self.group)

    def record(self, stream: object) -> Event:
        return _CudaEvent(stream)  # type: ignore[arg-type]

    def stream_waits_compute(self, stream: object) -> None:
        stream.wait_stream(self._compute())  # type: ignore[attr-defined]

    def stream_waits(self, stream: object, event: Event, kind: str = "stream_waits") -> None:
        stream.wait_event(event.e)  # type: ignore[attr-defined]

    def compute_waits(self, stream: object) -> None:
        e = torch.cuda.Event()
        e.record(stream)  # type: ignore[arg-type]
        self._waits[stream.cuda_stream] = (e, set())  # type: ignore[attr-defined]
        self.compute_point()

    def compute_waits_event(self, event: Event, kind: str = "compute_waits_event") -> None:
        self._compute().wait_event(event.e)  # type: ignore[attr-defined]

    def compute_point(self) -> None:
        current = self._compute()
        for e, waited in self._waits.values():
            if current.cuda_stream not in waited:  # the raw handle: wrappers are not unique
                current.wait_event(e)
                waited.add(current.cuda_stream)

    def host_task(self, fn: Callable[[], object]) -> Future:
        return self._tasks.submit(fn)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)  # the caching allocator

    def release(self, t: Tensor, stream: object) -> None:
        t.record_stream(stream)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory(self) -> tuple[int, int] | None:
        # Reserved, not allocated: what the caching allocator holds is what others cannot use.
        return (torch.cuda.max_memory_reserved(self.device),
                torch.cuda.get_device_properties(self.device).total_memory)

    def free_memory(self) -> int | None:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
            self.device)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_host_cache(self) -> None:
        # Pinned blocks freed by the engine stay cached by torch's host allocator otherwise.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()

    def close(self) -> None:
        self._tasks.shutdown(wait=True)
        self.release_host_cache()
