"""Check, before allocating, that this rank's host buffers fit in available memory."""

from __future__ import annotations

import psutil

GiB = 2**30


def check_host_memory(needed: int, rank: int) -> None:
    """Raise MemoryError with both numbers when ``needed`` exceeds available host memory."""
    available = psutil.virtual_memory().available
    if needed > available:
        raise MemoryError(
            f"ZeroOffload: rank {rank} needs {needed / GiB:.2f} GiB of host memory for its "
            f"optimizer shard ({needed} bytes) but only {available / GiB:.2f} GiB ({available} "
            "bytes) is available. Use more data-parallel ranks (the shard shrinks as 1/N), a "
            "smaller model, or free host memory; check_host_memory=False skips this check."
        )
