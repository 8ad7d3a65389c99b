"""The device weights: flat buffers the parameters view, the copies that fill them, the swap.

Each optimizer group has one flat device buffer in the compute dtype and every trained parameter
is a view of it, so one host-to-device copy per bucket shard and one all-gather per bucket
replace per-parameter transfers. Frozen parameters and buffers are cast to the compute dtype in
place; the exact values of frozen parameters stay on the host (checkpoints and teardown never
round them). With delayed update a spare set of buffers receives step i's weights while step
i+1 runs on the live set; :meth:`DeviceWeights.swap` exchanges them.

A push (the copies of one step, or of a load) is one :class:`WeightPush`, which follows the
rules of ``core.device.device``: the copy stream waits for the compute stream first (backward read
the buffers being overwritten), the compute stream waits for the copy stream afterwards (the next
forward reads them), and the host rewrites a copy's source only after waiting for the end of the
previous push. Its all-gathers are the engine's only weight all-gathers, always on the caller's
thread; under delayed update :meth:`DeviceWeights.land` finishes the worker's push and swaps.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_zero_offload.core.buckets.layout import Layout, frozen_params
from lightning_zero_offload.core.device.device import Event, SyncDevice
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.dist import collectives
from lightning_zero_offload.core.dist.tensor_parallel import bind, bind_all, data_ptrs, local


def _host_copy(t: Tensor) -> Tensor:
    """A module buffer or untrained tensor for the full state: on the host, floats in fp32."""
    t = t.detach().cpu()
    return t.float() if t.is_floating_point() else t.clone()


class DeviceWeights:
    flat = True  # the live weights are flat tensors (a kernel may write a slice of them)

    def __init__(self, layout: Layout, module: nn.Module, dtype: torch.dtype, dev: SyncDevice,
                 rank: int, trained: dict[int, str], delayed: bool,
                 profile: ProfileRecorder) -> None:
        self.layout, self.module, self.dev, self.rank = layout, module, dev, rank
        self.dtype, self.profile = dtype, profile
        self.world_size = layout.world_size
        device = dev.device
        self.frozen = {id(p): local(p).detach().to("cpu", copy=True)
                       for p in frozen_params(module, trained, dtype)}
        self.orig_dtypes = {id(t): t.dtype for t in [*module.parameters(), *module.buffers()]}
        self.trained = trained
        self.live = [dev.zeros(k, dtype, "device weights") for k in layout.group_numel]
        with torch.no_grad():
            for slot in layout.slots:  # each parameter's own storage goes once it is copied
                view = self.live[slot.group][slot.offset : slot.offset + slot.numel]
                view.copy_(local(slot.param).detach().reshape(-1))
                bind(slot.param, view.view(slot.shape))  # a DTensor stays one
            self._bind()
            module.to(device=device, dtype=dtype)
        self.spare = ([dev.zeros(k, dtype, "spare device weights").copy_(w)
                       for k, w in zip(layout.group_numel, self.live, strict=True)]
                      if delayed else None)
        self._stream = dev.side_stream("h2d") if dev.asynchronous else None
        for w in [*self.live, *(self.spare or [])]:
            dev.track(w, "device weights")  # for the emulated device's race detector
        self._last: Event | None = None  # end of the last push: its copies have read the host

    @property
    def nbytes(self) -> int:
        bufs = [*self.live, *(self.spare or [])]
        return sum(t.numel() * t.element_size() for t in bufs)

    def _bind(self) -> None:
        slots = self.layout.slots
        bind_all([(s.param, self.live[s.group][s.offset : s.offset + s.numel].view(s.shape))
                  for s in slots])
        self._ptrs = data_ptrs([s.param for s in slots])

    def check_views(self) -> None:
        """Every trained parameter still views the flat buffer (``.to()``/``.half()`` after setup
        would have replaced it)."""
        now = data_ptrs([s.param for s in self.layout.slots])
        for slot, ptr, at in zip(self.layout.slots, self._ptrs, now, strict=True):
            if at != ptr:
                raise RuntimeError(
                    f"ZeroOffload: parameter {slot.name!r} no longer lives in the engine's flat "
                    "buffer (was the module moved or cast with .to()/.float()/.half() after "
                    "setup?); the engine owns device placement and dtype"
                )

    # -- pushes -------------------------------------------------------------------------------
    def push(self, step: int | None, target: list[Tensor]) -> WeightPush:
        """Open a push into ``target`` (the live weights, or the spare ones under delayed update)
        for profile step ``step`` (None: a load, no span). On the main thread."""
        return WeightPush(self, step, target)

    def publish(self, buckets: list[int]) -> None:
        """The live weights' shards of ``buckets``, written on the compute stream (the device
        part of a step under delayed update), gathered from every rank before the next forward.
        Collective with several ranks."""
        if self.world_size > 1 and buckets:
            with self.push(None, self.live) as push:
                push.gather_only(buckets)

    def push_all(self, sources: list[Tensor]) -> None:
        """A whole push into the live weights from per-bucket host ``sources`` (after a load;
        collective with several ranks)."""
        with self.push(None, self.live) as push:
            push.wait_sources()
            for b, src in enumerate(sources):
                push.copy(b, src)

    # -- delayed update -----------------------------------------------------------------------
    def land(self, push: WeightPush) -> None:
        """Step i's weights, written by the worker into the spare buffers through ``push``,
        become the module's: the push is finished (all-gather, compute waits) and the buffers
        swapped. Collective with several ranks; on the caller's thread."""
        push.finish()
        self.swap()

    def swap(self) -> None:
        """The spare buffers (step i's weights) become the module's weights."""
        assert self.spare is not None
        self.live, self.spare = self.spare, self.live
        with torch.no_grad():
            self._bind()

    # -- exact copies of what the compute dtype rounds ----------------------------------------
    def untrained(self) -> dict[str, Tensor]:
        """Buffers and frozen parameters, on the host (DTensors' local shards); frozen ones
        exact."""
        frozen, trained = self.frozen, self.trained
        return {name: frozen[id(t)].clone() if id(t) in frozen else _host_copy(local(t))
                for name, t in self.module.state_dict(keep_vars=True).items()
                if id(t) not in trained}

    def remember_frozen(self, state: dict[str, Tensor]) -> None:
        """After a load into the module: keep the exact values of its frozen parameters."""
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in self.frozen and name in state:
                self.frozen[id(t)].copy_(state[name])

    # -- teardown -----------------------------------------------------------------------------
    def restore(self, full_master: list[Tensor], device: torch.device | str | None = None) -> None:
        """Ordinary parameters holding the fp32 master weights, other tensors in their original
        dtypes, frozen parameters exact; on ``device`` (default: the compute device)."""
        device = torch.device(device) if device is not None else self.dev.device
        with torch.no_grad():
            for slot in self.layout.slots:
                flat = full_master[slot.group][slot.offset : slot.offset + slot.numel]
                bind(slot.param, flat.view(slot.shape).to(
                    device, self.orig_dtypes[id(slot.param)], copy=True))
            for t in [*self.module.parameters(), *self.module.buffers()]:
                if id(t) in self.frozen:
                    bind(t, self.frozen[id(t)].to(device))
                elif id(t) not in self.trained and id(t) in self.orig_dtypes:
                    t.data = t.data.to(device, self.orig_dtypes[id(t)])

    def free(self) -> None:
        for w in [*self.live, *(self.spare or [])]:
            self.dev.free(w)
        self.live, self.spare = [], None



class WeightPush:
    """One push: the copies of new weights into ``target``, bucket shard by bucket shard, and
    their all-gather, following the rules of ``core.device.device``.

    Opened on the main thread (:meth:`DeviceWeights.push`): the copy stream waits for the compute
    stream (rule 3: backward read the buffers being overwritten). The thread that writes the
    copies' sources calls :meth:`wait_sources` first (the previous push's copies have read the
    host buffers it rewrites), queues :meth:`copy` per bucket and ends with :meth:`copies_done`
    (the end event the next push waits for, and the ``weight_copy`` span). :meth:`finish`, on
    the caller's thread, all-gathers every bucket not gathered yet (collective with several
    ranks: the delayed worker never calls it or :meth:`gather`) and makes the compute stream wait
    for the copy stream (rule 2: the next forward reads the weights). As a context manager it
    finishes on success and is abandoned on an exception (nothing stays half-open).
    """

    def __init__(self, weights: DeviceWeights, step: int | None, target: list[Tensor]) -> None:
        self.weights, self.step, self.target = weights, step, target
        self._gathered = [False] * len(weights.layout.buckets)
        self._begin: tuple[float, Event] | None = None  # host time and event of the first copy
        self._copied = self._closed = False
        if weights._stream is not None:
            weights.dev.stream_waits_compute(weights._stream)

    def __enter__(self) -> WeightPush:
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if error is None:
            self.finish()
        else:
            self.abandon()

    def wait_sources(self) -> None:
        """The host may rewrite the copies' sources (staging, master) once this returns."""
        w = self.weights
        last, w._last = w._last, None
        if last is not None:
            last.wait()

    def copy(self, b: int, src: Tensor) -> None:
        """Queue the copy of this rank's shard of bucket ``b`` from host ``src``."""
        w = self.weights
        bucket = w.layout.buckets[b]
        lo, hi = bucket.shard_range(w.rank)
        dst = self.target[bucket.group][lo:hi]
        if w._stream is None:
            with torch.no_grad():
                dst.copy_(src)
            return
        if self._begin is None:
            self._begin = (w.profile.now(), w.dev.record(w._stream))
        w.dev.run(w._stream, lambda: dst.copy_(src, non_blocking=True))

    def hand_back(self, src: Tensor) -> Event | None:
        """After the copies that read ``src`` (a staging slice): it is handed back there, on the
        copy stream (poisoned on the emulated device), and the returned event is where the next
        device-to-host copy into it waits (rule 6 of ``core.device.device``). None off a side
        stream."""
        w = self.weights
        if w._stream is None:
            return None
        w.dev.run(w._stream, lambda: w.dev.handed_back(src))
        return w.dev.record(w._stream)

    def gather(self, b: int) -> None:
        """Queue the all-gather of bucket ``b`` (collective: every rank, the same order); a
        no-op with one rank. Only on the caller's thread."""
        self._gathered[b] = True
        w = self.weights
        if w.world_size == 1:
            return
        bucket = w.layout.buckets[b]
        lo, hi = bucket.shard_range(w.rank)
        flat = self.target[bucket.group]
        full, mine = flat[bucket.start : bucket.start + bucket.numel], flat[lo:hi]
        w.dev.collective(w._stream, lambda group: collectives.all_gather(full, mine, group))

    def gather_only(self, buckets: list[int]) -> None:
        """Gather ``buckets`` (no copies); :meth:`finish` gathers nothing else."""
        for b in range(len(self._gathered)):
            if b in buckets:
                self.gather(b)
            self._gathered[b] = True

    def copies_done(self) -> None:
        """After the last copy (on the thread that queued them): the end the next push's host
        waits for, and the push's ``weight_copy`` span."""
        self._copied = True
        w, begin, self._begin = self.weights, self._begin, None
        if w._stream is None:
            return
        end = w._last = w.dev.record(w._stream)
        if self.step is not None and begin is not None:
            w.profile.add_device("weight_copy", self.step, begin[0], begin[1], end)

    def finish(self) -> None:
        """On the caller's thread: the gathers not done yet, then the next forward waits."""
        if self._closed:
            raise RuntimeError("ZeroOffload internal error: a weight push finished twice")
        if not self._copied:
            self.copies_done()
        for b, done in enumerate(self._gathered):
            if not done:
                self.gather(b)
        self._closed = True
        w = self.weights
        if w._stream is not None:
            w.dev.compute_waits(w._stream)

    def abandon(self) -> None:
        """After a failure: the push is dropped (its span too); it can no longer finish."""
        self._begin, self._closed = None, True
        w = self.weights
        if w._stream is not None:  # copies already queued still write the target: wait for them
            w.dev.compute_waits(w._stream)
