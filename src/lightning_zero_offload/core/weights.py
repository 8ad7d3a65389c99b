"""The device weights: flat buffers the parameters view, the copies that fill them, the swap.

Each optimizer group has one flat device buffer in the compute dtype and every trained parameter
is a view of it, so one host-to-device copy per bucket shard and one all-gather per bucket
replace per-parameter transfers. Frozen parameters and buffers are cast to the compute dtype in
place; the exact values of frozen parameters stay on the host (checkpoints and teardown never
round them). With delayed update a spare set of buffers receives step i's weights while step
i+1 runs on the live set; :meth:`DeviceWeights.swap` exchanges them.

A push (the copies of one step, or of a load) follows the rules of ``core.device``: the copy
stream waits for the compute stream first (backward read the buffers being overwritten), the
compute stream waits for the copy stream afterwards (the next forward reads them), and the host
rewrites a copy's source only after waiting for the end of the previous push.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_zero_offload.core import collectives
from lightning_zero_offload.core.device import Event, SyncDevice
from lightning_zero_offload.core.layout import Layout
from lightning_zero_offload.core.profile import ProfileRecorder


def frozen_bytes(module: nn.Module, trained: dict[int, str], dtype: torch.dtype) -> int:
    """Host bytes of the exact copies of frozen parameters the compute dtype would round."""
    return sum(p.numel() * p.element_size() for p in _frozen(module, trained, dtype))


def untrained_bytes(module: nn.Module, trained: dict[int, str], dtype: torch.dtype) -> int:
    """Bytes of the module's other tensors once floats are cast to the compute dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (elem if t.is_floating_point() else t.element_size())
               for t in [*module.parameters(), *module.buffers()] if id(t) not in trained)


def _frozen(module: nn.Module, trained: dict[int, str], dtype: torch.dtype) -> list[Tensor]:
    return [p for p in module.parameters() if id(p) not in trained
            and p.is_floating_point() and p.dtype != dtype]


class DeviceWeights:
    def __init__(self, layout: Layout, module: nn.Module, dtype: torch.dtype, dev: SyncDevice,
                 rank: int, trained: dict[int, str], delayed: bool,
                 profile: ProfileRecorder) -> None:
        self.layout, self.module, self.dev, self.rank = layout, module, dev, rank
        self.dtype, self.profile = dtype, profile
        self.world_size = layout.world_size
        device = dev.device
        self.frozen = {id(p): p.detach().to("cpu", copy=True)
                       for p in _frozen(module, trained, dtype)}
        self.orig_dtypes = {id(t): t.dtype for t in [*module.parameters(), *module.buffers()]}
        self.trained = trained
        self.live = [torch.zeros(k, dtype=dtype, device=device) for k in layout.group_numel]
        with torch.no_grad():
            for slot in layout.slots:
                view = self.live[slot.group][slot.offset : slot.offset + slot.numel]
                view.copy_(slot.param.detach().reshape(-1))
            self._bind()
            module.to(device=device, dtype=dtype)
        self.spare = [w.clone() for w in self.live] if delayed else None
        self._stream = dev.side_stream("h2d") if dev.asynchronous else None
        self._last: Event | None = None  # end of the last push: its copies have read the host
        self._begin: tuple[float, Event] | None = None

    @property
    def nbytes(self) -> int:
        bufs = [*self.live, *(self.spare or [])]
        return sum(t.numel() * t.element_size() for t in bufs)

    def _bind(self) -> None:
        for slot in self.layout.slots:
            flat = self.live[slot.group]
            slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self._ptrs = [s.param.data_ptr() for s in self.layout.slots]

    def check_views(self) -> None:
        """Every trained parameter still views the flat buffer (``.to()``/``.half()`` after setup
        would have replaced it)."""
        for slot, ptr in zip(self.layout.slots, self._ptrs, strict=True):
            if slot.param.data_ptr() != ptr:
                raise RuntimeError(
                    f"ZeroOffload: parameter {slot.name!r} no longer lives in the engine's flat "
                    "buffer (was the module moved or cast with .to()/.float()/.half() after "
                    "setup?); the engine owns device placement and dtype"
                )

    # -- a push -------------------------------------------------------------------------------
    def begin_push(self) -> None:
        """On the main thread, before the first copy of a push: the copies go after everything
        the compute stream has queued (the backward that read these buffers)."""
        if self._stream is not None:
            self.dev.stream_waits_compute(self._stream)

    def copy_shard(self, b: int, src: Tensor, target: list[Tensor]) -> None:
        """Queue the copy of this rank's shard of bucket ``b`` from host ``src``."""
        bucket = self.layout.buckets[b]
        lo, hi = bucket.shard_range(self.rank)
        dst = target[bucket.group][lo:hi]
        if self._stream is None:
            with torch.no_grad():
                dst.copy_(src)
            return
        if self._begin is None:
            self._begin = (self.profile.now(), self.dev.record(self._stream))
        self.dev.run(self._stream, lambda: dst.copy_(src, non_blocking=True))

    def gather(self, b: int, target: list[Tensor]) -> None:
        """Queue the all-gather of bucket ``b`` (collective: every rank, the same order)."""
        bucket = self.layout.buckets[b]
        lo, hi = bucket.shard_range(self.rank)
        flat = target[bucket.group]
        full, mine = flat[bucket.start : bucket.start + bucket.numel], flat[lo:hi]
        self.dev.collective(self._stream,
                            lambda group: collectives.all_gather(full, mine, group))

    def end_copies(self, step: int | None) -> None:
        """After the last copy of a push (on the thread that queued them): the end the host
        waits for before rewriting the sources, and the push's ``weight_copy`` span."""
        begin, self._begin = self._begin, None
        if self._stream is None:
            return
        end = self._last = self.dev.record(self._stream)
        if step is not None and begin is not None:
            self.profile.add_device("weight_copy", step, begin[0], begin[1], end)

    def end_push(self) -> None:
        """On the main thread, after the last copy or gather: the next forward waits for them."""
        if self._stream is not None:
            self.dev.compute_waits(self._stream)

    def wait_copies_read(self) -> None:
        """The host may rewrite the copies' sources (staging, master) once this returns."""
        last, self._last = self._last, None
        if last is not None:
            last.wait()

    def push(self, sources: list[Tensor], gather: Callable[[list[Tensor]], None]) -> None:
        """A whole push into the live weights from per-bucket host ``sources`` (after a load);
        ``gather`` all-gathers them (collective with several ranks)."""
        self.wait_copies_read()
        self.begin_push()
        for b, src in enumerate(sources):
            self.copy_shard(b, src, self.live)
        self.end_copies(None)
        gather(self.live)
        self.end_push()

    def abandon_push(self) -> None:
        """After a failure between ``copy_shard`` and ``end_copies``: nothing stays half-open."""
        self._begin = None

    # -- delayed update -----------------------------------------------------------------------
    def swap(self) -> None:
        """The spare buffers (step i's weights) become the module's weights."""
        assert self.spare is not None
        self.live, self.spare = self.spare, self.live
        with torch.no_grad():
            self._bind()

    # -- teardown -----------------------------------------------------------------------------
    def restore(self, full_master: list[Tensor], device: torch.device | None = None) -> None:
        """Ordinary parameters holding the fp32 master weights, other tensors in their original
        dtypes, frozen parameters exact; on ``device`` (default: the compute device)."""
        device = device or self.dev.device
        with torch.no_grad():
            for slot in self.layout.slots:
                flat = full_master[slot.group][slot.offset : slot.offset + slot.numel]
                slot.param.data = flat.view(slot.shape).to(
                    device, self.orig_dtypes[id(slot.param)], copy=True)
            for t in [*self.module.parameters(), *self.module.buffers()]:
                if id(t) in self.frozen:
                    t.data = self.frozen[id(t)].to(device)
                elif id(t) not in self.trained and id(t) in self.orig_dtypes:
                    t.data = t.data.to(device, self.orig_dtypes[id(t)])

    def free(self) -> None:
        self.live, self.spare = [], None

