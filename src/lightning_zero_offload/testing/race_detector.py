"""The emulated device's race detector: checks rule 3 of ``core.device.device`` (and re-checks 1, 2,
4).

The emulation runs the compute stream as the main thread, so a side stream that forgets to wait
for it still sees finished data. This module checks the order the engine *declared* instead, as
CUDA would enforce it: every agent (the compute stream, each side stream, the host) has a vector
clock of what it waited for; every registered buffer region remembers its last write and the last
read per agent (agent, position in its queue, its clock then). A
:class:`~torch.utils._python_dispatch.TorchDispatchMode` records the accesses (read: tensor inputs,
write: arguments the op schema marks ``is_write``), as ``torch.cuda._sanitizer`` does; an access
not ordered after the last conflicting one of another agent raises :class:`StreamOrderError`.
Only registered regions are checked: device buffers handed out by ``empty()``, the weights, and
what the side streams touch (staging slices, 0-d statistics), so the rest costs a dict miss.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode
from torch.utils._pytree import tree_leaves

from lightning_zero_offload.core.dist.tensor_parallel import local

COMPUTE, HOST = "compute", "host"
Clock = dict[str, int]

RULES = {  # (who accessed second, kind) -> the rule of core.device.device it breaks
    1: "rule 1 (a host access to a buffer a side stream uses follows Event.wait)",
    2: "rule 2 (compute work after a side stream's work it depends on follows compute_waits)",
    3: "rule 3 (a side stream reading what the compute stream wrote or still reads follows "
       "stream_waits_compute)",
    4: "rule 4 (a device buffer a side stream used is released with release() on that stream "
       "before it is reused)",
    5: "a side stream's work after another side stream's follows stream_waits (the copy after "
       "the reduce-scatter)",
    6: "rule 6 (a copy into a staging slice follows the weights' copy out of it: stream_waits "
       "of kind 'staging_reuse')",
}


class StreamOrderError(RuntimeError):
    """Two accesses to one buffer on different streams that no wait orders (a race on a GPU)."""


def join(a: Clock, b: Clock) -> Clock:
    """The element-wise maximum of two vector clocks (a new dict when it differs from ``a``)."""
    out = a
    for k, v in b.items():
        if a.get(k, 0) < v:
            if out is a:
                out = dict(a)
            out[k] = v
    return out


class _Access:
    __slots__ = ("agent", "clock", "pos")

    def __init__(self, agent: str, pos: int, clock: Clock) -> None:
        self.agent, self.pos, self.clock = agent, pos, clock

    def before(self, agent: str, pos: int, clock: Clock) -> bool:
        """Whether this access and (agent, pos, clock) are ordered (either way round)."""
        return (self.agent == agent or clock.get(self.agent, 0) >= self.pos
                or self.clock.get(agent, 0) >= pos)


class _Region:
    __slots__ = ("cell_reads", "end", "host", "reused", "role", "start", "write")

    def __init__(self, start: int, end: int, role: str, host: bool) -> None:
        self.start, self.end, self.role, self.host = start, end, role, host
        self.write: _Access | None = None
        self.cell_reads: dict[str, _Access] = {}
        self.reused = False  # handed out again without a release() at a stream's point


class RaceDetector:
    """Clocks and last accesses of one emulated device; thread-safe (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.regions: dict[int, list[_Region]] = {}  # storage data_ptr -> registered regions
        self.pos: dict[str, int] = {COMPUTE: 0, HOST: 0}
        self.clock: dict[str, Clock] = {COMPUTE: {}, HOST: {}}  # waited for (own entry apart)
        self.main = threading.get_ident()
        self.error: StreamOrderError | None = None  # the first race seen, on any thread

    # -- registration ---------------------------------------------------------------------------
    def track(self, t: Tensor, role: str, host: bool = False, fresh: bool = False) -> None:
        """Check accesses to ``t``'s bytes from now on, as ``role`` (``host``: a host buffer).
        ``fresh``: a new allocation; an overlapping region not released first is marked reused."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        with self.lock:
            regions = self.regions.get(ptr)
            if regions is None:
                regions = self.regions[ptr] = []
                weakref.finalize(storage, self._forget, ptr)
            old = [r for r in regions if r.start < end and start < r.end]
            for r in old:
                r.reused = r.reused or fresh
            if not old:
                regions.append(_Region(start, end, role, host))

    def _forget(self, ptr: int) -> None:
        with self.lock:
            self.regions.pop(ptr, None)

    def released(self, t: Tensor) -> None:
        """``t`` went back to the allocator at its stream's point: its history ends here."""
        ptr = t.untyped_storage().data_ptr()
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        with self.lock:
            regions = self.regions.get(ptr)
            if regions:
                regions[:] = [r for r in regions if not (r.start < end and start < r.end)]

    # -- clocks ---------------------------------------------------------------------------------
    def full(self, agent: str) -> Clock:
        return {**self.clock[agent], agent: self.pos[agent]}

    def host_view(self) -> Clock:
        """What work queued by the host now is ordered after (the host's own accesses so far)."""
        with self.lock:
            return self.full(HOST)

    def compute_view(self) -> Clock:
        with self.lock:
            return self.full(COMPUTE)

    def merge(self, agents: tuple[str, ...], clock: Clock) -> None:
        with self.lock:
            for a in agents:
                self.clock[a] = join(self.clock[a], clock)

    # -- accesses -------------------------------------------------------------------------------
    def access(self, agent: str | None, pos: int, clock: Clock, t: Tensor, write: bool,
               auto: tuple[str, bool] | None = None) -> None:
        """One access to ``t``. ``agent`` None: the main thread (compute for device regions, the
        host for host ones); ``auto``: the (role, host) to register an unknown region with."""
        t = local(t)  # a DTensor's accesses are its local tensor's
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a wrapper or fake tensor)
            return
        if ptr not in self.regions and auto is None:
            return
        start = t.data_ptr()
        end = start + max(t.numel(), 1) * t.element_size()
        if auto is not None and not any(r.start < end and start < r.end
                                        for r in self.regions.get(ptr, ())):
            self.track(t, *auto)
        with self.lock:
            for r in self.regions.get(ptr, ()):
                if r.start < end and start < r.end:
                    self._check(r, agent, pos, clock, write)

    def _check(self, r: _Region, agent: str | None, pos: int, clock: Clock, write: bool) -> None:
        if agent is None:  # the main thread: its own position and clock, taken now
            agent = HOST if r.host else COMPUTE
            self.pos[agent] += 1
            pos, clock = self.pos[agent], self.clock[agent]
        prev = [r.write] if r.write is not None else []
        if write:
            prev += list(r.cell_reads.values())
        for p in prev:
            if not p.before(agent, pos, clock):
                self._race(r, p, agent, pos, write)
        if write:
            r.write, r.cell_reads = _Access(agent, pos, clock), {}
        else:
            r.cell_reads[agent] = _Access(agent, pos, clock)

    def _race(self, r: _Region, p: _Access, agent: str, pos: int, write: bool) -> None:
        was = "written" if p is r.write else "read"
        if r.reused:
            rule = 4
        elif HOST in (agent, p.agent):
            rule = 1
        elif agent == COMPUTE:
            rule = 2
        elif COMPUTE not in (agent, p.agent):  # two side streams
            rule = 6 if r.host else 5
        else:
            rule = 3
        err = StreamOrderError(
            f"{'write' if write else 'read'} of the {r.role} on the {agent} stream (at its item "
            f"{pos}) is not ordered after its {was} on the {p.agent} stream (item {p.pos}): no "
            f"wait between them, so on a GPU they race. Broken: {RULES[rule]}"
            + {2: f", or {RULES[3]} if the compute stream's access was meant to come first",
               3: f", or {RULES[2]} if the compute stream's access was meant to come second",
               5: f", or {RULES[3]} if both were to follow the compute stream",
               6: f", or {RULES[1]} if a host access between them was to order them",
               }.get(rule, "") + ".")
        if self.error is None:
            self.error = err
        raise err

    def raise_pending(self) -> None:
        """Re-raise, on the calling thread, a race first seen on another thread."""
        if self.error is not None:
            raise StreamOrderError(str(self.error)) from self.error


def _schema_writes(func: Any) -> list[tuple[int, str, bool]]:
    """(position, name, is_write) of the arguments whose data the op touches: an argument that
    the output only aliases (views: ``slice``, ``view``, ``detach``) is not an access."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        info = a.alias_info
        if info is None or info.is_write:
            out.append((i, a.name, info is not None))
    return out


_SCHEMAS: dict[Any, list[tuple[int, str, bool]]] = {}
IGNORE = ()  # the item context of the emulation's own work (poisoning): not recorded
_local = threading.local()  # .ctx on a side stream's thread: (detector, stream, pos, clock, auto)


def set_item(ctx: tuple | None) -> None:
    """On a side stream's thread: the work item whose accesses run now (None: none)."""
    _local.ctx = ctx


class RecordAccesses(TorchDispatchMode):
    """Feeds every op's tensor arguments to the live detectors (main thread: all of them; a side
    stream's or host task's thread: the one whose item or task is running)."""

    def __init__(self, detectors: weakref.WeakSet) -> None:
        super().__init__()
        self.detectors = detectors

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ctx = getattr(_local, "ctx", None)
        if ctx is not IGNORE and (ctx is not None or self.detectors):
            schema = _SCHEMAS.get(func)
            if schema is None:
                schema = _SCHEMAS[func] = _schema_writes(func)
            for i, name, write in schema:
                value = args[i] if i < len(args) else kwargs.get(name)
                for t in tree_leaves(value) if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, Tensor):
                        if ctx is not None:
                            det, agent, pos, clock, auto = ctx
                            det.access(agent, pos, clock, t, write, auto(t, write))
                        else:
                            for det in list(self.detectors):
                                det.access(None, 0, {}, t, write)
        return func(*args, **kwargs)



_detectors: weakref.WeakSet = weakref.WeakSet()  # the live detectors the main thread feeds


def install_mode() -> None:
    """Record the calling thread's ops from now on (once per thread, until :func:`unwatch` finds
    no live detector left): the engine may be used after the ``emulated_async_device`` block."""
    if getattr(_local, "mode", None) is None:
        mode = RecordAccesses(_detectors)
        mode.__enter__()
        _local.mode = mode


def uninstall_mode() -> None:
    """Take the calling thread's recording off before the thread ends: torch's thread-local
    mode stack must hold no Python object when the thread's C++ destructors run, which may be
    during the interpreter's exit (the process would abort)."""
    mode = getattr(_local, "mode", None)
    if mode is not None and _current_mode() is mode:
        mode.__exit__(None, None, None)
    _local.mode = None


def recorded(fn: Callable[[], Any]) -> Any:
    """``fn()`` with this thread's ops recorded, the mode on only while it runs (a pool's
    thread ends when the pool says, with nothing left to clean)."""
    with RecordAccesses(_detectors):
        return fn()


def watch(detector: RaceDetector) -> None:
    """Feed ``detector`` the calling thread's ops (the compute stream's and the host's)."""
    _detectors.add(detector)
    install_mode()


def unwatch(detector: RaceDetector) -> None:
    """``detector``'s device closed; the last one off takes this thread's recording off too
    when it is the innermost mode (else it stays, a no-op)."""
    _detectors.discard(detector)
    mode = getattr(_local, "mode", None)
    if not _detectors and mode is not None and _current_mode() is mode:
        mode.__exit__(None, None, None)
        _local.mode = None
