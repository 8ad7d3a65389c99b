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
from lightning_zero_offload.core.stage import DeviceStage
from lightning_zero_offload.ops.moments import Moments


def _resident(host: HostBuffers, g: int) -> list[DeviceStage]:
    """The device-resident stages of group ``g``, in host-offset order."""
    return [s for s in host.resident if host.layout.buckets[s.b].group == g]


def saved_moment_dtype(host: HostBuffers) -> str:
    """The moment format of this rank's shard as saved."""
    return "fp32" if host.resident else host.moment_dtype


def group_master(host: HostBuffers, g: int) -> Tensor:
    """Group ``g``'s whole fp32 master shard on the host."""
    stages = _resident(host, g)
    if not stages:
        return host.master[g]
    return torch.cat([host.master[g], *(s.export("master") for s in stages)])


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
                yield host.shard(b).export(kind)
    for stage in _resident(host, g):
        yield stage.export(kind)


def group_moments(host: HostBuffers, g: int) -> Moments:
    """Group ``g``'s whole moments in :func:`saved_moment_dtype`."""
    mine, stages = host.moments[g], _resident(host, g)
    if saved_moment_dtype(host) == host.moment_dtype and not stages:
        return mine
    own = mine.to_fp32() if mine.numel else tuple(torch.zeros(0) for _ in mine.names)
    whole = (torch.cat([x, *(s.export(name) for s in stages)])
             for name, x in zip(mine.names, own, strict=True))
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
                host.shard(b).load(state32=moments.chunk(a, k).to_fp32())
    for stage in _resident(host, g):
        a, k = host.layout.buckets[stage.b].host_offset, host.layout.buckets[stage.b].shard
        stage.load(master[a : a + k], moments.chunk(a, k).to_fp32())
