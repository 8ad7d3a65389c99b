"""The one options object of the engine (every field has a working default)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zero_offload.ops.moments import MOMENT_DTYPES

PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
DEFAULT_PRECISION = "bf16-mixed"  # of the plain engine, where no framework chooses one
MIN_SCALE = 2.0**-24  # the loss scaler's floor: below fp16's smallest subnormal, nothing rescues


def check_cores(cores: Sequence[int] | None) -> tuple[int, ...] | None:
    """``cpu_affinity`` must name cores this process may run on."""
    if cores is None:
        return None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = tuple(cores)
    bad = [c for c in cores if not isinstance(c, int) or (allowed is not None and c not in allowed)]
    if not cores or bad:
        raise ValueError(
            f"ZeroOffloadConfig: cpu_affinity={cores!r} must be a non-empty list of core ids this "
            f"process may use ({sorted(allowed) if allowed else 'unknown'}); bad: {bad}"
        )
    if allowed is None:
        raise ValueError("ZeroOffloadConfig: cpu_affinity needs os.sched_setaffinity (Linux)")
    return cores


@dataclass
class ZeroOffloadConfig:
    """Options of :class:`~lightning_zero_offload.ZeroOffload`.

    ``precision`` is the dtype of the weights on the device (the master weights and gradients on
    the host are always fp32). ``moment_dtype`` is how the host keeps the optimizer's moments
    (Adam's two, Lion's one): ``"fp32"`` (exact), ``"bf16"`` or ``"int8"`` (block-wise 8-bit
    codes with one fp32 scale per 256 elements and moment; Dettmers et al., ICLR 2022; see
    ``lightning_zero_offload.ops.moments``: 4, 2 and about 1.02 bytes per element and moment).
    Compact moments are written with stochastic rounding from ``moment_seed`` (so a run is
    repeatable, and each element's rounding does not depend on threads, ranks' count or
    chunking). ``bucket_size_mb`` bounds the device bytes of one gradient bucket (in the
    compute dtype): smaller buckets start transfers earlier, larger ones make fewer collective
    calls. ``cpu_threads=None`` uses the cores available to this process
    divided by the ranks on this node (not ``torch.get_num_threads()``, which torchrun sets to 1),
    less one with ``delayed_update`` (the core that keeps the device fed). ``cpu_affinity`` binds
    the CPU step (a worker thread and the kernel threads it starts) to these core ids, e.g.
    this rank's share of its NUMA node; its length is then the default thread count.
    ``delayed_update``: from step ``delayed_update_warmup + 1`` on, the CPU step of step i runs on
    a worker thread while step i+1's forward and backward run on the weights through step i-1
    (exactly one step stale; ``synchronize()``, checkpoints and teardown apply the pending step).
    It costs a second copy of the device weights, and of the host gradient and staging buffers.
    The module's parameters then alternate between two device buffers (swapped at each step),
    so nothing may capture their addresses (CUDA graphs). ``delayed_update_warmup`` defaults to
    10 steps because the first steps move the weights the most (Adam's first updates are about
    ``lr`` in every coordinate, whatever the gradient's size, and the gradients change fastest
    while the loss falls steeply), so a stale update hurts most there; the paper likewise turns
    it on only after a warm-up. ``collective_timeout_s`` is the timeout of every collective the
    engine issues: a rank that fails or stops makes its peers raise within it, instead of after the
    process group's 30-minute default.
    Every field is type-checked (a bool field takes only True/False, an int field no bool).

    ``accumulate``: whether a step adds several backward passes (gradient accumulation), which
    on an asynchronous device (CUDA) needs an fp32 host gradient (4 bytes per parameter, 8 with
    delayed update): True allocates it at setup (and the host-memory check counts it); False
    never allocates it, and a backward that would accumulate raises; None (not said) budgets the
    run without it and allocates it at the first backward that accumulates, after its own
    host-memory check. Accumulating on the device (``backward(loss, sync_gradients=False)``,
    ``no_sync()``) needs no fp32 host gradient. The adapters set it from the framework's
    accumulation setting.

    ``offload_fraction``: the share of the trained optimizer state (fp32 master weights and both
    moments) kept and stepped in host memory. ``1.0`` offloads all of it; ``0.0`` keeps all of it
    on the device (ZeRO-2 on the device); in between, whole buckets stay on the device, those whose
    gradients arrive last in backward (the model's first layers), until the device holds
    ``1 - offload_fraction`` of the state. ``"auto"`` (the default) keeps on the device what the
    host cannot hold at setup, then, after the first step, moves further buckets onto the device
    while its peak memory plus what moves stays within ``1 - device_memory_headroom`` of its
    capacity (once, ranks agreeing); on the CPU compute device it is ``1.0``.
    ``device_memory_headroom`` (default 0.2) is the share of the device's memory ``"auto"`` leaves
    free: a later, longer batch may peak above the first step's.

    ``offload_weights``: the model is ``fully_shard``-ed with FSDP2's ``CPUOffloadPolicy``, so
    its sharded fp32 weights live in host memory and are the master the host step updates in
    place (``core.step.overlap``): no second fp32 copy, no half weights of the engine's. None
    (the default) reads it from where the shards live (on the host while the model computes on
    an accelerator); on the CPU compute device, where both are host memory and FSDP2 exposes no
    public getter for its offload policy, say True. ``overlap_host_step`` (with
    ``offload_weights``): the host step runs on a worker thread, unit by unit in the order the
    next forward needs them, and each unit's forward waits for its own update only (the result
    is bit for bit the unoverlapped step's); False steps every unit before ``step()`` returns.

    ``precision=None`` (the default) takes the framework's: Lightning's ``precision``,
    Accelerate's ``mixed_precision``, the transformers Trainer's ``bf16``/``fp16``; the plain
    engine uses ``DEFAULT_PRECISION`` (``"bf16-mixed"``). An explicit value that disagrees with
    the framework's raises (:meth:`resolve_precision`).
    """

    precision: str | None = None
    max_grad_norm: float | None = None
    bucket_size_mb: float = 25.0
    cpu_threads: int | None = None
    cpu_affinity: tuple[int, ...] | None = None
    pin_memory: bool | None = None
    delayed_update: bool = False
    delayed_update_warmup: int = 10
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    check_host_memory: bool = True
    collective_timeout_s: float = 300.0
    moment_dtype: str = "fp32"
    moment_seed: int = 0
    accumulate: bool | None = None
    offload_fraction: float | str = "auto"
    device_memory_headroom: float = 0.2
    offload_weights: bool | None = None
    overlap_host_step: bool = True

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(
                f"ZeroOffloadConfig: precision={self.precision!r} is not supported; use one of "
                f"{', '.join(map(repr, PRECISIONS))}, or None for the framework's"
            )

        def fail(name: str, want: str, error: type[Exception] = TypeError) -> None:
            value = getattr(self, name)
            raise error(f"ZeroOffloadConfig: {name} must be {want}, got {value!r}"
                        + (f" ({type(value).__name__})" if error is TypeError else ""))

        def number(name: str, *, integer: bool = False, optional: bool = False) -> bool:
            """Type check; True when the value is a number (not None) to range-check."""
            value = getattr(self, name)
            if optional and value is None:
                return False
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                fail(name, ("an int" if integer else "a number") + (" or None" * optional))
            return True

        for name in ("delayed_update", "check_host_memory", "overlap_host_step"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "True or False")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            fail("pin_memory", "True, False or None")
        if self.accumulate is not None and not isinstance(self.accumulate, bool):
            fail("accumulate", "True, False or None")
        if self.offload_weights is not None and not isinstance(self.offload_weights, bool):
            fail("offload_weights", "True, False or None")
        if number("max_grad_norm", optional=True) and not (self.max_grad_norm or 0) > 0:
            fail("max_grad_norm", "a positive number or None", ValueError)
        if number("bucket_size_mb") and not 0 < self.bucket_size_mb < math.inf:
            fail("bucket_size_mb", "> 0 and finite (a bucket's size in MiB)", ValueError)
        if number("cpu_threads", integer=True, optional=True) and (self.cpu_threads or 0) < 1:
            fail("cpu_threads", "an int >= 1 or None", ValueError)
        self.cpu_affinity = check_cores(self.cpu_affinity)
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "ZeroOffloadConfig: pin_memory=True needs a CUDA device (pinned memory only "
                "speeds up host<->GPU copies); leave it None"
            )
        if number("delayed_update_warmup", integer=True) and self.delayed_update_warmup < 0:
            fail("delayed_update_warmup", "an int >= 0", ValueError)
        if number("initial_loss_scale") and not 0 < self.initial_loss_scale < math.inf:
            fail("initial_loss_scale", "a finite number > 0", ValueError)
        if self.initial_loss_scale < MIN_SCALE:  # the scaled fp16 gradients would underflow
            raise ValueError(
                f"ZeroOffloadConfig: initial_loss_scale={self.initial_loss_scale!r} is below the "
                f"loss scaler's floor {MIN_SCALE!r} (2**-24): under precision='16-mixed' the "
                "scaled gradients underflow to zero in fp16 (a step on zero gradients, or NaN "
                "weights from 1/scale). Use the default 2**16 (the scaler lowers it by itself "
                "on overflow), or precision='bf16-mixed', which needs no loss scaling")
        if number("loss_scale_growth_interval", integer=True) and (
                self.loss_scale_growth_interval < 1):
            fail("loss_scale_growth_interval", "an int >= 1", ValueError)
        if not isinstance(self.moment_dtype, str):
            fail("moment_dtype", "a string")
        if self.moment_dtype not in MOMENT_DTYPES:
            fail("moment_dtype", f"one of {', '.join(map(repr, MOMENT_DTYPES))}", ValueError)
        if number("moment_seed", integer=True) and not 0 <= self.moment_seed < 2**63:
            fail("moment_seed", "an int in [0, 2**63)", ValueError)
        f = self.offload_fraction
        if f != "auto" and (isinstance(f, bool) or not isinstance(f, (int, float))
                            or not 0.0 <= f <= 1.0):
            fail("offload_fraction", 'a number in [0, 1] or "auto"', ValueError)
        if number("device_memory_headroom") and not 0.0 <= self.device_memory_headroom < 1.0:
            fail("device_memory_headroom", "a number in [0, 1)", ValueError)
        if number("collective_timeout_s") and not 0 < self.collective_timeout_s < math.inf:
            fail("collective_timeout_s", "a finite number of seconds > 0", ValueError)

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision or DEFAULT_PRECISION]

    def resolve_precision(self, framework: str | None = None, *, source: str = ""
                          ) -> ZeroOffloadConfig:
        """A copy with a concrete precision: ``framework`` (the precision the framework's own
        setting ``source`` means), else ``DEFAULT_PRECISION`` when unset. The one precision rule
        of every adapter: an explicit precision that disagrees with the framework's raises."""
        if framework is None:
            return self if self.precision else self.replace(precision=DEFAULT_PRECISION)
        if self.precision is not None and self.precision != framework:
            where = source or "the framework's precision"
            raise ValueError(
                f"ZeroOffloadConfig(precision={self.precision!r}) does not match {where}, which "
                f"means precision {framework!r}; set the precision once, on the framework, and "
                "leave ZeroOffloadConfig.precision unset (None)"
            )
        return self.replace(precision=framework)

    def resolve_accumulate(self, steps: int | None) -> ZeroOffloadConfig:
        """A copy with ``accumulate`` from a framework's accumulation setting (``steps`` backward
        passes per optimizer step; None: the framework has none). The one accumulation rule of
        every adapter: an explicit ``accumulate`` (True/False) wins."""
        if self.accumulate is not None or steps is None:
            return self
        return self.replace(accumulate=steps > 1)

    def replace(self, **overrides: object) -> ZeroOffloadConfig:
        """A copy with ``overrides`` applied; unknown names raise a TypeError listing the fields."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(
                f"ZeroOffload: unknown option(s) {unknown}; ZeroOffloadConfig fields are "
                f"{sorted(names)}"
            )
        return dataclasses.replace(self, **overrides)
