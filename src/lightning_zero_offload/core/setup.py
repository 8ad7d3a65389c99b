"""Building an engine: one function per stage, in the order its memory requires.

1. :func:`place`: the device part is chosen and checked (the host and device budgets, agreed
   over the ranks) before anything is allocated; the bucket records are made
   (``core.buckets.buckets``), the device buckets' memory with them.
2. :func:`fill`: the host's master arrays, then the fp32 master of every bucket, loaded into
   its shard wherever it lives.
3. :func:`bind_weights`: the device weights take the parameters over; their fp32 storage goes,
   so the host arrays that follow never coexist with a second fp32 copy.
4. :func:`host_buffers`: the host's moments, gradients and staging, within the agreed budget.
5. :func:`streamer`: gradients from backward into those buffers.
6. :func:`stepper`: the host and device updates, the delayed update and the step that runs them.

Each stage returns the owners it made; :func:`build` runs them and returns :class:`Owners`.
Before them, :func:`lay_out` cuts the trained parameters into buckets and shards.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zero_offload.core import ranks
from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.host import HostBuffers, budget_at
from lightning_zero_offload.core.buckets.host_plan import held_numel
from lightning_zero_offload.core.buckets.layout import (
    Layout,
    build_layout,
    shard_align,
    shard_pieces,
)
from lightning_zero_offload.core.buckets.master_fill import fill_master
from lightning_zero_offload.core.buckets.pieces import Pieces
from lightning_zero_offload.core.buckets.resident import DevicePart
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.device.device import SyncDevice
from lightning_zero_offload.core.device.device_factory import make_device
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.dist.fsdp import Fsdp
from lightning_zero_offload.core.dist.tensor_parallel import local
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.core.step.delayed import DelayedUpdate
from lightning_zero_offload.core.step.overlap import OverlappedStep
from lightning_zero_offload.core.step.step import Stepper
from lightning_zero_offload.core.step.threads import CpuStepWorker, step_threads
from lightning_zero_offload.core.step.update import DeviceUpdate, HostUpdate, SyncUpdate
from lightning_zero_offload.core.transfer.shard_weights import HostShardWeights, ShardWeights
from lightning_zero_offload.core.transfer.streaming import GradStreamer
from lightning_zero_offload.core.transfer.weights import DeviceWeights

# module -> its engine, both held weakly (a module may be wrapped by one live engine at a time)
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_unclaimed(module: nn.Module) -> None:
    """No live engine drives ``module`` already."""
    owner = _ENGINES[module]() if module in _ENGINES else None
    if owner is not None and not owner.torn_down:
        raise ValueError("ZeroOffload: this module is already driven by another ZeroOffload "
                         "engine; teardown() that one first (or wrap a fresh model)")


def claim(module: nn.Module, engine: object) -> None:
    """``engine`` drives ``module`` from now on (until it is torn down or dropped)."""
    _ENGINES[module] = weakref.ref(engine)


@dataclass
class Where:
    """What an engine is built for: the model, the ranks and the device."""

    layout: Layout
    module: nn.Module
    config: ZeroOffloadConfig
    dtype: torch.dtype
    pinned: bool
    rank: int
    group: Any  # the engine's data-parallel process group
    device: torch.device
    tp: Any  # core.dist.tensor_parallel.TensorParallel or None
    rule: Rule  # the update rule of the user's optimizer

    @functools.cached_property
    def trained(self) -> dict[int, str]:
        """id of each trained parameter -> its state_dict name."""
        return {id(s.param): s.name for s in self.layout.slots}


@dataclass
class Owners:
    dev: SyncDevice
    part: DevicePart
    profile: ProfileRecorder
    weights: DeviceWeights
    buckets: Buckets
    host: HostBuffers
    streamer: GradStreamer
    worker: CpuStepWorker | None
    delayed: DelayedUpdate | OverlappedStep  # what lands the pending host update
    stepper: Stepper
    checks: list  # FSDP2's hooks: its compute dtype, the overlapped step's waits


def lay_out(groups: list[list[nn.Parameter]], trainable: Any, order: Any, names: Any,
            config: ZeroOffloadConfig, world_size: int, tp: Any, module: nn.Module) -> Layout:
    """The buckets (``bucket_size_mb`` of the compute dtype) and each rank's shard of them, in
    the order gradients arrive (under FSDP2 the root unit's last)."""
    if isinstance(tp, Fsdp):
        order = tp.backward_order(order, module)
    elem = torch.empty((), dtype=config.compute_dtype).element_size()
    return build_layout(groups, trainable, order, names, world_size,
                        max(1, int(config.bucket_size_mb * 2**20 / elem)),
                        shard_align(config.moment_dtype), tp)


def _sizing(w: Where, dev: SyncDevice) -> dict[str, Any]:
    """The host buffers' sizing arguments (the budget counts what they will allocate)."""
    c = w.config
    return dict(asynchronous=dev.asynchronous, delayed=c.delayed_update, pinned=w.pinned,
                rule=w.rule, moment_dtype=c.moment_dtype, accumulate=c.accumulate)


def place(w: Where) -> tuple[SyncDevice, DevicePart, Buckets]:
    """Stage 1. Collective with several ranks (the setup checks agree). The device part owns
    the host budget (``DevicePart.host_budget``, its one writer) and the device's count."""
    dev = make_device(w.device, w.group, w.config.collective_timeout_s)
    budget = budget_at(w.layout, w.module, w.trained, w.dtype, **_sizing(w, dev),
                       cpu=w.device.type == "cpu" and dev.memory() is None,
                       own_master=not w.config.offload_weights)
    part = DevicePart(w.layout, dev, w.dtype, w.config, w.rank, w.group, budget, w.rule)
    ranks.start(w.layout, w.module, w.group, w.device, w.tp, part.choose, w.config)
    part.agree()  # a lazy fp32 gradient adds its own later
    buckets = Buckets(w.layout, w.rank, dev, w.dtype, w.rule, count=part.count,
                      sets=2 if w.config.delayed_update else 1,
                      align=shard_align(w.config.moment_dtype))
    return dev, part, buckets


def fill(w: Where, dev: SyncDevice, part: DevicePart, buckets: Buckets) -> HostBuffers:
    """Stage 2: the host's master arrays (only they, as yet), then every bucket's master."""
    host = HostBuffers(w.layout, w.dtype, rank=w.rank, **_sizing(w, dev),
                       check_memory=w.config.check_host_memory, on_fp32=part.fp32_allocated,
                       host=[bk.b for bk in buckets.host()],
                       masters=host_masters(w.layout, w.rank) if w.config.offload_weights
                       else None)
    buckets.attach(host)
    if host.owns_master:  # FSDP2's host shards (CPUOffloadPolicy) are the master already
        fill_master(w.layout, w.rank, w.pinned, buckets)
    return host


def host_masters(layout: Layout, rank: int) -> list[Pieces]:
    """Per group, FSDP2's host shards at their places in the host arrays: the master."""
    per_group: list[list[tuple[int, torch.Tensor]]] = [[] for _ in layout.group_numel]
    for slot, lo, hi, at in shard_pieces(layout, rank):
        per_group[slot.group].append((at, local(slot.param).detach().view(-1)[lo:hi]))
    sizes = held_numel(layout, list(range(len(layout.buckets))))
    return [Pieces(n, p) for n, p in zip(sizes, per_group, strict=True)]


def bind_weights(w: Where, dev: SyncDevice, profile: ProfileRecorder) -> DeviceWeights:
    """Stage 3: the parameters become views of the device weights (under FSDP2 the device
    weights are its shards)."""
    kind = (HostShardWeights if w.config.offload_weights else
            ShardWeights if isinstance(w.tp, Fsdp) else DeviceWeights)
    return kind(w.layout, w.module, w.dtype, dev, w.rank, w.trained,
                         w.config.delayed_update, profile)


def host_buffers(host: HostBuffers) -> None:
    """Stage 4."""
    host.allocate()


def streamer(w: Where, buckets: Buckets, dev: SyncDevice,
             profile: ProfileRecorder) -> GradStreamer:
    """Stage 5."""
    return GradStreamer(w.layout, buckets, w.dtype, dev, w.rank, w.group, profile,
                        reducing=w.tp.reducing if isinstance(w.tp, Fsdp) else None)


def stepper(w: Where, dev: SyncDevice, buckets: Buckets, grads: GradStreamer,
            weights: DeviceWeights, profile: ProfileRecorder
            ) -> tuple[CpuStepWorker | None, DelayedUpdate | OverlappedStep, Stepper]:
    """Stage 6: the worker (delayed update or pinned cores), the updates and the step."""
    c = w.config
    ranks = w.tp.size if isinstance(w.tp, Fsdp) else w.layout.world_size  # FSDP2: every process
    cores, threads = c.cpu_affinity, step_threads(c, ranks, w.device)
    overlap = bool(c.offload_weights and c.overlap_host_step)
    worker = CpuStepWorker(cores, w.device) if c.delayed_update or cores or overlap else None
    update = HostUpdate(w.layout, buckets, threads=threads, seed=c.moment_seed,
                        asynchronous=dev.asynchronous, half=w.dtype != torch.float32,
                        direct=weights.flat, profile=profile)
    on_device = DeviceUpdate(buckets, profile=profile)
    delayed: DelayedUpdate | OverlappedStep
    sync: SyncUpdate | OverlappedStep
    if c.offload_weights:  # FSDP2's host weights: the step under the next forward
        assert isinstance(weights, ShardWeights)
        delayed = sync = OverlappedStep(update, worker, buckets, weights.units, weights.reshard,
                                        profile, overlap=overlap)
        grads.wait_before_writes(sync.join)  # the next backward writes what it reads
    else:
        delayed = DelayedUpdate(worker, profile, weights, buckets, update)
        sync = SyncUpdate(update, worker, weights, profile)
    step = Stepper(w.layout, buckets, grads, on_device, sync, delayed, c, rule=w.rule,
                   rank=w.rank, process_group=w.group, device=w.device, profile=profile)
    return worker, delayed, step


def hook(module: nn.Module, cast_inputs: Any, forward_started: Any, zero_grad: Any) -> list:
    """The module's hooks into the engine (returned, for teardown to remove): the root's inputs
    are cast (``cast_inputs``), every module with parameters says its forward started, and
    ``module.zero_grad`` is ``zero_grad`` (loops that zero through the model, the transformers
    Trainer, clear the engine's gradients too)."""
    hooks = [module.register_forward_pre_hook(cast_inputs, with_kwargs=True)]
    hooks += [m.register_forward_pre_hook(forward_started) for m in module.modules()
              if m is not module and next(m.parameters(recurse=False), None) is not None]
    module.zero_grad = zero_grad  # type: ignore[method-assign]
    return hooks


def build(w: Where) -> Owners:
    """Every stage, in order."""
    dev, part, buckets = place(w)
    host = fill(w, dev, part, buckets)
    profile = ProfileRecorder()
    weights = bind_weights(w, dev, profile)
    host_buffers(host)
    grads = streamer(w, buckets, dev, profile)
    worker, delayed, step = stepper(w, dev, buckets, grads, weights, profile)
    checks = w.tp.check_forward_dtype(w.dtype) if isinstance(w.tp, Fsdp) else []
    if isinstance(delayed, OverlappedStep):  # a unit's forward, module.state_dict(): wait
        checks = [*checks, *delayed.hooks,  # a new list: the dtype check empties its own
                  w.module.register_state_dict_pre_hook(lambda *_: delayed.join())]
    return Owners(dev, part, profile, weights, buckets, host, grads, worker, delayed, step,
                  checks)


def release(o: Owners, hooks: list, module: nn.Module, *, drain: bool,
            restore: Callable[[], None] | None, keep_host: bool,
            release_group: Callable[[], Any]) -> Exception | None:
    """Teardown after the run's last collective, the mirror of :func:`build`: the worker stops,
    the streamer's and the module's hooks go, ``restore`` (collective: the module's fp32
    weights back) runs, the device weights and, unless ``keep_host``, the host buffers and the
    engine's process group are freed, and the device closes. Returns ``restore``'s error."""
    if o.worker is not None:
        o.worker.close()
    o.streamer.remove(drain=drain)  # False after a failed transfer: draining would raise
    for h in [*hooks, *o.checks]:
        h.remove()
    module.__dict__.pop("zero_grad", None)  # nn.Module.zero_grad again
    error = None
    try:
        if restore is not None:
            restore()
    except Exception as e:
        error = e
    o.weights.free()
    if not keep_host:  # a kept state still gathers over the engine's group
        o.buckets.free()
        release_group()
    o.dev.close()  # after the host buffers: it empties the pinned-memory cache
    return error
