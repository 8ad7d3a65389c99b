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


def check_lazy_fp32(needed: int, rank: int) -> None:
    """Before the fp32 host gradient is allocated at the first backward that accumulates
    (``accumulate=None``: the setup check did not count it): MemoryError if it does not fit."""
    available = psutil.virtual_memory().available
    if needed > available:
        raise MemoryError(
            f"ZeroOffload: this backward accumulates gradients, which needs an fp32 host gradient "
            f"of {needed / GiB:.2f} GiB ({needed} bytes) on rank {rank}, but only "
            f"{available / GiB:.2f} GiB ({available} bytes) is available. Set "
            "ZeroOffloadConfig(accumulate=True) so the setup check counts it (and fails before "
            "training), or free host memory, use moment_dtype='int8' or more ranks; "
            "check_host_memory=False skips this check."
        )
