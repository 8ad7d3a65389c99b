"""How fast a step runs: the host kernel measured here, and the device part's step.

The host part's step is the update rule's kernel (``Rule.host_update``) over the host's share,
timed on this host. The device part's (partial offload) is the rule's torch ops
(``Rule.device_update``) over the device-resident buckets, a memory-bound pass: its traffic per
element is counted (:func:`device_step_bytes`) and its time is measured only where this machine
has CUDA (:func:`measure_device_step`); elsewhere the planner prints the traffic and says the
time is not measured.
"""

from __future__ import annotations

import time

from lightning_zero_offload.core.buckets import device_budget
from lightning_zero_offload.core.rules.rule import Rule


def device_step_bytes(h: int, rule: Rule) -> int:
    """Device memory traffic of one device-resident element's step: the fp32 master and the
    rule's fp32 state read and written (``2 * device_budget.state``: 24 for Adam), the gradient
    read and the half weights written in the compute dtype (``h`` each)."""
    return 2 * device_budget.state(rule) + 2 * h


def measure_kernel(precision: str, threads: int, rule: Rule, seconds: float = 0.2,
                   numel: int = 4 * 2**20, moment_dtype: str = "fp32") -> float:
    """Parameters per second of the rule's kernel on this host (fp32 master, its state in
    ``moment_dtype``, the gradient and weight output in the compute dtype), timed for about
    ``seconds``."""
    import torch

    from lightning_zero_offload.core.config import PRECISIONS

    dtype = PRECISIONS[precision]
    half = dtype != torch.float32
    p, state = torch.randn(numel), rule.zeros(numel, moment_dtype)
    g = torch.randn(numel).to(dtype)
    out = torch.empty(numel, dtype=dtype) if half else None
    hp = rule.hyper(rule.DEFAULTS)

    def run(step: int) -> None:
        rule.host_update(p, g, state, hp, step=step, grad_scale=1.0, out=out, threads=threads,
                         seed=0)

    run(1)  # build/load the kernel and touch every page
    steps, start = 0, time.perf_counter()
    while True:
        steps += 1
        run(steps + 1)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * numel / elapsed


def measure_device_step(precision: str, rule: Rule, numel: int = 16 * 2**20,
                        seconds: float = 0.2) -> float | None:
    """Elements per second of the engine's device step (``Rule.device_update``: torch ops over
    fp32 master and state, the gradient in the compute dtype) plus the half weights written out,
    on this machine's CUDA device; None without CUDA."""
    import torch

    from lightning_zero_offload.core.config import PRECISIONS

    if not torch.cuda.is_available():
        return None
    dev, dtype = torch.device("cuda"), PRECISIONS[precision]
    master = torch.randn(numel, device=dev)
    state = [torch.rand(numel, device=dev) for _ in rule.names]  # >= 0: a second moment too
    grad = torch.randn(numel, device=dev).to(dtype)
    out = torch.empty(numel, device=dev, dtype=dtype)
    hp = rule.hyper(rule.DEFAULTS)

    def run(step: int) -> None:
        rule.device_update(master, grad, state, hp, step=step, grad_scale=1.0)
        out.copy_(master)

    run(1)
    torch.cuda.synchronize()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += 1
        run(steps + 1)
    torch.cuda.synchronize()
    return steps * numel / (time.perf_counter() - start)
