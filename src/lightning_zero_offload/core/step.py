"""The optimizer step: its decision (global norm, clip coefficient, loss scale, hyperparameters)
and the fused kernel over this rank's shard.

``decide`` runs on the caller's thread and settles everything that needs all ranks or the
user's live state, including which parameters got a gradient on any rank: as torch's AdamW, the
step leaves the others untouched (no decay, no moment update) and counts steps per parameter.
``run_kernel`` only runs the kernel, chunk by chunk (a chunk is a bucket's shard, cut where
parameters skip), each finished chunk's weights queued for the device while the next computes;
it may run on the delayed-update worker, so it issues no collective unless told to (``gather``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero_offload.core import checks, collectives
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.host import HostBuffers
from lightning_zero_offload.core.layout import Layout, shard_align
from lightning_zero_offload.core.profile import ProfileRecorder
from lightning_zero_offload.core.scaler import DynamicLossScaler
from lightning_zero_offload.core.streaming import GradStreamer
from lightning_zero_offload.core.weights import DeviceWeights
from lightning_zero_offload.ops import fused_adamw_

Run = tuple[int, int, int]  # (begin, end, step): a range of a bucket shard stepped as one call


@dataclass
class StepPlan:
    """Everything the kernel needs, fixed at decision time."""

    grad_scale: float
    hparams: list[dict]  # per group: lr, betas, eps, weight_decay, decoupled
    runs: list[list[Run]]  # per bucket, ascending; the ranges between runs are left untouched


def _pieces(layout: Layout, rank: int, align: int) -> list[list[tuple[int, int, int]]]:
    """Per bucket, ``(slot, begin, end)`` of every parameter on this rank's shard of it, in
    offset order, relative to the shard; ``end`` includes the padding up to the next multiple of
    ``align`` (parameters start on one; int8 moments cut only at block boundaries)."""
    out: list[list[tuple[int, int, int]]] = []
    for bucket in layout.buckets:
        a, z = bucket.shard_range(rank)
        mine = []
        for i in sorted(bucket.slots, key=lambda i: layout.slots[i].offset):
            s = layout.slots[i]
            lo, hi = max(s.offset, a), min(s.offset + s.numel, z)
            if lo < hi:
                mine.append((i, lo - a, min(-(-hi // align) * align, z) - a))
        out.append(mine)
    return out


class Stepper:
    """Owns the step counts, the pending clip coefficient and the fp16 loss scaler."""

    def __init__(self, layout: Layout, host: HostBuffers, weights: DeviceWeights,
                 streamer: GradStreamer, config: ZeroOffloadConfig, *, decoupled: bool,
                 rank: int, process_group: object | None, threads: int, out_direct: bool,
                 profile: ProfileRecorder) -> None:
        self.layout, self.host, self.weights, self.streamer = layout, host, weights, streamer
        self.config, self.decoupled, self.rank, self.group = config, decoupled, rank, process_group
        self.world_size = layout.world_size
        self.threads, self.out_direct, self.profile = threads, out_direct, profile
        self.steps = [0] * len(layout.group_numel)  # steps taken, per group
        self.param_steps = [0] * len(layout.slots)  # steps with a gradient, per parameter
        self._pieces = _pieces(layout, rank, shard_align(host.moment_dtype))
        self.scaler = (DynamicLossScaler(config.initial_loss_scale,
                                         config.loss_scale_growth_interval)
                       if config.precision == "16-mixed" else None)
        self._clip_coef = 1.0
        self._clip_norm: float | None = None
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False

    # -- the decision -------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> float:
        """Fold a clip into the next step; the norm before this clip (0.0 without gradients)."""
        if not self.streamer.finish():
            return 0.0
        raw = self.global_norm(float(norm_type))
        if self._clip_norm is None:
            self._clip_norm = raw
        current = raw * self._clip_coef
        self._clip_coef *= checks.clip_coef(float(max_norm), current)
        return current

    def global_norm(self, norm_type: float) -> float:
        """The norm of the whole gradient over all ranks (collective), unscaled."""
        local = self.streamer.local_sq_sum() if norm_type == 2.0 else None
        if local is None:
            parts = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
                     for g in self.streamer.sources() if g.numel()]
            if not parts:
                local = torch.tensor(0.0)
            elif math.isinf(norm_type):
                local = torch.stack(parts).max()
            else:
                local = torch.stack(parts).double().pow(norm_type).sum()
        local = local.double()
        if self.world_size > 1:
            local = local.to(checks.collective_device(self.group, self.weights.dev.device))
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            collectives.all_reduce(local, op, self.group, "all-reduce of the gradient norm")
        total = local.item()
        if not math.isinf(norm_type):
            total = total ** (1.0 / norm_type)
        return total / (self.world_size * (self.scaler.scale if self.scaler else 1.0))

    def decide(self, param_groups: list[dict], step: int) -> StepPlan | None:
        """Wait for the gradients and settle the step; None when it is skipped (no gradient
        since ``zero_grad``, or an fp16 overflow)."""
        checks.check_hparams(param_groups)
        coef, norm = self._clip_coef, self._clip_norm
        self._clip_coef, self._clip_norm = 1.0, None
        self.last_grad_norm, self.last_step_skipped = None, True
        with self.profile.span("grad_wait", step):
            arrived = self.streamer.finish()
        if not arrived:
            return None  # like torch: nothing to do
        if norm is None and (self.config.max_grad_norm or self.scaler is not None):
            norm = self.global_norm(2.0)
        self.last_grad_norm = norm
        if self.config.max_grad_norm:
            assert norm is not None
            coef *= checks.clip_coef(self.config.max_grad_norm, norm * coef)
        scale = 1.0
        if self.scaler is not None:
            assert norm is not None
            scale = self.scaler.scale
            overflow = not math.isfinite(norm)
            self.scaler.update(overflow)
            if overflow:
                return None
        self.last_step_skipped = False
        had = self._had_grad()
        for i, h in enumerate(had):
            self.param_steps[i] += h
        hparams = []
        for g, group in enumerate(param_groups):
            self.steps[g] += 1
            hparams.append({
                "lr": float(group["lr"]),
                "betas": (float(group["betas"][0]), float(group["betas"][1])),
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                "decoupled": self.decoupled or bool(group.get("decoupled_weight_decay", False)),
            })
        return StepPlan(coef / (self.world_size * scale), hparams,
                        [self._runs(b, had) for b in range(len(self.layout.buckets))])

    def _had_grad(self) -> list[bool]:
        """Per parameter, whether a gradient arrived on any rank since ``zero_grad`` (a
        collective with several ranks: DDP also steps a parameter used on one rank only)."""
        had = self.streamer.had_grad
        if self.world_size == 1:
            return list(had)
        flags = torch.tensor(had, dtype=torch.uint8).to(
            checks.collective_device(self.group, self.weights.dev.device))
        collectives.all_reduce(flags, dist.ReduceOp.MAX, self.group,
                               "all-reduce of which parameters got a gradient")
        return [bool(f) for f in flags.tolist()]

    def _runs(self, b: int, had: list[bool]) -> list[Run]:
        """Bucket ``b``'s shard as kernel calls: maximal ranges of adjacent parameters that got
        a gradient and share a step count (the whole shard, padding too, in the usual case)."""
        runs: list[Run] = []
        adjacent = False
        for i, lo, hi in self._pieces[b]:
            if not had[i]:
                adjacent = False
                continue
            step = self.param_steps[i]
            if adjacent and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], hi, step)
            else:
                runs.append((lo, hi, step))
            adjacent = True
        pieces = self._pieces[b]
        if len(runs) == 1 and runs[0][:2] == (pieces[0][1], pieces[-1][2]):  # every piece
            runs = [(0, self.layout.buckets[b].shard, runs[0][2])]
        return runs

    # -- the kernel ---------------------------------------------------------------------------
    def run_kernel(self, plan: StepPlan, sources: list[Tensor], step: int,
                   target: list[Tensor], gather: bool) -> None:
        """The fused kernel over this rank's shard into ``target`` (the live weights, or the
        spare ones on the delayed worker). ``gather``: all-gather each bucket as it is done
        (only on the caller's thread)."""
        weights = self.weights
        weights.wait_copies_read()  # the last push's copies have read the buffers rewritten here
        try:
            with self.profile.span("cpu_step", step):
                for b, bucket in enumerate(self.layout.buckets):
                    hp = plan.hparams[bucket.group]
                    master, moments = self.host.state(b)
                    lo, hi = bucket.shard_range(self.rank)
                    out = target[bucket.group][lo:hi] if self.out_direct else self.host.out(b)
                    done = 0
                    for begin, end, step in plan.runs[b]:
                        self._untouched(master, out, done, begin)
                        sl = slice(begin, end)
                        fused_adamw_(master[sl], sources[b][sl], grad_scale=plan.grad_scale,
                                     out=None if out is None else out[sl],
                                     num_threads=self.threads, seed=self.config.moment_seed,
                                     step=step, **moments.chunk(begin, end - begin).kernel_args(),
                                     **hp)
                        done = end
                    self._untouched(master, out, done, bucket.shard)
                    if not self.out_direct:
                        weights.copy_shard(b, master if out is None else out, target)
                    if gather and self.world_size > 1:
                        weights.gather(b, target)
            weights.end_copies(step)
        except BaseException:
            weights.abandon_push()
            raise
        self.streamer.consumed(sources)

    @staticmethod
    def _untouched(master: Tensor, out: Tensor | None, begin: int, end: int) -> None:
        """A range the kernel skips: its half weights, which ``out`` (staging, or the spare
        weights of the delayed update) may hold stale, are the master's again."""
        if out is not None and begin < end:
            out[begin:end].copy_(master[begin:end])
