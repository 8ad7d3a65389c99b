"""This rank's optimizer shard as whole groups, wherever each bucket's state lives.

Under partial offload (``core.placement``) the host keeps a prefix of every group's arrays and
the device-resident buckets (``HostBuffers.resident``) the rest; checkpoints, loads and teardown
see the whole group as before, so what they write does not depend on the placement. The host's
own tensors are returned where nothing lives on the device (no copy); otherwise a host copy.
A shard with a device part and compact host moments is saved with fp32 moments (the device's
are fp32: quantizing them into the file would change the run), which loads into any engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_zero_offload.core.host import HostBuffers
from lightning_zero_offload.core.placement import where
from lightning_zero_offload.core.stage import DeviceStage
from lightning_zero_offload.ops.moments import Moments


def _resident(host: HostBuffers, g: int) -> list[DeviceStage]:
    """The device-resident stages of group ``g``, in host-offset order."""
    return [s for s in host.resident if host.layout.buckets[s.b].group == g]


def saved_moment_dtype(host: HostBuffers) -> str:
    """The moment format of this rank's shard as saved."""
    return "fp32" if host.resident else host.moment_dtype


def bucket_master(host: HostBuffers, b: int) -> Tensor:
    """Bucket ``b``'s shard of the fp32 master, where it lives (host view or device tensor)."""
    stage = where(host.layout, host.resident, b)
    return stage.master if stage is not None else host.state(b)[0]


def bucket_fp32(host: HostBuffers, b: int, kind: str) -> Tensor:
    """Bucket ``b``'s shard of ``kind`` (``"master"`` or a moment's name) in fp32 on the host:
    the host's own array where it is fp32 there, else converted (this bucket alone)."""
    stage = where(host.layout, host.resident, b)
    if stage is not None:
        return stage.part(kind).cpu()
    master, mom = host.state(b)
    if kind == "master":
        return master
    if mom.moment_dtype == "fp32":
        return getattr(mom, kind)
    return mom.to_fp32()[mom.names.index(kind)]


def own_fp32_moments(host: HostBuffers, b: int) -> tuple[Tensor, ...] | None:
    """Bucket ``b``'s shard of the rule's state as the engine's own fp32 tensors (host fp32 arrays,
    or the device part's on the CPU compute device), to write in place; else None."""
    stage = where(host.layout, host.resident, b)
    if stage is not None:
        return tuple(stage.state) if stage.master.device.type == "cpu" else None
    mom = host.state(b)[1]
    return tuple(mom.arrays.values()) if mom.moment_dtype == "fp32" else None


def group_master(host: HostBuffers, g: int) -> Tensor:
    """Group ``g``'s whole fp32 master shard on the host."""
    stages = _resident(host, g)
    if not stages:
        return host.master[g]
    return torch.cat([host.master[g], *(s.master.cpu() for s in stages)])


def group_pieces(host: HostBuffers, g: int, kind: str) -> Iterator[Tensor]:
    """Group ``g``'s whole shard of ``kind`` (``"master"`` or a moment's name) as saved with a
    device part (fp32), in pieces made one at a time: the host prefix (converted bucket by
    bucket where its moments are compact), then each device-resident bucket's, on the host."""
    if kind == "master" or host.moment_dtype == "fp32":
        yield host.master[g] if kind == "master" else getattr(host.moments[g], kind)
    else:
        for b, bucket in enumerate(host.layout.buckets[: len(host.layout.buckets)
                                                       - len(host.resident)]):
            if bucket.group == g:
                yield bucket_fp32(host, b, kind)
    for stage in _resident(host, g):
        yield stage.part(kind).cpu()


def group_moments(host: HostBuffers, g: int) -> Moments:
    """Group ``g``'s whole moments in :func:`saved_moment_dtype`."""
    mine, stages = host.moments[g], _resident(host, g)
    if saved_moment_dtype(host) == host.moment_dtype and not stages:
        return mine
    own = mine.to_fp32() if mine.numel else tuple(torch.zeros(0) for _ in mine.names)
    whole = (torch.cat([x, *(s.state[i].cpu() for s in stages)]) for i, x in enumerate(own))
    return Moments("fp32", *whole, names=mine.names)


@torch.no_grad()
def load_group(host: HostBuffers, g: int, master: Tensor, moments: Moments) -> None:
    """Group ``g``'s whole shard (as :func:`group_master`/:func:`group_moments` give it, in any
    moment format) into the host prefix and the device-resident buckets."""
    n, md = host.master[g].numel(), host.moment_dtype
    host.master[g].copy_(master[:n])
    if moments.moment_dtype == md:
        host.moments[g].copy_(moments.chunk(0, n))
    else:  # same layout, other format: convert bucket shard by bucket shard
        for b, bucket in enumerate(host.layout.buckets):
            if bucket.group == g and bucket.host_offset < n:
                a, k = bucket.host_offset, bucket.shard
                write_moments(host, b, moments.chunk(a, k).to_fp32())
    for stage in _resident(host, g):
        a, k = host.layout.buckets[stage.b].host_offset, host.layout.buckets[stage.b].shard
        stage.master.copy_(master[a : a + k])
        write_moments(host, stage.b, moments.chunk(a, k).to_fp32())


@torch.no_grad()
def write_moments(host: HostBuffers, b: int, state32: tuple[Tensor, ...]) -> None:
    """Bucket ``b``'s shard of the rule's state from fp32 arrays in its order (int8 host
    moments: rounded to nearest; the stochastic rounding is the kernel's, per step)."""
    stage = where(host.layout, host.resident, b)
    if stage is not None:
        for t, value in zip(stage.state, state32, strict=True):
            t.copy_(value)
        return
    bucket = host.layout.buckets[b]
    host.moments[bucket.group].chunk(bucket.host_offset, bucket.shard).copy_(
        host.rule.from_fp32(state32, host.moment_dtype))
