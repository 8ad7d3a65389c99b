"""Device asynchrony, in one place: side streams, work queued on them, events, waits.

The engine and the gradient streamer never touch ``torch.cuda`` streams or events; they speak
this interface, which has three implementations:

- :class:`SyncDevice`: the CPU as compute device. Queued work runs at once, events are complete
  when recorded, waits do nothing. Released bucket buffers go to a small pool, so large buffers
  are not page-faulted in again every backward.
- :class:`CudaDevice`: a line-by-line mapping onto ``torch.cuda.Stream``/``Event``.
- :class:`EmulatedDevice`: for tests on the CPU (``lightning_zero_offload.testing.
  emulated_async_device``). Each side stream is a worker thread running its queue in FIFO order,
  each item after a seeded random delay; an event completes when its stream reaches it; released
  buffers are filled with NaN before anyone can have them again, so reading one too early or too
  late shows up in the result.

The ordering rules the engine must follow, and which of them the emulation checks:

1. A host buffer written by a side stream (gradient staging) is read only after a host wait on
   the event recorded after the write (:meth:`Event.wait`). Checked.
2. Work the compute stream runs after a side stream's work it depends on (the next forward after
   the weights' host-to-device copies) is preceded by :meth:`compute_waits`. Checked: the
   emulation blocks the main thread at the next :meth:`compute_point` (every forward) until the
   stream has drained up to the wait, and not earlier, as a GPU's compute stream would.
3. A side stream that reads what the compute stream wrote (a bucket after backward, weights that
   backward still reads) is preceded by :meth:`stream_waits_compute`. **Not checked**: the
   emulated compute stream is the main thread itself and is always finished when the host moves
   on, so a missing wait of this kind only shows on a GPU.
4. A device buffer handed to a side stream is released with :meth:`release` on that stream
   (CUDA's ``record_stream``), never dropped while the stream may still use it. Checked: the
   emulation poisons the buffer at that point of the stream and then hands it out again.
5. A host buffer whose contents were consumed is passed to :meth:`handed_back` before it is
   reused. Checked: the emulation fills it with NaN at once.

Collectives queued on a side stream (:meth:`collective`) run, on the emulated device, on the
stream's own thread with the stream's own process group (created at setup on every rank), so
ranks agree on the order of every group's collectives; on CUDA they are issued by the calling
thread on that stream, in program order, as NCCL requires.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero_offload.core.collectives import release_group, side_group

POOL_SIZE = 3  # released bucket buffers kept for reuse (streaming.MAX_IN_FLIGHT + 1)


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

    def run(self, stream: object, fn: Callable[[], object]) -> None:
        fn()

    def collective(self, stream: object, fn: Callable[[object], None]) -> None:
        fn(self.group)

    def record(self, stream: object) -> Event:
        return _DoneEvent()

    def stream_waits_compute(self, stream: object) -> None:
        pass

    def compute_waits(self, stream: object) -> None:
        pass

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

    def close(self) -> None:
        self._pool = []


class _CudaEvent(Event):
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.e = torch.cuda.Event(enable_timing=True)
        self.e.record(stream)

    def wait(self) -> None:
        self.e.synchronize()

    def query(self) -> bool:
        return self.e.query()

    def seconds_since(self, earlier: Event) -> float:
        return earlier.e.elapsed_time(self.e) / 1000.0  # type: ignore[attr-defined]


class CudaDevice(SyncDevice):
    """A thin mapping onto CUDA streams and events; the compute stream is the current one."""

    asynchronous = True

    def __init__(self, device: torch.device, process_group: Any = None) -> None:
        super().__init__(device, process_group)
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

    def compute_waits(self, stream: object) -> None:
        self._compute().wait_stream(stream)  # type: ignore[arg-type]

    def host_task(self, fn: Callable[[], object]) -> Future:
        return self._tasks.submit(fn)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)  # the caching allocator

    def release(self, t: Tensor, stream: object) -> None:
        t.record_stream(stream)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._tasks.shutdown(wait=True)
        # Pinned blocks freed by the engine stay cached by torch's host allocator otherwise.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


class _EmuEvent(Event):
    def __init__(self, stream: _EmuStream, index: int) -> None:
        self.stream, self.index = stream, index

    def wait(self) -> None:
        self.stream.wait_for(self.index)

    def query(self) -> bool:
        return self.stream.reached(self.index)

    def seconds_since(self, earlier: Event) -> float:
        self.wait()
        earlier.wait()
        return self.stream.times[self.index] - earlier.stream.times[earlier.index]  # type: ignore


class _EmuStream:
    """A side stream: one thread running queued items in order, each after a random delay."""

    def __init__(self, name: str, rng: random.Random, max_delay_s: float,
                 group: object | None) -> None:
        self.rng, self.max_delay_s, self.group = rng, max_delay_s, group
        self.queued = 0  # items put
        self.done = 0  # items finished
        self.times: dict[int, float] = {0: time.perf_counter()}
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"lzo-emulated-{name}",
                                        daemon=True)
        self._thread.start()

    def put(self, fn: Callable[[], object]) -> int:
        """Queue ``fn``; returns its position (an event at it completes once it ran)."""
        with self._cv:
            self.queued += 1
            delay = self.rng.uniform(0.0, self.max_delay_s)  # drawn in queue order: seeded
            self._q.put((fn, delay))
            return self.queued

    def _loop(self) -> None:
        while True:
            fn, delay = self._q.get()
            if fn is None:
                return
            time.sleep(delay)
            try:
                if self.error is None:
                    fn()
            except BaseException as e:  # surfaced at the next wait on this stream
                self.error = e
            with self._cv:
                self.done += 1
                self.times[self.done] = time.perf_counter()
                self._cv.notify_all()

    def reached(self, index: int) -> bool:
        return self.done >= index

    def wait_for(self, index: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.done >= index)
        if self.error is not None:
            raise RuntimeError(f"emulated device stream failed: {self.error!r}") from self.error

    def close(self) -> None:
        self._q.put((None, 0.0))
        self._thread.join(timeout=30)

    @property
    def idle(self) -> bool:
        return self.done >= self.queued


class EmulatedDevice(SyncDevice):
    """Side streams as delayed worker threads over CPU tensors; see the module docstring."""

    asynchronous = True

    def __init__(self, device: torch.device, process_group: Any = None, *,
                 seed: int = 0, max_delay_ms: float = 3.0, timeout_s: float | None = None,
                 stream_delay_ms: dict[str, float] | None = None) -> None:
        super().__init__(device, process_group)
        self.timeout_s, self.stream_delay_s = timeout_s, {
            k: v / 1000.0 for k, v in (stream_delay_ms or {}).items()}
        self.seed, self.max_delay_s = seed, max_delay_ms / 1000.0
        self._streams: list[_EmuStream] = []
        self._compute_waits: list[Event] = []
        self._tasks = ThreadPoolExecutor(1, thread_name_prefix="lzo-emulated-host-task")
        self._lock = threading.Lock()
        self.live_bytes = self.peak_bytes = 0  # device buffers handed out by empty()

    def side_stream(self, name: str) -> _EmuStream:
        group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            group = side_group(self.group, self.timeout_s)  # the ranks build streams in order
        stream = _EmuStream(name, random.Random(f"{self.seed}/{len(self._streams)}"),
                            self.stream_delay_s.get(name, self.max_delay_s), group)
        self._streams.append(stream)
        return stream

    def run(self, stream: object, fn: Callable[[], object]) -> None:
        stream.put(fn)  # type: ignore[attr-defined]

    def collective(self, stream: object, fn: Callable[[object], None]) -> None:
        stream.put(lambda: fn(stream.group))  # type: ignore[attr-defined]

    def record(self, stream: object) -> Event:
        # A marker item: its time is when the stream reaches it, as a CUDA event's would be.
        return _EmuEvent(stream, stream.put(_nothing))  # type: ignore[arg-type, attr-defined]

    def compute_waits(self, stream: object) -> None:
        self._compute_waits.append(self.record(stream))

    def compute_point(self) -> None:
        waits, self._compute_waits = self._compute_waits, []
        for e in waits:
            e.wait()

    def host_task(self, fn: Callable[[], object]) -> Future:
        return self._tasks.submit(fn)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        with self._lock:
            t = super().empty(numel, dtype)
            self.live_bytes += _nbytes(t)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return _poison(t)

    def release(self, t: Tensor, stream: object) -> None:
        def give_back() -> None:
            with self._lock:
                _poison(t)
                self.live_bytes -= _nbytes(t)
                super(EmulatedDevice, self).release(t, stream)
        stream.put(give_back)  # type: ignore[attr-defined]

    def handed_back(self, t: Tensor) -> None:
        _poison(t)

    def synchronize(self) -> None:
        self.compute_point()
        for s in self._streams:
            s.wait_for(s.queued)

    def close(self) -> None:
        for s in self._streams:
            s.close()
            release_group(s.group, None)
        self._tasks.shutdown(wait=True)
        super().close()


def _nothing() -> None:
    pass


def _nbytes(t: Tensor) -> int:
    base = t if t._base is None else t._base
    return base.numel() * base.element_size()


def _poison(t: Tensor) -> Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


_emulation: dict | None = None  # set by testing.emulated_async_device


@contextlib.contextmanager
def emulate(seed: int, max_delay_ms: float,
            stream_delay_ms: dict[str, float] | None = None) -> Iterator[list[EmulatedDevice]]:
    """Engines created on the CPU inside the block use an :class:`EmulatedDevice`; yields the
    list of the devices made, for tests that inspect them."""
    global _emulation
    previous, made = _emulation, []
    _emulation = {"seed": seed, "max_delay_ms": max_delay_ms, "made": made,
                  "stream_delay_ms": stream_delay_ms}
    try:
        yield made
    finally:
        _emulation = previous


def make_device(device: torch.device, process_group: object | None,
                timeout_s: float | None = None) -> SyncDevice:
    """The asynchrony implementation for an engine whose compute device is ``device``."""
    if device.type == "cuda":
        return CudaDevice(device, process_group)
    seed = os.environ.get("LZO_EMULATED_DEVICE_SEED")
    if _emulation is None and seed:  # a whole test suite on the emulated device
        return EmulatedDevice(device, process_group, seed=int(seed), timeout_s=timeout_s)
    if _emulation is not None:
        emu = EmulatedDevice(device, process_group, seed=_emulation["seed"],
                             max_delay_ms=_emulation["max_delay_ms"], timeout_s=timeout_s,
                             stream_delay_ms=_emulation["stream_delay_ms"])
        _emulation["made"].append(emu)
        return emu
    return SyncDevice(device, process_group)
