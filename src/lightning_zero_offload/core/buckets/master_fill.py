"""The master weights' first fill, from the parameters, before anything else is allocated."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Layout, shard_pieces
from lightning_zero_offload.core.dist.tensor_parallel import local

_FILL_CHUNK = 1 << 24  # elements: the bounded buffer (32 MiB in bf16) a master fill reads through


@torch.no_grad()
def fill_master(layout: Layout, rank: int, pinned: bool, buckets: Buckets) -> None:
    """Every bucket shard's fp32 master, wherever it lives, from the parameters (still the
    user's, before any cast), through the shard's own ``load``. An fp32 host parameter, or any
    parameter of a shard on the device, is loaded straight from its data; any other (a bf16
    model, one already on the GPU) passes through one bounded buffer in its dtype, pinned for a
    GPU parameter when ``pinned``, so the host never holds a temporary of a parameter's size.
    Called before the device weights take the parameters over and before the host's other
    arrays exist: setup never keeps the user's fp32 copy beside the master."""
    chunk = min(_FILL_CHUNK, max((hi - lo for _, lo, hi, _ in shard_pieces(layout, rank)),
                                 default=1))
    bufs: dict[tuple[torch.dtype, bool], Tensor] = {}
    for slot, lo, hi, at in shard_pieces(layout, rank):
        src = local(slot.param).detach().reshape(-1)[lo:hi]
        bucket = buckets[slot.bucket]
        at -= bucket.host_offset  # within the bucket's shard
        if (src.device.type == "cpu" and src.dtype == torch.float32
                or bucket.shard.master.device.type != "cpu"):  # no host temporary
            bucket.shard.load(src, at=at)
            continue
        pin = pinned and src.device.type == "cuda"
        buf = bufs.get((src.dtype, pin))
        if buf is None:
            buf = bufs[(src.dtype, pin)] = torch.empty(chunk, dtype=src.dtype, pin_memory=pin)
        for a in range(0, src.numel(), chunk):
            part = buf[: min(chunk, src.numel() - a)]
            part.copy_(src[a : a + part.numel()])  # from a GPU: waits for the copy
            bucket.shard.load(part, at=at + a)
