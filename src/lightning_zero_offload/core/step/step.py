"""The optimizer step: its decision (global norm, clip coefficient, loss scale, hyperparameters),
then the update rule over this rank's shard.

``Stepper.step`` is one whole step, from the engine's ``step()`` down to the kernel and back:
``decide`` (on the caller's thread) settles everything that needs all ranks or the user's live
state, including which parameters got a gradient on any rank: as torch's AdamW, the step leaves
the others untouched (no decay, no moment update) and counts steps per parameter. The previous
delayed update lands, then ``core.step.update.HostUpdate`` runs here, on the core-bound worker, or
(delayed update, ``core.step.delayed``) on the worker while the caller goes on. The step owns its
counters (steps per group and per parameter, the loss scaler) and their ``state_dict``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_zero_offload.core.buckets.buckets import Bucket, Buckets
from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.buckets.shard import Run
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.device.profile import ProfileRecorder
from lightning_zero_offload.core.dist import collectives
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.core.step.delayed import DelayedUpdate
from lightning_zero_offload.core.step.overlap import OverlappedStep
from lightning_zero_offload.core.step.scaler import DynamicLossScaler
from lightning_zero_offload.core.step.update import DeviceUpdate, StepPlan, SyncUpdate
from lightning_zero_offload.core.transfer.grads import Grads
from lightning_zero_offload.core.transfer.streaming import GradStreamer

logger = logging.getLogger(__name__)
Hooks = Callable[[Callable[[], None]], None]  # runs an update between step hooks


def _no_hooks(update: Callable[[], None]) -> None:
    update()


def clip_coef(max_norm: float, norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient (NaN stays NaN, as there)."""
    coef = max_norm / (norm + 1e-6)
    return 1.0 if coef >= 1.0 else coef


class Stepper:
    """Owns the step counts, the pending clip coefficient and the fp16 loss scaler."""

    def __init__(self, layout: Layout, buckets: Buckets, streamer: GradStreamer,
                 device_update: DeviceUpdate,
                 sync: SyncUpdate | OverlappedStep, delayed: DelayedUpdate | OverlappedStep,
                 config: ZeroOffloadConfig, *,
                 rule: Rule, rank: int, process_group: object | None,
                 device: torch.device, profile: ProfileRecorder) -> None:
        self.layout, self.buckets, self.streamer = layout, buckets, streamer
        self.device_update, self.sync, self.delayed = device_update, sync, delayed  # the parts
        self.config, self.rule, self.rank, self.group = config, rule, rank, process_group
        self.world_size, self.device, self.profile = layout.world_size, device, profile
        self.steps = [0] * len(layout.group_numel)  # steps taken, per group
        self.param_steps = [0] * len(layout.slots)  # steps with a gradient, per parameter
        self.scaler = (DynamicLossScaler(config.initial_loss_scale,
                                         config.loss_scale_growth_interval)
                       if config.precision == "16-mixed" else None)
        self._clip_coef = 1.0
        self._clip_norm: float | None = None
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self._told_warmup = False  # the delayed update's warm-up is logged once

    # -- the decision -------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> float:
        """Fold a clip into the next step; the norm before this clip (0.0 without gradients)."""
        grads = self.streamer.finish()
        if grads is None:
            return 0.0
        raw = self.global_norm(float(norm_type), grads)
        if self._clip_norm is None:
            self._clip_norm = raw
        current = raw * self._clip_coef
        self._clip_coef *= clip_coef(float(max_norm), current)
        return current

    def global_norm(self, norm_type: float, grads: Grads) -> float:
        """The norm of the whole gradient over all ranks (collective), unscaled."""
        tp = self.layout.tp  # tensor parallelism: what every TP rank holds counts once
        fast = norm_type == 2.0 and (tp is None or tp.counts_all)  # the device statistics
        local = grads.sq_sum if fast else None
        if local is None:
            shards = grads.sources
            parts = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).cpu()
                     for g in (tp.counted(self.layout, shards, self.rank) if tp else shards)
                     if g.numel()]
            if not parts:
                local = torch.tensor(0.0)
            elif math.isinf(norm_type):
                local = torch.stack(parts).max()
            else:
                local = torch.stack(parts).double().pow(norm_type).sum()
        local = local.double()
        if self.world_size > 1:
            local = local.to(collectives.collective_device(self.group, self.device))
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            collectives.all_reduce(local, op, self.group, "all-reduce of the gradient norm")
        if tp is not None and tp.size > 1:
            local = tp.reduce_norm(local, dist.ReduceOp.MAX if math.isinf(norm_type) else
                                   dist.ReduceOp.SUM)
        total = local.item()
        if not math.isinf(norm_type):
            total = total ** (1.0 / norm_type)
        return total / (self.world_size * (self.scaler.scale if self.scaler else 1.0))

    def decide(self, param_groups: list[dict], step: int) -> StepPlan | None:
        """Wait for the gradients and settle the step; None when it is skipped (no gradient
        since ``zero_grad``, or an fp16 overflow)."""
        self.rule.check_hparams(param_groups)
        coef, norm = self._clip_coef, self._clip_norm
        self._clip_coef, self._clip_norm = 1.0, None
        self.last_grad_norm, self.last_step_skipped = None, True
        with self.profile.span("grad_wait", step):
            grads = self.streamer.finish(next_step=step + 1)
        if grads is None:
            return None  # like torch: nothing to do
        if norm is None and (self.config.max_grad_norm or self.scaler is not None):
            norm = self.global_norm(2.0, grads)
        self.last_grad_norm = norm
        if self.config.max_grad_norm:
            assert norm is not None
            coef *= clip_coef(self.config.max_grad_norm, norm * coef)
        scale = 1.0
        if self.scaler is not None:
            assert norm is not None
            scale = self.scaler.scale
            overflow = not math.isfinite(norm)
            self.scaler.update(overflow)
            if overflow:
                return None
        self.last_step_skipped = False
        had = self._had_grad(grads)
        for i, h in enumerate(had):
            self.param_steps[i] += h
        for g in range(len(param_groups)):
            self.steps[g] += 1
        hparams = [self.rule.hyper(group) for group in param_groups]
        return StepPlan(self.rule, coef / (self.world_size * scale), hparams,
                        [self._runs(bucket, had) for bucket in self.buckets], grads)

    def _had_grad(self, grads: Grads) -> list[bool]:
        """Per parameter, whether a gradient arrived on any rank since ``zero_grad`` (a
        collective with several ranks: DDP also steps a parameter used on one rank only)."""
        had = grads.had_grad
        if self.world_size == 1:
            return list(had)
        flags = torch.tensor(had, dtype=torch.uint8).to(
            collectives.collective_device(self.group, self.device))
        collectives.all_reduce(flags, dist.ReduceOp.MAX, self.group,
                               "all-reduce of which parameters got a gradient")
        return [bool(f) for f in flags.tolist()]

    def _runs(self, bucket: Bucket, had: list[bool]) -> list[Run]:
        """``bucket``'s shard as kernel calls: maximal ranges of adjacent parameters that got
        a gradient and share a step count (the whole shard, padding too, in the usual case);
        one per parameter where the master is FSDP2's host shards (``offload_weights``)."""
        runs: list[Run] = []
        adjacent = False
        pieces = bucket.pieces
        per_param = bool(self.config.offload_weights)
        for piece in pieces:
            if not had[piece.slot]:
                adjacent = False
                continue
            step = self.param_steps[piece.slot]
            if adjacent and runs[-1][2] == step and not per_param:
                runs[-1] = (runs[-1][0], piece.end, step)
            else:
                runs.append((piece.begin, piece.end, step))
            adjacent = True
        if (len(runs) == 1 and runs[0][:2] == (pieces[0].begin, pieces[-1].end)  # every piece
                and not per_param):
            runs = [(0, bucket.numel, runs[0][2])]
        return runs

    # -- the step ---------------------------------------------------------------------------
    def step(self, param_groups: list[dict], k: int, hooks: Hooks = _no_hooks) -> None:
        """Step ``k`` (collective), in one line: decide, land step k-1's delayed update, the
        device part (its own span, device_step), then the host part where it runs: here or on
        the core-bound worker (``update.SyncUpdate``), or, under delayed update past its
        warm-up, on the worker into the spare weights (they land at the next collective call).

        ``hooks`` runs the update between the optimizers' step hooks, as ``optimizer.step()``
        would, except on an fp16 overflow, where torch's ``GradScaler`` skips ``step()``."""
        plan = self.decide(param_groups, k)
        self.delayed.land()  # step k-1's update lands now, before step k+1's forward
        if plan is None:
            self.profile.close(k)
            if self.last_grad_norm is None:  # no gradient (not an overflow): torch steps too
                hooks(lambda: None)
            return

        def update() -> None:
            # a pre hook may have changed the hyperparameters; torch's step would use them
            self.rule.check_hparams(param_groups)
            plan.hparams[:] = [self.rule.hyper(group) for group in param_groups]
            host_part = self.delayed if self._delays() else self.sync
            self.device_update.run(plan, host_part.targets(), k)
            host_part.run(k, plan)

        hooks(update)

    def _delays(self) -> bool:
        """Whether this step's host part runs delayed (past the warm-up, said once before)."""
        cfg = self.config
        if not cfg.delayed_update or self.steps[0] > cfg.delayed_update_warmup:
            return cfg.delayed_update
        if not self._told_warmup and self.rank == 0:
            self._told_warmup = True  # a run shorter than the warm-up would never overlap
            w = cfg.delayed_update_warmup
            logger.warning("delayed update starts after %d warm-up steps "
                           "(delayed_update_warmup=%d); until then each step runs "
                           "synchronously", w, w)
        return False

    # -- the counters a checkpoint keeps --------------------------------------------------------
    def state_dict(self) -> dict:
        """Steps per group and per parameter (layout order), the loss scaler's state."""
        return {"steps": list(self.steps), "param_steps": list(self.param_steps),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """The counters from :meth:`state_dict` (a saved scaler only where this step has one)."""
        self.steps[:] = [int(n) for n in state["steps"]]
        self.param_steps[:] = [int(n) for n in state["param_steps"]]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
