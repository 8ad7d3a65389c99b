"""Check, before allocating, that this rank's host buffers fit in available memory."""

from __future__ import annotations

import psutil

GiB = 2**30


def host_bytes_needed(shard_numel: int, staging_numel: int, staging_elem: int,
                      device_numel: int, device_elem: int) -> int:
    """fp32 master, exp_avg, exp_avg_sq and gradient of this rank's shard (16 B per element), the
    half-precision staging buffers, and, when the compute device is the CPU, the flat "device"
    weight buffer."""
    return 16 * shard_numel + staging_numel * staging_elem + device_numel * device_elem


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
