"""The kernels' Python face: argument checks, then the C++ extension or the pure-torch reference.

One module per rule's kernel face, each with its state (``{name: 8-bit code}``), its fused step
and the pure-torch reference of that step: ``ops.adamw`` (``fused_adamw_``: AdamW and Adam) and
``ops.lion`` (``fused_lion_``). What they share: ``ops.ext`` (the extension, its SIMD path,
threads, argument checks) and ``ops.moments`` (the state's storage formats).
"""

from __future__ import annotations

from lightning_zero_offload.ops.adamw import STATE as ADAM
from lightning_zero_offload.ops.adamw import check_args, fused_adamw_, fused_adamw_reference_
from lightning_zero_offload.ops.ext import (
    available_isas,
    backend,
    check_tensor,
    force_isa,
    get_isa,
    kernel,
    pool,
)
from lightning_zero_offload.ops.lion import STATE as LION
from lightning_zero_offload.ops.lion import fused_lion_, fused_lion_reference_
from lightning_zero_offload.ops.moments import (
    BLOCK,
    MOMENT_DTYPES,
    SIGNED,
    SQRT,
    Moments,
    array_bytes,
    moment_bytes,
    num_blocks,
    rng_key,
)

__all__ = [
    "fused_adamw_", "fused_adamw_reference_", "check_args", "fused_lion_",
    "fused_lion_reference_", "backend", "available_isas", "get_isa", "force_isa", "check_tensor",
    "kernel", "pool", "ADAM", "LION", "BLOCK", "MOMENT_DTYPES", "SIGNED", "SQRT", "Moments",
    "array_bytes", "moment_bytes", "num_blocks", "rng_key",
]
