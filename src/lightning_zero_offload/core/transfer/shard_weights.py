"""The device weights of a ``fully_shard`` model: FSDP2's own local shards, written in place.

FSDP2 owns the storage of each rank's local shards (its next all-gather reads them), so the
engine cannot make the parameters view a flat buffer of its own (``core.transfer.weights``).
Instead each optimizer group's flat range is a ``core.buckets.pieces.Pieces``: the shards of its
parameters at their layout offsets. A push copies a bucket's shard into the pieces it covers;
the device update writes them the same way. The shards are cast to the run's half precision
once, through ``module.to`` (FSDP2 re-pads them before the first forward), so the device holds
2 bytes per local parameter and nothing in fp32. Under delayed update the spare set is a flat
buffer of the engine's, copied into the shards when it lands. With ``CPUOffloadPolicy`` the
shards are the host master instead (:class:`HostShardWeights`).

Before new weights are written, every unit is resharded (``FSDPModule.reshard()``): a forward
without backward since the last step (an evaluation between ``backward`` and ``step``) leaves the
root unit's all-gathered weights in place (FSDP2 keeps the root unsharded after forward), and
the next forward would run on them, one step stale. Plain FSDP2 with a torch optimizer does
exactly that; here the next forward gathers the new shards.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_zero_offload.core.buckets.layout import Layout, frozen_params
from lightning_zero_offload.core.buckets.pieces import Pieces
from lightning_zero_offload.core.device.device import SyncDevice
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.dist.fsdp import units
from lightning_zero_offload.core.dist.tensor_parallel import local
from lightning_zero_offload.core.transfer.weights import DeviceWeights, WeightPush


class ShardWeights(DeviceWeights):
    """:class:`DeviceWeights` over FSDP2's local shards (no flat live buffer, no rebinding)."""

    flat = False  # the kernel cannot write a slice of the live weights directly
    cast = True  # the shards take the run's half precision

    def __init__(self, layout: Layout, module: nn.Module, dtype: torch.dtype, dev: SyncDevice,
                 rank: int, trained: dict[int, str], delayed: bool,
                 profile: ProfileRecorder) -> None:
        self.layout, self.module, self.dev, self.rank = layout, module, dev, rank
        self.dtype, self.profile, self.trained = dtype, profile, trained
        self.world_size, self.units = layout.world_size, units(module)
        self.frozen = {id(p): local(p).detach().to("cpu", copy=True)
                       for p in frozen_params(module, trained, dtype)}
        self.orig_dtypes = {id(t): t.dtype for t in [*module.parameters(), *module.buffers()]}
        if self.cast:
            with torch.no_grad():
                module.to(dtype=dtype)  # FSDP2 casts (and re-pads) the shards themselves
        self._bind()
        self.spare = ([dev.zeros(k, dtype, "spare device weights") for k in layout.group_numel]
                      if delayed else None)
        if self.spare is not None:
            for flat, pieces in zip(self.spare, self.live, strict=True):
                for at, view in pieces.pieces:
                    flat[at : at + view.numel()].copy_(view)
        self._stream = dev.side_stream("h2d") if dev.asynchronous else None
        for _, view in [p for pieces in self.live for p in pieces.pieces]:
            dev.track(view, "device weights")
        for w in self.spare or []:
            dev.track(w, "spare device weights")
        self._last = None

    @property
    def nbytes(self) -> int:
        shards = sum(v.numel() * v.element_size() for g in self.live for _, v in g.pieces)
        return shards + sum(t.numel() * t.element_size() for t in self.spare or [])

    def _bind(self) -> None:
        per_group: list[list[tuple[int, Tensor]]] = [[] for _ in self.layout.group_numel]
        for s in self.layout.slots:
            per_group[s.group].append((s.offset, s.param.to_local().view(-1)))  # type: ignore
        self.live = [Pieces(n, p) for n, p in zip(self.layout.group_numel, per_group,
                                                   strict=True)]
        self._ptrs = [s.param.to_local().data_ptr() for s in self.layout.slots]  # type: ignore

    def check_views(self) -> None:
        """FSDP2 still keeps each shard where the engine writes it (``module.to()`` after setup
        would have re-made them)."""
        for slot, ptr in zip(self.layout.slots, self._ptrs, strict=True):
            if slot.param.to_local().data_ptr() != ptr:  # type: ignore[attr-defined]
                raise RuntimeError(
                    f"ZeroOffload: the fully_shard shard of {slot.name!r} was replaced (was the "
                    "module moved or cast with .to()/.float()/.half() after setup?); the engine "
                    "owns the shards' dtype")

    def push(self, step: int | None, target: list[Tensor]) -> WeightPush:
        if target is self.live:
            self.reshard()
        return super().push(step, target)

    def publish(self, buckets: list[int]) -> None:
        self.reshard()  # the device part has just written the live shards
        super().publish(buckets)

    def reshard(self) -> None:
        """No unit keeps gathered weights the shards' new values would not reach."""
        for unit in self.units:
            unit.reshard()  # type: ignore[operator]

    def swap(self) -> None:
        """Step i's weights (the spare buffers) into the shards, on the compute stream."""
        assert self.spare is not None
        self.reshard()
        self.dev.compute_point()  # the copy reads what the push wrote: after its wait (land)
        for flat, pieces in zip(self.spare, self.live, strict=True):
            pieces[0 : pieces.numel].copy_(flat)

    def restore(self, full_master: list[Tensor], device: torch.device | str | None = None) -> None:
        """The shards back in their original dtypes, holding the fp32 master weights; frozen
        parameters exact. They stay where FSDP2 keeps them (``device`` is not used)."""
        with torch.no_grad():
            self.module.to(dtype=next(iter(self.orig_dtypes.values())))
            for slot in self.layout.slots:
                flat = full_master[slot.group][slot.offset : slot.offset + slot.numel]
                slot.param.to_local().copy_(flat.view(slot.shape))  # type: ignore[attr-defined]
            for t in self.module.parameters():
                if id(t) in self.frozen:
                    local(t).copy_(self.frozen[id(t)])

    def free(self) -> None:
        for w in self.spare or []:
            self.dev.free(w)
        self.live, self.spare = [], None


class HostShardWeights(ShardWeights):
    """FSDP2's host shards under ``CPUOffloadPolicy``: they are the fp32 master the host step
    updates in place (``core.step.overlap``), and FSDP2 copies each unit up to the device when
    it gathers it, in the compute dtype of its ``MixedPrecisionPolicy``. The engine keeps no
    weights of its own: nothing is cast, pushed or restored."""

    cast = False

    @property
    def nbytes(self) -> int:
        return 0  # FSDP2's host shards, counted as the master's

    def push_all(self, sources: list) -> None:
        """After a load: the shards hold it already; no unit keeps older gathered weights."""
        self.reshard()

    def restore(self, full_master: list[Tensor], device: torch.device | str | None = None) -> None:
        """The shards hold the master already; frozen parameters were never rounded."""
