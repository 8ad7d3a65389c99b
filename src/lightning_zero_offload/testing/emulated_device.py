"""The emulated asynchronous device: side streams as delayed worker threads over CPU tensors.

See ``core.device.device`` for the ordering rules it checks (rule 3, a side stream that does not
wait for the compute stream, through the race detector of ``testing.race_detector``), and
``lightning_zero_offload.testing`` for the hooks that turn it on.
"""

from __future__ import annotations

import atexit
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero_offload.core.device.device import Event, SyncDevice, check_skip_waits
from lightning_zero_offload.core.dist.collectives import release_group, side_group
from lightning_zero_offload.testing import race_detector as races
from lightning_zero_offload.testing.race_detector import COMPUTE, HOST, Clock, RaceDetector, join


class _EmuEvent(Event):
    def __init__(self, stream: _EmuStream, index: int, clock: Clock, skip: bool = False) -> None:
        self.stream, self.index, self.clock, self.skip = stream, index, clock, skip

    def wait(self) -> None:
        if self.skip:  # a mutation test dropped host waits
            return
        self.stream.wait_for(self.index)
        det = self.stream.det
        if det is not None:  # the host (and, on the main thread, the work it queues) is after it
            main = threading.get_ident() == det.main
            det.merge((HOST, COMPUTE) if main else (HOST,), self.clock)
            if main:
                det.raise_pending()

    def query(self) -> bool:
        return self.stream.reached(self.index)

    def seconds_since(self, earlier: Event) -> float:  # as elapsed_time: no ordering
        self.stream.wait_for(self.index)
        earlier.stream.wait_for(earlier.index)  # type: ignore[attr-defined]
        return self.stream.times[self.index] - earlier.stream.times[earlier.index]  # type: ignore


class _EmuStream:
    """A side stream: one thread running queued items in order, each after a random delay.

    Every stream still alive when the interpreter exits is stopped and joined first
    (:func:`_stop_all`): a daemon thread that wakes during finalization (an item still queued
    after a failed step, its delay running) is ended by the interpreter inside torch's
    thread-local destructors, and the process aborts ("terminate called without an active
    exception", status 134) instead of exiting with the script's own status."""

    live: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, name: str, rng: random.Random, max_delay_s: float,
                 group: object | None, det: RaceDetector | None = None) -> None:
        self.rng, self.max_delay_s, self.group = rng, max_delay_s, group
        self.name, self.det = name, det
        self.clock: Clock = {}  # what the next queued item is ordered after (race detector)
        self.queued = 0  # items put
        self.done = 0  # items finished
        self.times: dict[int, float] = {0: time.perf_counter()}
        self.error: BaseException | None = None
        self.stopping = False  # exiting: what is still queued is dropped
        self._cv = threading.Condition()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"lzo-emulated-{name}",
                                        daemon=True)
        self._thread.start()
        _EmuStream.live.add(self)

    def put(self, fn: Callable[[], object], internal: bool = False) -> int:
        """Queue ``fn``; returns its position (an event at it completes once it ran).
        ``internal``: the emulation's own work (poisoning), not recorded by the detector."""
        return self.put_clocked(fn, internal)[0]

    def put_clocked(self, fn: Callable[[], object], internal: bool = False) -> tuple[int, Clock]:
        """``put``, also returning the item's vector clock (its own position included)."""
        with self._cv:
            self.queued += 1
            delay = self.rng.uniform(0.0, self.max_delay_s)  # drawn in queue order: seeded
            ctx: tuple | None = races.IGNORE
            if self.det is not None:  # queued by the host: after the host's accesses so far
                self.clock = join(self.clock, self.det.host_view())
                if not internal:
                    ctx = (self.det, self.name, self.queued, self.clock, self._auto)
            self._q.put((fn, delay, ctx))
            return self.queued, {**self.clock, self.name: self.queued}

    def waits_for(self, clock: Clock) -> None:
        """Items queued from now on are ordered after ``clock`` (a stream wait)."""
        with self._cv:
            self.clock = join(self.clock, clock)

    def _auto(self, t: Tensor, write: bool) -> tuple[str, bool] | None:
        """The role of a buffer this stream touches that nobody registered: (role, host)."""
        if self.name == "d2h" and write:
            return ("0-d gradient statistic", False) if t.dim() == 0 else ("staging slice", True)
        if self.name == "h2d" and not write:
            return "host source of a weight copy (staging or master)", True
        return None

    def _loop(self) -> None:
        if self.det is not None:
            races.install_mode()
        try:
            self._run()
        finally:
            races.uninstall_mode()

    def _run(self) -> None:
        while True:
            fn, delay, ctx = self._q.get()
            if fn is None:
                return
            if not self.stopping:
                time.sleep(delay)
            try:
                if self.error is None and not self.stopping:
                    races.set_item(ctx)
                    fn()
            except BaseException as e:  # surfaced at the next wait on this stream
                self.error = e
            finally:
                races.set_item(None)
            with self._cv:
                self.done += 1
                self.times[self.done] = time.perf_counter()
                self._cv.notify_all()

    def reached(self, index: int) -> bool:
        return self.done >= index

    def wait_for(self, index: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.done >= index)
        if isinstance(self.error, races.StreamOrderError):  # found on this stream's thread
            raise races.StreamOrderError(str(self.error)) from self.error
        if self.error is not None:  # as is: on CUDA the caller's thread would have raised it
            raise self.error

    def close(self) -> None:
        self._q.put((None, 0.0, None))
        self._thread.join(timeout=30)

    def stop(self) -> None:
        """At exit: drop what is queued, end the thread."""
        self.stopping = True
        self.close()

    @property
    def idle(self) -> bool:
        return self.done >= self.queued


@atexit.register
def _stop_all() -> None:
    for stream in list(_EmuStream.live):
        stream.stop()


class EmulatedDevice(SyncDevice):
    """Side streams as delayed worker threads over CPU tensors; see the module docstring.
    ``race_detector``: check every stream-ordering rule (``testing.race_detector``);
    ``skip_waits``: wait kinds of ``core.device.device.WAIT_KINDS`` to drop (mutation tests)."""

    asynchronous = True

    def __init__(self, device: torch.device, process_group: Any = None, *,
                 seed: int = 0, max_delay_ms: float = 3.0, timeout_s: float | None = None,
                 stream_delay_ms: dict[str, float] | None = None, race_detector: bool = True,
                 skip_waits: Any = (), memory_bytes: int | None = None) -> None:
        super().__init__(device, process_group)
        self.timeout_s, self.stream_delay_s = timeout_s, {
            k: v / 1000.0 for k, v in (stream_delay_ms or {}).items()}
        self.seed, self.max_delay_s = seed, max_delay_ms / 1000.0
        self.skip = check_skip_waits(skip_waits)
        self.detector = RaceDetector() if race_detector else None
        if self.detector is not None:
            races.watch(self.detector)  # the calling thread's ops are the compute stream's
        self._streams: list[_EmuStream] = []
        self._compute_waits: list[Event] = []
        self._tasks = ThreadPoolExecutor(1, thread_name_prefix="lzo-emulated-host-task")
        self._lock = threading.Lock()
        # Device memory: bucket buffers handed out by empty() and tensors from zeros(); with a
        # capacity (``memory_bytes``) a zeros() beyond it raises as CUDA's allocator does.
        self.live_bytes = self.peak_bytes = 0
        self.memory_bytes = memory_bytes

    def side_stream(self, name: str) -> _EmuStream:
        group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            group = side_group(self.group, self.timeout_s)  # the ranks build streams in order
        stream = _EmuStream(name, random.Random(f"{self.seed}/{len(self._streams)}"),
                            self.stream_delay_s.get(name, self.max_delay_s), group, self.detector)
        self._streams.append(stream)
        return stream

    def track(self, t: Tensor, role: str) -> None:
        if self.detector is not None:
            self.detector.track(t, role)

    def run(self, stream: object, fn: Callable[[], object]) -> None:
        stream.put(fn)  # type: ignore[attr-defined]

    def collective(self, stream: object, fn: Callable[[object], None]) -> None:
        stream.put(lambda: fn(stream.group))  # type: ignore[attr-defined]

    def record(self, stream: object) -> Event:
        # A marker item: its time is when the stream reaches it, as a CUDA event's would be.
        index, clock = stream.put_clocked(_nothing, True)  # type: ignore[attr-defined]
        return _EmuEvent(stream, index, clock, "event_wait" in self.skip)  # type: ignore[arg-type]

    def stream_waits_compute(self, stream: object) -> None:
        name = stream.name  # type: ignore[attr-defined]
        kinds = {"stream_waits_compute", f"stream_waits_compute:{name}"}
        if self.detector is None or kinds & self.skip:
            return
        stream.waits_for(self.detector.compute_view())  # type: ignore[attr-defined]

    def compute_waits(self, stream: object) -> None:
        if "compute_waits" in self.skip:
            return
        event = self.record(stream)
        self._compute_waits.append(event)
        if self.detector is not None:  # on CUDA the compute work queued from now on is after it
            self.detector.merge((COMPUTE,), event.clock)  # type: ignore[attr-defined]

    def stream_waits(self, stream: object, event: Event, kind: str = "stream_waits") -> None:
        if kind in self.skip:
            return
        if self.detector is not None:  # what ``stream`` runs from now on is after the event
            stream.waits_for(event.clock)  # type: ignore[attr-defined]
        other, index = event.stream, event.index  # type: ignore[attr-defined]
        stream.put(lambda: other.wait_for(index), True)  # type: ignore[attr-defined]

    def compute_waits_event(self, event: Event, kind: str = "compute_waits_event") -> None:
        # The compute stream is this thread, and its next work (backward writing a reused
        # bucket buffer) follows at once: the wait is here.
        # A compute-stream wait, not a host one: the ``event_wait`` skip does not drop it.
        if kind not in self.skip:
            _EmuEvent(event.stream, event.index, event.clock).wait()  # type: ignore[attr-defined]

    def compute_point(self) -> None:
        waits, self._compute_waits = self._compute_waits, []
        for e in waits:
            e.stream.wait_for(e.index)  # type: ignore[attr-defined]
        if self.detector is not None:
            self.detector.raise_pending()

    def host_task(self, fn: Callable[[], object]) -> Future:
        return self._tasks.submit(races.recorded, fn) if self.detector else self._tasks.submit(fn)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        with self._lock:
            t = super().empty(numel, dtype)
            self.live_bytes += _nbytes(t)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.detector is not None:
            self.detector.track(t, "bucket buffer", fresh=True)
        return _poison(t)

    def release(self, t: Tensor, stream: object) -> None:
        det = self.detector

        def give_back() -> None:
            with self._lock:
                _poison(t)
                if det is not None:
                    det.released(t)
                self.live_bytes -= _nbytes(t)
                super(EmulatedDevice, self).release(t, stream)
        if "release" in self.skip:  # back at once, as a tensor freed without record_stream
            with self._lock:
                self.live_bytes -= _nbytes(t)
                super().release(t, stream)
            return
        stream.put(give_back, True)  # type: ignore[attr-defined]

    def handed_back(self, t: Tensor) -> None:
        _poison(t)

    def zeros(self, numel: int, dtype: torch.dtype, role: str) -> Tensor:
        n = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            cap = self.memory_bytes
            if cap is not None and self.live_bytes + n > cap:
                raise torch.OutOfMemoryError(
                    f"emulated device out of memory: {role} needs {n} bytes, {self.live_bytes} "
                    f"of {cap} are in use")
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return super().zeros(numel, dtype, role)

    def free(self, t: Tensor) -> None:
        with self._lock:
            self.live_bytes -= _nbytes(t)

    def memory(self) -> tuple[int, int] | None:
        return None if self.memory_bytes is None else (self.peak_bytes, self.memory_bytes)

    def free_memory(self) -> int | None:
        return None if self.memory_bytes is None else self.memory_bytes - self.live_bytes

    def reset_peak_memory(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def synchronize(self) -> None:
        self.compute_point()
        if "synchronize" in self.skip:
            return
        for s in self._streams:
            index, clock = s.put_clocked(_nothing, True)
            s.wait_for(index)
            if self.detector is not None:
                self.detector.merge((HOST, COMPUTE), clock)

    def close(self) -> None:
        for s in self._streams:
            s.close()
            release_group(s.group, None)
        self._tasks.shutdown(wait=True)
        if self.detector is not None:
            races.unwatch(self.detector)
        super().close()


def detector_default() -> bool:
    """On unless ``LZO_RACE_DETECTOR=0`` (to time the emulation without it)."""
    return os.environ.get("LZO_RACE_DETECTOR", "1").strip().lower() not in ("0", "false", "no")


def from_environment(device: torch.device, process_group: Any, seed: str,
                     timeout_s: float | None) -> EmulatedDevice:
    """The device ``LZO_EMULATED_DEVICE_SEED=seed`` asks for (``core.device.device_factory``)."""
    try:
        value = int(seed)
    except ValueError:
        raise ValueError(f"LZO_EMULATED_DEVICE_SEED={seed!r} is not an integer: set it to a "
                         "seed such as 1, or unset it for the plain CPU device") from None
    return EmulatedDevice(device, process_group, seed=value, timeout_s=timeout_s,
                          race_detector=detector_default())


def _nothing() -> None:
    pass


def _nbytes(t: Tensor) -> int:
    base = t if t._base is None else t._base
    return base.numel() * base.element_size()


def _poison(t: Tensor) -> Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t
