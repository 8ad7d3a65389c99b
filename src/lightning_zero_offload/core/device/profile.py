"""Per-step timing of the offload step: where the time goes and how much of the CPU step shows.

The engine brackets its phases with spans tagged by the optimizer step they belong to (with
delayed update the CPU step of step i runs while step i+1's forward and backward are timed).
Host spans use ``time.perf_counter``; device spans are two events of ``core.device.device`` on a
stream, resolved only when the records are read, so profiling adds no synchronization to the step.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero_offload.core.device.device import Event


FIELDS = ("fwd_bwd", "grad_wait", "cpu_step", "device_step", "weight_copy", "stall")
# Drawn but not summed: grad_transfer (per-bucket copies); with FSDP2's host weights
# "unit_update:<u>" (unit u's host update, u in forward order) and "unit_wait:<u>" (its forward
# waiting for it).
SPANS = (*FIELDS, "grad_transfer", "unit_update", "unit_wait")


@dataclass
class StepProfile:
    """Seconds per activity in one optimizer step.

    ``fwd_bwd``: first forward to the end of the last backward (host time); ``grad_wait``: waiting
    for gradient transfers in ``step()``; ``cpu_step``: the CPU optimizer kernel; ``device_step``:
    the device part of partial offload (``offload_fraction`` < 1; host time of the caller's
    thread, which on CUDA is the launch and waits on the gradients); ``weight_copy``:
    copying updated weights to the device; ``stall``: time the main thread (so the device's queue)
    waited on the CPU step, the part of it not hidden. ``spans``: (name, start, end), seconds
    since the recorder was made, for timelines.
    """

    step: int
    fwd_bwd: float = 0.0
    grad_wait: float = 0.0
    cpu_step: float = 0.0
    device_step: float = 0.0
    weight_copy: float = 0.0
    stall: float = 0.0
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class ProfileRecorder:
    """Thread-safe span recorder keeping the last ``keep`` closed steps."""

    def __init__(self, keep: int = 100, enabled: bool = True) -> None:
        self.enabled, self.keep, self._t0 = enabled, keep, time.perf_counter()
        self._steps: OrderedDict[int, StepProfile] = OrderedDict()
        self._closed: set[int] = set()
        self._starts: dict[tuple[str, int], float] = {}
        self._device: list[tuple[int, str, float, Event, Event]] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add(self, name: str, step: int, start: float, end: float) -> None:
        """Record a finished span (times from ``now()``) for optimizer step ``step``."""
        if name.split(":")[0] not in SPANS:
            raise ValueError(f"unknown profile span {name!r}; expected one of {SPANS}")
        if not self.enabled:
            return
        with self._lock:
            rec = self._steps.setdefault(step, StepProfile(step))
            if name in FIELDS:
                setattr(rec, name, getattr(rec, name) + (end - start))
            rec.spans.append((name, start, end))

    def begin(self, name: str, step: int) -> None:
        """Open a span that ``end`` closes from elsewhere (first forward ... last backward)."""
        self._starts.setdefault((name, step), self.now())

    def end(self, name: str, step: int) -> None:
        start = self._starts.pop((name, step), None)
        if start is not None:
            self.add(name, step, start, self.now())

    @contextmanager
    def span(self, name: str, step: int) -> Iterator[None]:
        """Time the block; it also shows in ``torch.profiler`` traces as ``zero_offload/NAME``."""
        start = self.now()
        try:
            with torch.profiler.record_function(f"zero_offload/{name}"):
                yield
        finally:
            self.add(name, step, start, self.now())

    def add_device(self, name: str, step: int, host: float, start_ev: Event,
                   end_ev: Event) -> None:
        """A span between two device events (``core.device.device.Event``), placed at host time
        ``host``; resolved when the records are read."""
        if self.enabled:
            with self._lock:
                self._steps.setdefault(step, StepProfile(step))
                self._device.append((step, name, host, start_ev, end_ev))

    def close(self, step: int) -> None:
        """Mark ``step`` complete (its update landed); drop the oldest beyond ``keep``."""
        with self._lock:
            self._closed.add(step)
            while len(self._closed) > self.keep:
                old = next(s for s in self._steps if s in self._closed)
                self._closed.discard(old)
                del self._steps[old]

    @property
    def records(self) -> list[StepProfile]:
        """Closed steps, oldest first; waits for their device spans (call off the hot path)."""
        return self._resolve(wait=True)

    def finished(self) -> list[StepProfile]:
        """Closed steps whose device spans have all completed, oldest first, without waiting:
        cheap enough for every step (a step whose copies are still running shows up later)."""
        return self._resolve(wait=False)

    def _resolve(self, wait: bool) -> list[StepProfile]:
        with self._lock:
            pending, self._device = self._device, []
            closed = set(self._closed)  # a step's device spans are all added before it closes
        kept = []
        for item in pending:
            step, name, host, start_ev, end_ev = item
            if step in closed and (wait or end_ev.query()):
                end_ev.wait()
                self.add(name, step, host, host + end_ev.seconds_since(start_ev))
            elif step in self._steps:  # still open or running: resolve on a later read
                kept.append(item)
        open_steps = {item[0] for item in kept}
        with self._lock:
            self._device.extend(kept)
            return [r for s, r in self._steps.items() if s in closed and s not in open_steps]

    def dump(self, path: str) -> None:
        """Write the closed records as JSON (``benchmarks/timeline.py`` draws it)."""
        with open(path, "w") as f:
            json.dump({"records": [r.to_dict() for r in self.records]}, f)


class PassTimer:
    """A step's ``fwd_bwd`` span: the first forward (with grad) to the end of the last backward.
    Every submodule that holds parameters reports its forward, so the span is measured however
    the model is called (``self.backbone(x)`` in a ``training_step`` as well as ``model(x)``)."""

    def __init__(self, recorder: ProfileRecorder) -> None:
        self.recorder = recorder
        self.start: float | None = None
        self.end: float | None = None

    def forward_started(self) -> None:
        if self.start is None and torch.is_grad_enabled():
            self.start = self.recorder.now()

    def backward_ended(self) -> None:
        self.end = self.recorder.now()

    def close(self, step: int) -> None:
        if self.start is not None and self.end is not None:
            self.recorder.add("fwd_bwd", step, self.start, self.end)
        self.start = self.end = None


def summarize(records: list[StepProfile]) -> dict[str, float]:
    """Mean seconds per field over ``records`` (empty when there are none)."""
    n = max(len(records), 1)
    return {k: sum(getattr(r, k) for r in records) / n for k in FIELDS} if records else {}
