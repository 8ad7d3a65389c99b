"""How fast a step runs: the host kernel measured here, and the device part's step.

The host part's step is ``ops.fused_adamw_`` over the host's share, timed on this host. The
device part's (partial offload) is torch's fused AdamW over the device-resident buckets, a
memory-bound pass: its traffic per element is counted (:func:`device_step_bytes`) and its time
is measured only where this machine has CUDA (:func:`measure_device_step`); elsewhere the
planner prints the traffic and says the time is not measured.
"""

from __future__ import annotations

import time

from lightning_zero_offload.core.device_budget import STATE


def device_step_bytes(h: int) -> int:
    """Device memory traffic of one device-resident element's step: the fp32 master and the
    rule's fp32 state read and written (``2 * device_budget.STATE``: 24 for Adam), the gradient
    read and the half weights written in the compute dtype (``h`` each)."""
    return 2 * STATE + 2 * h


def measure_kernel(precision: str, threads: int, seconds: float = 0.2,
                   numel: int = 4 * 2**20, moment_dtype: str = "fp32") -> float:
    """Parameters per second of ``ops.fused_adamw_`` on this host (fp32 master, moments in
    ``moment_dtype``, the gradient and weight output in the compute dtype), timed for about
    ``seconds``."""
    import torch

    from lightning_zero_offload.core.config import PRECISIONS
    from lightning_zero_offload.ops import Moments, fused_adamw_

    dtype = PRECISIONS[precision]
    half = dtype != torch.float32
    p, mom = torch.randn(numel), Moments.zeros(numel, moment_dtype)
    g = torch.randn(numel).to(dtype)
    out = torch.empty(numel, dtype=dtype) if half else None
    def run(step: int) -> None:
        fused_adamw_(p, g, step=step, lr=1e-4, weight_decay=0.01, out=out,
                     num_threads=threads, **mom.kernel_args())

    run(1)  # build/load the kernel and touch every page
    steps, start = 0, time.perf_counter()
    while True:
        steps += 1
        run(steps + 1)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * numel / elapsed


def measure_device_step(precision: str, numel: int = 16 * 2**20,
                        seconds: float = 0.2) -> float | None:
    """Elements per second of the engine's device step (``core.rule.device_update``: torch's
    fused AdamW over fp32 master and moments, the gradient in the compute dtype) plus the half
    weights written out, on this machine's CUDA device; None without CUDA."""
    import torch

    from lightning_zero_offload.core import rule
    from lightning_zero_offload.core.config import PRECISIONS

    if not torch.cuda.is_available():
        return None
    dev, dtype = torch.device("cuda"), PRECISIONS[precision]
    master, m, v = (torch.randn(numel, device=dev) for _ in range(3))
    v.abs_()
    grad = torch.randn(numel, device=dev).to(dtype)
    out = torch.empty(numel, device=dev, dtype=dtype)
    hp = rule.Hyper(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)

    def run(step: int) -> None:
        rule.device_update(master, grad, (m, v), hp, step=step, grad_scale=1.0)
        out.copy_(master)

    run(1)
    torch.cuda.synchronize()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += 1
        run(steps + 1)
    torch.cuda.synchronize()
    return steps * numel / (time.perf_counter() - start)
