"""The emulated asynchronous device: side streams as delayed worker threads over CPU tensors.

See ``core.device`` for the ordering rules it checks and the one it cannot (a side stream that
does not wait for the compute stream), and ``lightning_zero_offload.testing`` for the hooks that
turn it on.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero_offload.core.collectives import release_group, side_group
from lightning_zero_offload.core.device import Event, SyncDevice


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
        if self.error is not None:  # as is: on CUDA the caller's thread would have raised it
            raise self.error

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

    def stream_waits_event(self, stream: object, event: Event, kind: str) -> None:
        stream.put(event.wait)  # type: ignore[attr-defined]  # the stream's thread blocks there

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
