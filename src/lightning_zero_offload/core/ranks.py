"""What the ranks must agree on at setup: the same model and settings, and rank 0's weights.

Like DDP, the engine refuses ranks whose parameters differ in name, shape or dtype (with N ranks
each one owns 1/N of every bucket, so a difference would silently mix different models) or
whose settings that shape the collectives differ (:data:`SHARED`: one rank's device part or
buckets would not match another's), and starts every rank from rank 0's weights and buffers,
so every adapter gets the same start.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.dist import collectives
from lightning_zero_offload.core.dist.tensor_parallel import local

logger = logging.getLogger(__name__)

# ZeroOffloadConfig fields every rank must share: they decide the buckets, the device part and
# the collectives each step issues (threads, pinning and the host check may differ per rank).
SHARED = ("precision", "bucket_size_mb", "moment_dtype", "delayed_update", "offload_fraction",
          "device_memory_headroom")


def settings(config: Any) -> dict[str, Any]:
    """The :data:`SHARED` fields of ``config``."""
    return {name: getattr(config, name) for name in SHARED}


def _describe(layout: Layout, module: nn.Module) -> list[str]:
    out = [f"parameter {s.name!r}: shape {tuple(s.shape)}, {s.param.dtype}, group {s.group}"
           for s in layout.slots]
    out += [f"buffer {n!r}: shape {tuple(b.shape)}, {b.dtype}" for n, b in module.named_buffers()]
    return out


def start(layout: Layout, module: nn.Module, group: Any, device: torch.device, tp: Any,
          local_checks: Callable[[], object], config: Any) -> None:
    """Run this rank's setup checks; with several ranks agree (every rank raises the first
    failure, or a model difference) and take rank 0's starting weights. Under tensor
    parallelism (``tp``) the checks' failures are agreed over every process of the mesh (the
    data-parallel ``group`` is only a part of them); their :func:`settings` must match."""
    try:
        local_checks()
        error = None
    except MemoryError as e:
        error = e
    several = dist.is_available() and dist.is_initialized()
    if several and tp is not None and dist.get_world_size() > 1:
        every = collectives.gather_objects("setup check of every process",
                                           (tp.mesh.get_coordinate(), _failure(error)))
        _raise_first([(f"rank {r} (mesh coordinates {tuple(c)})", e)
                      for r, (c, e) in enumerate(every)])
        error = None
    if several and dist.get_world_size(group) > 1:
        logger.debug("setup: agreeing with the other ranks (model, host memory checks)")
        agree(layout, module, group, error, every_process=tp is not None,
              shared=settings(config))
        logger.debug("setup: agreed; taking rank 0's starting weights and buffers")
        broadcast_start(layout, module, group, collectives.collective_device(group, device))
        logger.debug("setup: rank 0's starting weights taken")
    elif error is not None:
        raise error


def _failure(error: Exception | None) -> tuple[str, str] | None:
    return None if error is None else (type(error).__name__, str(error))


def _raise_first(failures: list[tuple[str, tuple[str, str] | None]]) -> None:
    """Every rank raises the first failure of ``(who, failure)``, if any."""
    for who, err in failures:
        if err is not None:
            kind = MemoryError if err[0] == "MemoryError" else ValueError
            raise kind(f"ZeroOffload: {who} failed its setup checks ({err[0]}: {err[1]}); "
                       "every rank stops here")


def agree(layout: Layout, module: nn.Module, group: Any, local_error: Exception | None, *,
          every_process: bool = False, shared: dict[str, Any] | None = None) -> None:
    """Collective (one small object all-gather). Every rank raises the same error when any rank
    failed its local setup checks (``local_error``, e.g. not enough host memory) or holds a
    different model; otherwise returns on every rank. Ranks are named by their global rank.
    ``every_process`` (tensor parallelism: ``group`` is one data-parallel group of the mesh): a
    model difference found in one group is raised on every process, not only in that group.
    Different ``shared`` settings are raised first (a rank's failed check may come from them)."""
    desc = _describe(layout, module)
    mine = (hashlib.sha256("\n".join(desc).encode()).hexdigest(), _failure(local_error),
            shared or {})
    every = collectives.gather_objects("setup check of every rank", mine, group)
    mismatch = _setting_difference([s for _, _, s in every], group)
    if every_process:
        found = collectives.gather_objects("settings check of every process", mismatch)
        mismatch = next((d for d in found if d is not None), None)
    if mismatch is not None:
        raise ValueError(f"ZeroOffload: the ranks were given different settings: {mismatch}. "
                         "Give every rank the same ZeroOffloadConfig (a configuration "
                         "mismatch: each rank would place and reduce different buckets).")
    _raise_first([(_who(group, r), err) for r, (_, err, _) in enumerate(every)])
    difference = None
    if any(d != every[0][0] for d, _, _ in every):
        descs = collectives.gather_objects("setup check of every rank", desc, group)
        difference = _difference(descs, group)
    if every_process:
        found = collectives.gather_objects("model check of every process", difference)
        difference = next((d for d in found if d is not None), None)
    if difference is not None:
        raise ValueError(f"ZeroOffload: the ranks hold different models: {difference}. Build "
                         "the same model and optimizer groups on every rank (as DDP requires).")


def _who(group: Any, r: int) -> str:
    """Rank ``r`` of ``group`` by its global rank (and its rank in the group where they differ)."""
    g = dist.get_global_rank(group, r) if group is not None else r
    return f"rank {g}" if g == r else f"rank {g} (data-parallel rank {r})"


def _setting_difference(every: list[dict[str, Any]], group: Any) -> str | None:
    """The first setting in which a rank departs from rank 0, with both values."""
    for r, theirs in enumerate(every):
        for name, value in theirs.items():
            if value != every[0].get(name):
                return (f"{_who(group, r)} has {name}={value!r} where {_who(group, 0)} has "
                        f"{name}={every[0].get(name)!r}")
    return None


def _difference(descs: list[list[str]], group: Any) -> str | None:
    """Where the first rank whose description differs from rank 0's departs from it."""
    for r, other in enumerate(descs):
        first = next(((i, a, b) for i, (a, b) in enumerate(zip(descs[0], other, strict=False))
                      if a != b), None)
        if first is None and len(other) == len(descs[0]):
            continue
        if first is not None:
            return f"{_who(group, r)} has {first[2]} where {_who(group, 0)} has {first[1]}"
        return (f"{_who(group, r)} has {len(other)} parameters and buffers, {_who(group, 0)} "
                f"{len(descs[0])}")
    return None


@torch.no_grad()
def broadcast_start(layout: Layout, module: nn.Module, group: Any,
                    device: torch.device) -> None:
    """Every rank takes rank 0's trained parameters (bucket by bucket, in fp32) and buffers."""
    src = dist.get_global_rank(group, 0) if group is not None else 0  # type: ignore[arg-type]
    for bucket in layout.buckets:
        flat = torch.zeros(bucket.numel, device=device)
        for i in bucket.slots:
            s = layout.slots[i]
            lo = s.offset - bucket.start
            flat[lo : lo + s.numel].copy_(local(s.param).detach().reshape(-1))
        collectives.broadcast(flat, src, group, "broadcast of rank 0's starting weights")
        for i in bucket.slots:
            s = layout.slots[i]
            lo = s.offset - bucket.start
            local(s.param).copy_(flat[lo : lo + s.numel].view(s.shape))
    for b in map(local, module.buffers()):
        t = b.detach().to(device)
        collectives.broadcast(t, src, group, "broadcast of rank 0's buffers")
        b.data.copy_(t)
