"""``ZeroOffload``: the engine a plain PyTorch loop (or an adapter) drives.

The step is split in two: ``_decide`` runs on the caller's thread and settles everything that
needs all ranks or the user's live state (wait for gradients, global norm, overflow, loss scale,
clip coefficient, the step's hyperparameters); ``_run_kernel`` only runs the kernel over this
rank's shard, chunk by chunk, each finished chunk's weights copied to the device while the next
computes. With delayed update (``core.delayed``) ``_run_kernel`` runs on a worker thread into a
spare weight buffer, which becomes the live one at the next step.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero_offload.core import checks
from lightning_zero_offload.core import state as ckpt
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.delayed import CpuStepWorker, default_threads
from lightning_zero_offload.core.layout import build_layout, shard_pieces
from lightning_zero_offload.core.optimizer import OffloadOptimizer
from lightning_zero_offload.core.preflight import check_host_memory, host_bytes_needed
from lightning_zero_offload.core.profile import ProfileRecorder, StepProfile
from lightning_zero_offload.core.scaler import DynamicLossScaler
from lightning_zero_offload.core.streaming import GradStreamer
from lightning_zero_offload.ops import fused_adamw_

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _host_copy(t: Tensor) -> Tensor:
    """A module buffer or untrained tensor for the full state: on the host, floats in fp32."""
    t = t.detach().cpu()
    return t.float() if t.is_floating_point() else t.clone()


@dataclass
class StepPlan:
    """Everything ``_apply`` needs, fixed at decision time."""

    grad_scale: float
    hparams: list[dict]  # per group: step, lr, betas, eps, weight_decay, decoupled


class ZeroOffload:
    """ZeRO-Offload training engine (see the package README for the full contract)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 config: ZeroOffloadConfig | None = None, *, process_group: object | None = None,
                 device: torch.device | str | None = None, **overrides: object) -> None:
        config = config if config is not None else ZeroOffloadConfig()
        if not isinstance(config, ZeroOffloadConfig):
            raise TypeError(f"ZeroOffload: config must be a ZeroOffloadConfig, got {type(config)}")
        self.config = config = config.replace(**overrides) if overrides else config
        self.device = checks.resolve_device(device)
        self.compute_dtype = config.compute_dtype
        if config.pin_memory and self.device.type != "cuda":
            raise ValueError("ZeroOffload: pin_memory=True needs a CUDA compute device")
        pin = self.device.type == "cuda" if config.pin_memory is None else config.pin_memory
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1
        self.decoupled = checks.check_optimizer(optimizer)
        trainable, order, names = checks.check_params(module, optimizer)
        self.module = module
        self.inner_optimizer = optimizer
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        self._num_module_params = len(list(module.parameters()))
        elem = torch.empty((), dtype=self.compute_dtype).element_size()
        self.layout = layout = build_layout(
            self._groups, trainable, order, names, self.world_size,
            max(1, int(config.bucket_size_mb * 2**20 / elem)),
        )
        half = self.compute_dtype != torch.float32
        shard = layout.shard_numel
        cpu_device = self.device.type == "cpu"
        delayed = config.delayed_update
        out_direct = cpu_device and self.world_size == 1  # kernel writes the device buffer itself
        staging = shard * (int(half and not out_direct) + int(not cpu_device))
        self.host_bytes = host_bytes_needed(
            shard, staging, elem, sum(layout.group_numel) if cpu_device else 0, elem
        )
        if not cpu_device:  # the fp32 gradient is allocated only if a step needs it (several
            self.host_bytes -= 4 * shard  # synchronizing backward passes; GradStreamer._host)
        if delayed:  # second gradient buffers; on the CPU also the spare weights
            self.host_bytes += (4 * shard + sum(layout.group_numel) * elem if cpu_device
                                else elem * shard)
        # Frozen parameters are cast to the compute dtype for forward like everything else; their
        # exact values stay on the host, so checkpoints and teardown never round them.
        self._trained = {id(s.param): s.name for s in layout.slots}  # id -> state_dict name
        frozen = [p for p in module.parameters() if id(p) not in self._trained
                  and p.is_floating_point() and p.dtype != self.compute_dtype]
        self.host_bytes += sum(p.numel() * p.element_size() for p in frozen)
        if config.check_host_memory:
            check_host_memory(self.host_bytes, self.rank)

        # Host state (fp32) of this rank's shard, filled from the user's weights before casting.
        n = layout.group_shard_numel
        self._master = [torch.zeros(k, pin_memory=pin and not half) for k in n]
        self._exp_avg = [torch.zeros(k) for k in n]
        self._exp_avg_sq = [torch.zeros(k) for k in n]
        # fp32 gradients; on CUDA allocated on first need (see GradStreamer._host)
        self._grads: list[Tensor | None] = [torch.zeros(k) if cpu_device else None for k in n]
        self._grads_spare = [torch.zeros(k) if cpu_device else None for k in n] if delayed else None
        self._staging_spare = ([torch.empty(k, dtype=self.compute_dtype, pin_memory=pin) for k in n]
                               if delayed and not cpu_device else None)
        with torch.no_grad():
            for slot, lo, hi, host in shard_pieces(layout, self.rank):
                self._master[slot.group][host : host + hi - lo].copy_(
                    slot.param.detach().reshape(-1)[lo:hi]
                )
        # Device weights: one flat buffer per group; parameters become views of it.
        self._orig_dtypes = {id(t): t.dtype for t in [*module.parameters(), *module.buffers()]}
        self._frozen = {id(p): p.detach().to("cpu", copy=True) for p in frozen}
        self._weights = [
            torch.zeros(k, dtype=self.compute_dtype, device=self.device)
            for k in layout.group_numel
        ]
        with torch.no_grad():
            for slot in layout.slots:
                view = self._weights[slot.group][slot.offset : slot.offset + slot.numel]
                view.copy_(slot.param.detach().reshape(-1))
                slot.param.data = view.view(slot.shape)
            module.to(device=self.device, dtype=self.compute_dtype)
        self._view_ptrs = [s.param.data_ptr() for s in layout.slots]
        # Delayed update: the worker writes step i's weights into a spare buffer while step i+1
        # runs on the live one; they swap when step i lands (twice the device weight memory).
        self._weights_spare = [w.clone() for w in self._weights] if delayed else None
        if out_direct and half:
            self._out: list[Tensor | None] = [None] * len(n)
        elif half:
            self._out = [torch.empty(k, dtype=self.compute_dtype, pin_memory=pin) for k in n]
        else:
            self._out = [None] * len(n)
        self._out_direct = out_direct and half

        self._streamer = GradStreamer(layout, self._grads, self.compute_dtype, self.device,
                                      self.rank, process_group, pin)
        self._input_hook = module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        # Many loops (the transformers Trainer among them) zero gradients through the model; ours
        # live in the engine's buffers, not in `param.grad`, so the model's zero_grad clears them.
        module.zero_grad = self._zero_grad_with_module
        self._scaler = (DynamicLossScaler(config.initial_loss_scale,
                                          config.loss_scale_growth_interval)
                        if config.precision == "16-mixed" else None)
        self._steps = [0] * len(self._groups)
        cores = config.cpu_affinity
        self._threads = config.cpu_threads or (
            len(cores) if cores else default_threads(self.world_size, self.device, delayed))
        self._worker = CpuStepWorker(cores, self.device) if delayed or cores else None
        self._pending: int | None = None  # the step whose delayed CPU step is running
        self._h2d_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._h2d_begin: tuple[float, torch.cuda.Event] | None = None
        self._profile = self._streamer.profile = ProfileRecorder()
        self._calls = 0  # step() calls, the profile's step numbers
        self._fb_start: float | None = None
        self._bwd_end: float | None = None
        self._clip_coef = 1.0
        self._clip_norm: float | None = None
        self._no_sync = False
        self._h2d_event = None
        self._closed = False
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.optimizer = OffloadOptimizer(self, optimizer)

    # -- forward / backward ------------------------------------------------------------------
    def _cast_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._fb_start is None and torch.is_grad_enabled():
            self._fb_start = self._profile.now()
        return checks.cast_floats(args, self.compute_dtype), checks.cast_floats(
            kwargs, self.compute_dtype
        )

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale ("16-mixed"), else None."""
        return self._scaler.scale if self._scaler is not None else None

    def backward(self, loss: Tensor, *, sync_gradients: bool = True) -> None:
        """``loss.backward()`` (times the loss scale for fp16); gradients add up until ``step``.
        With ``sync_gradients=False`` they stay on the device and are reduced with the next
        synchronizing backward (as DDP's ``no_sync``)."""
        self._check_open()
        if self._scaler is not None:
            loss = loss.float() * self._scaler.scale  # an fp16 loss times 2**16 could overflow
        self._streamer.sync = sync_gradients and not self._no_sync
        try:
            loss.backward()
        except BaseException:
            self._streamer.discard()
            raise
        finally:
            self._streamer.sync = not self._no_sync
        self._bwd_end = self._profile.now()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the cross-rank reduction (gradients accumulate locally)."""
        self._no_sync, self._streamer.sync = True, False
        try:
            yield
        finally:
            self._no_sync, self._streamer.sync = False, True

    # -- step ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Global gradient norm over all ranks (as ``torch.nn.utils.clip_grad_norm_`` on the
        whole model), folding the clip coefficient into the next ``step``. Returns the norm
        before this clip."""
        self._check_open()
        if not self._streamer.finish():
            return torch.tensor(0.0)
        raw = self._global_norm(float(norm_type))
        if self._clip_norm is None:
            self._clip_norm = raw
        current = raw * self._clip_coef
        self._clip_coef *= checks.clip_coef(float(max_norm), current)
        return torch.tensor(current)

    def step(self) -> Tensor | None:
        """One optimizer step over this rank's shard. Returns the global pre-clip gradient norm
        (None when neither clipping nor loss scaling needed it). With delayed update past its
        warm-up, the CPU step runs on the worker and lands at the next ``step``/``synchronize``."""
        self.optimizer._opt_called = True  # LR schedulers check that the optimizer stepped
        self._calls += 1
        k, prof = self._calls, self._profile
        if self._fb_start is not None and self._bwd_end is not None:
            prof.add("fwd_bwd", k, self._fb_start, self._bwd_end)
        self._fb_start = self._bwd_end = None
        plan = self._decide()
        self._streamer.profile_step = k + 1
        self._finish_delayed()  # step k-1's update lands now, before step k+1's forward
        if plan is None:
            prof.close(k)
        elif self.config.delayed_update and self._steps[0] > self.config.delayed_update_warmup:
            # The worker reads this step's gradient buffers; the next backward fills the spares.
            grads = self._streamer.grad_sources()
            spares = self._streamer.swap_buffers(self._grads_spare, self._staging_spare)
            self._grads, (self._grads_spare, self._staging_spare) = self._grads_spare, spares
            if self._h2d_stream is not None:  # the worker's copies go after this backward
                self._h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._worker.submit(self._run_kernel, plan, grads, k, self._weights_spare)
            self._pending = k
        else:
            with prof.span("stall", k):
                grads = self._streamer.grad_sources()
                if self._worker is not None:  # bound to its cores
                    self._worker.run(self._run_kernel, plan, grads, k, self._weights)
                else:
                    self._run_kernel(plan, grads, k, self._weights)
                self._push_done(k)
            prof.close(k)
        return None if self.last_grad_norm is None else torch.tensor(self.last_grad_norm)

    def _finish_delayed(self) -> None:
        """Wait for the delayed CPU step (the wait is its exposed stall), gather the other ranks'
        shards into the spare weights and make them the module's weights."""
        k, self._pending = self._pending, None
        if k is None:
            return
        try:
            with self._profile.span("stall", k):
                try:
                    self._worker.wait()
                except Exception as e:
                    raise RuntimeError(
                        f"ZeroOffload: the delayed CPU step of step {k} failed on its worker "
                        f"thread ({type(e).__name__}: {e}); the host optimizer state may be "
                        "partly updated, so resume from a checkpoint"
                    ) from e
                if self.world_size > 1:
                    for bucket in self.layout.buckets:
                        self._gather_bucket(bucket, self._weights_spare)
                self._push_done(k)
        finally:
            self._profile.close(k)  # even when the worker failed: nothing is left half-open
        self._weights, self._weights_spare = self._weights_spare, self._weights
        with torch.no_grad():
            for slot in self.layout.slots:
                flat = self._weights[slot.group]
                slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self._view_ptrs = [s.param.data_ptr() for s in self.layout.slots]

    def _decide(self) -> StepPlan | None:
        self._check_open()
        self._check_params()
        coef, norm = self._clip_coef, self._clip_norm
        self._clip_coef, self._clip_norm = 1.0, None
        self.last_grad_norm, self.last_step_skipped = None, True
        with self._profile.span("grad_wait", self._calls):
            arrived = self._streamer.finish()
        if not arrived:
            return None  # no gradient since zero_grad: like torch, nothing to do
        if norm is None and (self.config.max_grad_norm or self._scaler is not None):
            norm = self._global_norm(2.0)
        self.last_grad_norm = norm
        if self.config.max_grad_norm:
            coef *= checks.clip_coef(self.config.max_grad_norm, norm * coef)
        scale = 1.0
        if self._scaler is not None:
            scale = self._scaler.scale
            overflow = not math.isfinite(norm)
            self._scaler.update(overflow)
            if overflow:
                return None
        self.last_step_skipped = False
        hparams = []
        for g, group in enumerate(self.optimizer.param_groups):
            self._steps[g] += 1
            hparams.append({
                "step": self._steps[g], "lr": float(group["lr"]),
                "betas": (float(group["betas"][0]), float(group["betas"][1])),
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                "decoupled": self.decoupled or bool(group.get("decoupled_weight_decay", False)),
            })
        return StepPlan(coef / (self.world_size * scale), hparams)

    def _run_kernel(self, plan: StepPlan, grads: list[Tensor], k: int,
                    target: list[Tensor]) -> None:
        """The fused kernel over this rank's shard, chunk by chunk (a chunk is a bucket's shard,
        its gradient ``grads[b]``, in fp32 or still in the compute dtype in pinned staging);
        each finished chunk goes to ``target`` (on CUDA asynchronously, on a side stream) while
        the next one computes. ``target`` is the live weights, or the spare ones on the delayed
        worker, which never runs a collective (those stay on the caller's thread)."""
        self._wait_h2d()  # host buffers are rewritten only after the last copy has read them
        live = target is self._weights
        with self._profile.span("cpu_step", k):
            for b, bucket in enumerate(self.layout.buckets):
                g, hp = bucket.group, plan.hparams[bucket.group]
                sl = slice(bucket.host_offset, bucket.host_offset + bucket.shard)
                lo, hi = bucket.shard_range(self.rank)
                out = self._out[g]
                out = target[g][lo:hi] if self._out_direct else None if out is None else out[sl]
                fused_adamw_(
                    self._master[g][sl], grads[b], self._exp_avg[g][sl],
                    self._exp_avg_sq[g][sl], grad_scale=plan.grad_scale, out=out,
                    num_threads=self._threads, **hp,
                )
                self._copy_bucket(bucket, target, k=k)
                if live and self.world_size > 1:
                    self._gather_bucket(bucket, target)

    def _push_weights(self, from_master: bool = False) -> None:
        """Copy this rank's shard (the staged new weights, or the master weights) into the live
        device buffer and all-gather every bucket."""
        for bucket in self.layout.buckets:
            self._copy_bucket(bucket, self._weights, from_master)
            if self.world_size > 1:
                self._gather_bucket(bucket, self._weights)
        self._push_done(None)

    def _copy_bucket(self, bucket: Any, target: list[Tensor], from_master: bool = False,
                     k: int | None = None) -> None:
        if self._out_direct and not from_master:
            return  # the kernel wrote the weights in place
        stream = self._h2d_stream
        if stream is not None and self._h2d_begin is None:  # first chunk of this push
            if target is self._weights:
                stream.wait_stream(torch.cuda.current_stream(self.device))  # after backward
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            self._h2d_begin = (self._profile.now(), begin)
        g = bucket.group
        lo, hi = bucket.shard_range(self.rank)
        src = self._master[g] if from_master or self._out[g] is None else self._out[g]
        src = src[bucket.host_offset : bucket.host_offset + bucket.shard]
        with torch.no_grad(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            target[g][lo:hi].copy_(src, non_blocking=stream is not None)

    def _gather_bucket(self, bucket: Any, target: list[Tensor]) -> None:
        stream = self._h2d_stream
        g = bucket.group
        lo, hi = bucket.shard_range(self.rank)
        full = target[g][bucket.start : bucket.start + bucket.numel]
        with torch.no_grad(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            _all_gather(full, target[g][lo:hi], group=self.process_group)

    def _push_done(self, step: int | None) -> None:
        """The next forward (on the compute stream) waits for the copies; profile them."""
        stream = self._h2d_stream
        if stream is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if step is not None and self._h2d_begin is not None:
            self._profile.add_device("weight_copy", step, *self._h2d_begin, end)
        self._h2d_begin, self._h2d_event = None, end

    def _wait_h2d(self) -> None:
        """The host staging buffers are rewritten only after the last H2D copy has read them."""
        if self._h2d_event is not None:
            self._h2d_event.synchronize()
            self._h2d_event = None

    def _global_norm(self, norm_type: float) -> float:
        local = self._streamer.local_sq_sum() if norm_type == 2.0 else None
        if local is None:
            self._streamer.materialize()
            parts = [torch.linalg.vector_norm(g, norm_type) for g in self._grads
                     if g is not None and g.numel()]
            if not parts:
                local = torch.tensor(0.0)
            elif math.isinf(norm_type):
                local = torch.stack(parts).max()
            else:
                local = torch.stack(parts).double().pow(norm_type).sum()
        local = local.double()
        if self.world_size > 1:
            local = local.to(checks.collective_device(self.process_group, self.device))
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=self.process_group)
        total = local.item()
        if not math.isinf(norm_type):
            total = total ** (1.0 / norm_type)
        return total / (self.world_size * (self._scaler.scale if self._scaler else 1.0))

    def zero_grad(self) -> None:
        self._check_open()
        self._streamer.reset()

    def _zero_grad_with_module(self, set_to_none: bool = True) -> None:
        self.zero_grad()
        nn.Module.zero_grad(self.module, set_to_none)

    def synchronize(self) -> None:
        """Wait for pending transfers and updates: a delayed update is applied now (so
        checkpoints, validation and the end of training see every step)."""
        self._finish_delayed()
        if self.device.type == "cuda":
            self._streamer.drain()
            self._wait_h2d()
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def profile(self) -> list[StepProfile]:
        """Timings of the recent steps (see ``core.profile.StepProfile``), oldest first; a
        delayed step appears once its update has landed."""
        return self._profile.records

    @property
    def last_profile(self) -> StepProfile | None:
        """The newest landed step's timings; on CUDA waits for its weight copies."""
        recs = self._profile.records
        return recs[-1] if recs else None

    def finished_profile(self) -> StepProfile | None:
        """The newest step whose timings are all in, without waiting for the device: cheap
        enough to log every step (on CUDA it may be the step before ``last_profile``)."""
        recs = self._profile.finished()
        return recs[-1] if recs else None

    # -- checks -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ZeroOffload: this engine was torn down; create a new one")

    def _check_params(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != len(self._groups) or any(
            len(g["params"]) != len(ref)
            or any(p is not q for p, q in zip(g["params"], ref, strict=True))
            for g, ref in zip(groups, self._groups, strict=True)
        ):
            raise RuntimeError(
                "ZeroOffload: the optimizer's parameters changed after setup (added, removed or "
                "replaced); create the optimizer with all parameters before ZeroOffload"
            )
        if len(list(self.module.parameters())) != self._num_module_params:
            raise RuntimeError(
                "ZeroOffload: the module gained or lost parameters after setup; add all "
                "submodules before creating ZeroOffload"
            )
        for slot, ptr in zip(self.layout.slots, self._view_ptrs, strict=True):
            if slot.param.data_ptr() != ptr:
                raise RuntimeError(
                    f"ZeroOffload: parameter {slot.name!r} no longer lives in the engine's flat "
                    "buffer (was the module moved or cast with .to()/.float()/.half() after "
                    "setup?); the engine owns device placement and dtype"
                )

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard. The tensors are the live buffers (as torch optimizers do): save or
        copy them before training on."""
        self.synchronize()
        return {
            "format": ckpt.SHARD_FORMAT, "rank": self.rank, "world_size": self.world_size,
            "precision": self.config.precision, "layout": self.layout.describe(),
            "groups": [
                {"step": self._steps[g], "master": self._master[g], "exp_avg": self._exp_avg[g],
                 "exp_avg_sq": self._exp_avg_sq[g]}
                for g in range(len(self._groups))
            ],
            "param_groups": [ckpt.group_hparams(g) for g in self.optimizer.param_groups],
            "scaler": self._scaler.state_dict() if self._scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from this rank's ``state_dict()`` (same world size and model); for another
        world size use ``full_state_dict``/``load_full_state_dict`` or ``load_checkpoint``."""
        self._check_open()
        checks.check_shard(state, self)
        self.synchronize()
        with torch.no_grad():
            for g, saved in enumerate(state["groups"]):
                self._master[g].copy_(saved["master"])
                self._exp_avg[g].copy_(saved["exp_avg"])
                self._exp_avg_sq[g].copy_(saved["exp_avg_sq"])
                self._steps[g] = int(saved["step"])
        for group, hp in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update(hp)
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        self._push_weights(from_master=True)

    def _gather_full(self, host: list[Tensor]) -> list[Tensor]:
        """Full fp32 flat buffers per group from every rank's shard (collective)."""
        full = [torch.zeros(n) for n in self.layout.group_numel]
        coll = (checks.collective_device(self.process_group, self.device)
                if self.world_size > 1 else None)
        for bucket in self.layout.buckets:
            g, size = bucket.group, bucket.shard
            mine = host[g][bucket.host_offset : bucket.host_offset + size]
            if self.world_size == 1:
                full[g][bucket.start : bucket.start + bucket.numel] = mine
                continue
            out = torch.empty(bucket.numel, device=coll)
            _all_gather(out, mine.to(coll), group=self.process_group)
            full[g][bucket.start : bucket.start + bucket.numel] = out.cpu()
        return full

    def _untrained_state(self) -> dict[str, Tensor]:
        """Buffers and frozen parameters, on the host; frozen ones exact (see ``_frozen``)."""
        return {name: self._frozen[id(t)].clone() if id(t) in self._frozen else _host_copy(t)
                for name, t in self.module.state_dict(keep_vars=True).items()
                if id(t) not in self._trained}

    def _remember_frozen(self, state: dict[str, Tensor]) -> None:
        """After a load into the module: keep the exact values of its frozen parameters."""
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in self._frozen and name in state:
                self._frozen[id(t)].copy_(state[name])

    def full_state_dict(self, *, model: bool = True, optimizer: bool = True) -> dict:
        """Collective. ``{"model": fp32 module state_dict, "optimizer": torch AdamW format}``,
        loadable into a plain model and ``torch.optim.AdamW``, or an engine of any world size.
        ``optimizer=False`` (saving the trained weights) or ``model=False`` leaves that entry out
        and does not gather it: the weights are a third of the state."""
        self._check_open()
        self.synchronize()
        keys = ("master",) * model + ("exp_avg", "exp_avg_sq") * optimizer
        flats = {k: self._gather_full(getattr(self, "_" + k)) for k in keys}
        hparams = [ckpt.group_hparams(g) for g in self.optimizer.param_groups]
        out = ckpt.assemble(self.layout.describe(), flats, list(self._steps), hparams)
        full: dict[str, Any] = {"format": ckpt.FULL_FORMAT}
        if model:  # keyed like module.state_dict(): buffers and untrained tensors too
            untrained = self._untrained_state()
            full["model"] = {
                name: out["model"][self._trained[id(t)]] if id(t) in self._trained
                else untrained[name]
                for name, t in self.module.state_dict(keep_vars=True).items()
            }
        if optimizer:
            full["optimizer"] = out["optimizer"]
        full["scaler"] = self._scaler.state_dict() if self._scaler else None
        return full

    def load_full_state_dict(self, state: dict) -> None:
        """Load the consolidated form (from any world size), or a plain ``{"model":
        model.state_dict(), "optimizer": AdamW.state_dict()}`` pair."""
        self._check_open()
        model, opt = checks.check_full(state, self)
        self.synchronize()
        with torch.no_grad():
            self.module.load_state_dict(model, strict=True)
            self._remember_frozen(model)
            states = opt["state"] if opt else {}
            for g in range(len(self._groups)):
                steps = [int(states[s.index]["step"]) for s in self.layout.slots
                         if s.group == g and s.index in states]
                self._steps[g] = max(steps, default=0)
            for slot, lo, hi, host in shard_pieces(self.layout, self.rank):
                sl = slice(host, host + hi - lo)
                self._master[slot.group][sl] = model[slot.name].reshape(-1)[lo:hi]
                st = states.get(slot.index)
                for buf, key in ((self._exp_avg, "exp_avg"), (self._exp_avg_sq, "exp_avg_sq")):
                    buf[slot.group][sl] = st[key].reshape(-1)[lo:hi] if st else 0.0
        if opt:
            for group, saved in zip(self.optimizer.param_groups, opt["param_groups"], strict=True):
                group.update(ckpt.group_hparams(saved))
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        self._push_weights(from_master=True)

    def save_checkpoint(self, path: str | os.PathLike, *, sharded: bool = True,
                        extra: dict[str, dict] | None = None) -> None:
        """Collective. ``sharded=True``: a folder with one file per rank (plus the module's
        buffers and untrained parameters, and ``extra`` files from rank 0: name -> dict);
        ``False``: one consolidated file. Written under a temporary name and renamed, so a crash
        never leaves a checkpoint that loads half; an existing folder is replaced only if it is
        a checkpoint of this library. An error on any rank raises on every rank."""
        self._check_open()
        path = ckpt.check_name(path)
        coll = self._coll_device()
        if not sharded:
            on_zero = self.rank == 0
            error = ckpt.capture(lambda: ckpt.check_file_target(path)) if on_zero else None
            ckpt.agree(error, self.world_size, self.process_group, coll)
            full = self.full_state_dict()
            error = ckpt.capture(lambda: ckpt.atomic_save(full, path)) if on_zero else None
            ckpt.agree(error, self.world_size, self.process_group, coll)
            return
        token, error = ckpt.begin_dir(path) if self.rank == 0 else ("", None)
        token = ckpt.share_token(token, self.world_size, self.process_group, coll)
        if error is not None or not token:
            raise error or ckpt.CheckpointError(f"rank 0 could not start the checkpoint at "
                                                f"{str(path)!r} (see its error)")
        tmp = ckpt.temp_path(path, "tmp", token)
        try:
            shard = {**self.state_dict(), "module_extra": self._untrained_state()}
            error = ckpt.capture(lambda: ckpt.atomic_save(
                shard, tmp / ckpt.shard_name(self.rank, self.world_size)))
            ckpt.agree(error, self.world_size, self.process_group, coll)
            if self.rank == 0:
                error = ckpt.capture(lambda: self._publish(tmp, path, token, extra or {}))
            ckpt.agree(error, self.world_size, self.process_group, coll)
        finally:
            if self.rank == 0:
                ckpt.discard(tmp)  # left only if the save failed: nothing of it is kept

    def _publish(self, tmp: Path, path: Path, token: str, extra: dict[str, dict]) -> None:
        for name, obj in extra.items():
            ckpt.atomic_save(obj, tmp / name)
        ckpt.publish_dir(tmp, path, self.world_size, token)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Load what ``save_checkpoint`` wrote, at this or any other world size. Everything is
        read and checked (checksums, model, layout; on every rank) before anything changes."""
        self._check_open()
        loaded: list[Any] = []
        error = ckpt.capture(lambda: loaded.append(self._read_checkpoint(ckpt.resolve(path))))
        ckpt.agree(error, self.world_size, self.process_group, self._coll_device())
        kind, state = loaded[0]
        if kind == "shard":
            self.module.load_state_dict(state["module_extra"], strict=False)
            self._remember_frozen(state["module_extra"])
            self.load_state_dict(state)
        else:
            self.load_full_state_dict(state)

    def _read_checkpoint(self, path: Path) -> tuple[str, dict]:
        """``("shard", this rank's shard)`` or ``("full", full state)``, validated."""
        if not path.is_dir():
            full = ckpt.safe_load(path)
            checks.check_full(full, self)
            return "full", full
        names = self.module.state_dict(keep_vars=True)
        shards = ckpt.read_shards(path, self.rank, self.world_size)
        ckpt.validate_shards(shards, {k: (self._trained.get(id(v)), tuple(v.shape))
                                      for k, v in names.items()})
        if len(shards) == 1 and shards[0]["world_size"] == self.world_size:
            checks.check_shard(shards[0], self)
            return "shard", shards[0]
        full = ckpt.consolidate(shards)
        model = {k: full["model"][self._trained[id(v)]] if id(v) in self._trained else
                 shards[0]["module_extra"][k] for k, v in names.items()}
        full = {**full, "model": model, "scaler": shards[0]["scaler"]}
        checks.check_full(full, self)
        return "full", full

    def _coll_device(self) -> torch.device:
        return (checks.collective_device(self.process_group, self.device)
                if self.world_size > 1 else torch.device("cpu"))

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.process_group)

    # -- teardown -----------------------------------------------------------------------------
    def teardown(self, *, copy_weights_to_module: bool = True) -> None:
        """Remove hooks and free host buffers. ``copy_weights_to_module=True`` (collective when
        several ranks) gives the module back ordinary parameters holding the fp32 master weights
        and restores the original dtypes of the other tensors."""
        if self._closed:
            return
        self.synchronize()
        if self._worker is not None:
            self._worker.close()
        self._streamer.remove()
        self._input_hook.remove()
        self.module.__dict__.pop("zero_grad", None)  # nn.Module.zero_grad again
        if copy_weights_to_module:
            full = self._gather_full(self._master)
            with torch.no_grad():
                for slot in self.layout.slots:
                    flat = full[slot.group][slot.offset : slot.offset + slot.numel]
                    slot.param.data = flat.view(slot.shape).to(
                        self.device, self._orig_dtypes[id(slot.param)], copy=True
                    )
                for t in [*self.module.parameters(), *self.module.buffers()]:
                    if id(t) in self._frozen:
                        t.data = self._frozen[id(t)].to(self.device)
                    elif id(t) not in self._trained and id(t) in self._orig_dtypes:
                        t.data = t.data.to(self._orig_dtypes[id(t)])
        self._master = self._exp_avg = self._exp_avg_sq = self._grads = []
        self._out = []
        self._weights = []
        self._weights_spare = self._grads_spare = self._staging_spare = None
        self._closed = True
