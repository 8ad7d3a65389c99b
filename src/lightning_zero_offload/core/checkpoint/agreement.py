"""The cross-rank agreement of a checkpoint's save and load: every rank learns whether any rank
failed a step (and then raises) before any rank changes its state, and all ranks use rank 0's
temporary folder name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero_offload.core.checkpoint.formats import CheckpointError
from lightning_zero_offload.core.dist import collectives


def capture(fn: Callable[[], object]) -> Exception | None:
    """The exception ``fn()`` raises, or None: lets a rank report it to :func:`agree` first."""
    try:
        fn()
    except Exception as e:
        return e
    return None


def agree(error: BaseException | None, world_size: int, group: Any,
          device: torch.device) -> None:
    """Collective: raise on every rank if ``error`` happened on any (this rank's own error as
    is), so that no rank goes on to change its state or waits for a failed peer."""
    if world_size > 1:
        flags = torch.zeros(world_size, device=device)
        mine = torch.tensor([float(error is not None)], device=device)
        collectives.all_gather(flags, mine, group, "agreement on a checkpoint step")
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if failed and error is None:
            raise CheckpointError(f"checkpoint: rank(s) {failed} failed (see their error); "
                                  "nothing was changed on this rank")
    if error is not None:
        raise error


def share_token(token: str, world_size: int, group: Any, device: torch.device) -> str:
    """Collective: rank 0's ``token`` on every rank ("" when rank 0 could not start)."""
    if world_size == 1:
        return token
    data = list(token.encode())[:256]
    buf = torch.tensor(data + [0] * (256 - len(data)), dtype=torch.uint8).to(device)
    src = dist.get_global_rank(group, 0) if group is not None else 0  # type: ignore[arg-type]
    collectives.broadcast(buf, src, group, "broadcast of the checkpoint's temporary name")
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()
