"""This rank's optimizer shard as whole groups, wherever each bucket's state lives.

Under partial offload some buckets' state lives on the device (``core.buckets.buckets``);
checkpoints, loads and teardown see the whole group as before, so what they write does not depend on
the placement. The host's own arrays are returned where no bucket of the group lives on the device
(no copy); otherwise a host copy, bucket by bucket. A shard with a device part and compact host
moments is saved with fp32 moments (the device's are fp32: quantizing them into the file would
change the run), which loads into any engine. Every write goes through a bucket's shard.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.buckets import Bucket, Buckets
from lightning_zero_offload.ops.moments import Moments


def _host_only(buckets: Buckets, g: int) -> bool:
    """Whether every bucket of group ``g`` lives on the host (its arrays are the whole group)."""
    return not any(bk.group == g for bk in buckets.device())


def _arrays(buckets: Buckets):  # noqa: ANN202 (core.buckets.host.HostBuffers)
    assert buckets.arrays is not None
    return buckets.arrays


def saved_moment_dtype(buckets: Buckets) -> str:
    """The moment format of this rank's shard as saved."""
    return "fp32" if buckets.device() else buckets.moment_dtype


def group_master(buckets: Buckets, g: int) -> Tensor:
    """Group ``g``'s whole fp32 master shard on the host."""
    master = _arrays(buckets).master[g]
    if _host_only(buckets, g) and isinstance(master, Tensor):  # not FSDP2's host shards
        return master
    return torch.cat([bk.shard.export("master") for bk in buckets.in_group(g)])


def group_pieces(buckets: Buckets, g: int, kind: str) -> Iterator[Tensor]:
    """Group ``g``'s whole shard of ``kind`` (``"master"`` or a state's name) as saved with a
    device part (fp32), in pieces made one at a time: the host's whole array where it is the
    whole group and fp32, else bucket by bucket, on the host."""
    arrays = _arrays(buckets)
    if (_host_only(buckets, g) and isinstance(arrays.master[g], Tensor)
            and (kind == "master" or buckets.moment_dtype == "fp32")):
        yield arrays.master[g] if kind == "master" else arrays.moments[g].arrays[kind]
        return
    for bucket in buckets.in_group(g):
        yield bucket.shard.export(kind)


def group_moments(buckets: Buckets, g: int) -> Moments:
    """Group ``g``'s whole state in :func:`saved_moment_dtype`."""
    mine = _arrays(buckets).moments[g]
    if saved_moment_dtype(buckets) == buckets.moment_dtype and _host_only(buckets, g):
        return mine
    parts = [bk.shard.export_state() for bk in buckets.in_group(g)]
    whole = (torch.cat([p[i] for p in parts]) if parts else torch.zeros(0)
             for i in range(len(mine.names)))
    return Moments("fp32", *whole, names=mine.names)


def _load(bucket: Bucket, master: Tensor, moments: Moments) -> None:
    a, k = bucket.host_offset, bucket.numel
    bucket.shard.load(master[a : a + k], state=moments.chunk(a, k))


@torch.no_grad()
def load_group(buckets: Buckets, g: int, master: Tensor, moments: Moments) -> None:
    """Group ``g``'s whole shard (as :func:`group_master`/:func:`group_moments` give it, in any
    moment format) into its buckets' shards, each converting what is not its own format."""
    for bucket in buckets.in_group(g):
        _load(bucket, master, moments)
