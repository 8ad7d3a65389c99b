"""The master weights' first fill, from the parameters, before anything else is allocated."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero_offload.core.layout import Layout, shard_pieces
from lightning_zero_offload.core.placement import host_numel, where
from lightning_zero_offload.core.stage import DeviceStage
from lightning_zero_offload.core.tensor_parallel import local

_FILL_CHUNK = 1 << 24  # elements: the bounded buffer (32 MiB in bf16) a master fill reads through


@torch.no_grad()
def fill_master(layout: Layout, rank: int, dtype: torch.dtype, pinned: bool,
                resident: Sequence[DeviceStage] = ()) -> list[Tensor]:
    """This rank's fp32 master weights per group, from the parameters (still the user's, before
    any cast), for ``HostBuffers`` (``master=``). An fp32 host parameter is copied straight
    in; any other (a bf16 model, one already on the GPU) passes through one bounded buffer in its
    dtype, pinned for a GPU parameter when ``pinned``, so the host never holds a temporary of a
    parameter's size. Called before the device weights take the parameters over and before the
    other buffers exist: setup never keeps the user's fp32 copy beside the master. The buckets
    of ``resident`` (the device's trailing ones) are filled into their stages' master instead."""
    on_host = host_numel(layout, len(resident))
    master = [torch.zeros(k, pin_memory=pinned and dtype == torch.float32) for k in on_host]
    chunk = min(_FILL_CHUNK, max((hi - lo for _, lo, hi, _ in shard_pieces(layout, rank)),
                                 default=1))
    bufs: dict[tuple[torch.dtype, bool], Tensor] = {}
    for slot, lo, hi, at in shard_pieces(layout, rank):
        src = local(slot.param).detach().reshape(-1)[lo:hi]
        stage = where(layout, resident, slot.bucket)
        if stage is not None:
            stage.load(src, at=at - layout.buckets[slot.bucket].host_offset)
            continue
        dst = master[slot.group][at : at + hi - lo]
        if src.device.type == "cpu" and src.dtype == torch.float32:
            dst.copy_(src)
            continue
        pin = pinned and src.device.type == "cuda"
        buf = bufs.get((src.dtype, pin))
        if buf is None:
            buf = bufs[(src.dtype, pin)] = torch.empty(chunk, dtype=src.dtype, pin_memory=pin)
        for a in range(0, src.numel(), chunk):
            part = buf[: min(chunk, src.numel() - a)]
            part.copy_(src[a : a + part.numel()])  # from a GPU: waits for the copy
            dst[a : a + part.numel()].copy_(part)
    return master
