"""Check, before allocating, that this rank's host buffers fit in available memory."""

from __future__ import annotations

import psutil

from lightning_zero_offload._units import format_bytes


def check_host_memory(needed: int, rank: int) -> None:
    """Raise MemoryError with both numbers when ``needed`` exceeds available host memory."""
    available = psutil.virtual_memory().available
    if needed > available:
        raise MemoryError(
            f"ZeroOffload: rank {rank} needs {format_bytes(needed, exact=True)} of host memory "
            f"for its optimizer shard but only {format_bytes(available, exact=True)} is "
            "available. Use more data-parallel ranks (the shard shrinks as 1/N), a smaller "
            "model, or free host memory; check_host_memory=False skips this check."
        )


def check_lazy_fp32(needed: int, rank: int) -> None:
    """Before the fp32 host gradient is allocated at the first backward that accumulates
    (``accumulate=None``: the setup check did not count it): MemoryError if it does not fit."""
    available = psutil.virtual_memory().available
    if needed > available:
        raise MemoryError(
            "ZeroOffload: this backward accumulates gradients, which needs an fp32 host gradient "
            f"of {format_bytes(needed, exact=True)} on rank {rank}, but only "
            f"{format_bytes(available, exact=True)} is available. Set "
            "ZeroOffloadConfig(accumulate=True) so the setup check counts it (and fails before "
            "training), or free host memory, use moment_dtype='int8' or more ranks; "
            "check_host_memory=False skips this check."
        )
