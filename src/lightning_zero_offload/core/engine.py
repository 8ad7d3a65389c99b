"""``ZeroOffload``: the engine a plain PyTorch loop (or an adapter) drives.

It wires the owners (each sub-package of ``core`` says what it owns) and holds the public API.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from types import EllipsisType
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero_offload.core import checks, setup
from lightning_zero_offload.core.checkpoint import EngineState, stream
from lightning_zero_offload.core.checkpoint.pending import PendingSave
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.device.profile import PassTimer, StepProfile
from lightning_zero_offload.core.dist import collectives, fsdp
from lightning_zero_offload.core.optimizer import OffloadOptimizer, mark_stepped


class ZeroOffload:
    """ZeRO-Offload training engine (see the package README for the full contract)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 config: ZeroOffloadConfig | None = None, *, process_group: object | None = None,
                 device: torch.device | str | None = None, device_mesh: Any = None,
                 **overrides: object) -> None:
        self.config = config = checks.engine_config(config, overrides)
        self.device = checks.resolve_device(device)
        self.compute_dtype = dtype = config.compute_dtype
        pinned = checks.resolve_pinned(config.pin_memory, self.device)
        self.tp, process_group = fsdp.setup(module, device_mesh, process_group, self.device)
        self.config = config = fsdp.host_config(self.tp, module, config, self.device)
        self.rank, self.world_size = checks.rank_and_world(process_group)
        self.process_group = collectives.engine_group(process_group, config.collective_timeout_s)
        self._release_group = collectives.releaser(self, self.process_group, process_group)
        self.rule = checks.check_optimizer(optimizer)
        trainable, order, names = checks.check_params(module, optimizer)
        setup.check_unclaimed(module)
        self.module, self.inner_optimizer = module, optimizer
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        self._num_module_params = len(list(module.parameters()))
        self.layout = setup.lay_out(self._groups, trainable, order, names, config,
                                    self.world_size, self.tp, module)
        with checks.current(self.device):  # no stray CUDA context on another GPU
            self._build(module, optimizer, dtype, pinned)
        setup.claim(module, self)  # only once built: a failed setup owns nothing

    def _build(self, module: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype,
               pinned: bool) -> None:
        self._owners = o = setup.build(setup.Where(
            self.layout, module, self.config, dtype, pinned, self.rank, self.process_group,
            self.device, self.tp, self.rule))
        self._dev, self._part, self._profile, self._buckets = o.dev, o.part, o.profile, o.buckets
        self._weights, self._host, self._streamer = o.weights, o.host, o.streamer
        self._delayed, self._stepper = o.delayed, o.stepper
        self._timer = PassTimer(self._profile)
        self._hooks = setup.hook(module, self._cast_inputs, self._forward_started,
                                 self._zero_grad_with_module)
        self._calls, self._closed, self._readable = 0, False, False  # _calls: profile step no.
        self.optimizer = OffloadOptimizer(self, optimizer)
        self._state = EngineState(self.layout, self.rank, self.process_group, self._buckets,
                                  self._weights, self._stepper, module, self.optimizer.param_groups,
                                  str(self.config.precision))

    # -- forward / backward ------------------------------------------------------------------
    def _forward_started(self, *_: object) -> None:
        self._dev.compute_point()  # the forward reads the weights: their copies come first
        self._timer.forward_started()

    def _cast_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._weights.check_views()  # .half()/.float()/.to() after setup: our error, not torch's
        self._forward_started()
        return checks.cast_floats(args, self.compute_dtype), checks.cast_floats(
            kwargs, self.compute_dtype)

    @property
    def host_budget(self) -> dict[str, int]:
        """This rank's host bytes per part (the device part's) and an async save's snapshot."""
        return {**self._part.host_budget, **self._state.saves.budget()}

    @property
    def host_bytes(self) -> int:
        """Host bytes this rank's engine allocates: the sum of ``host_budget``."""
        return sum(self.host_budget.values())

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale ("16-mixed"), else None."""
        return self._stepper.scaler.scale if self._stepper.scaler is not None else None

    @property
    def last_grad_norm(self) -> float | None:
        """The global pre-clip gradient norm of the last step (None when not computed)."""
        return self._stepper.last_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` changed nothing (no gradient, or an fp16 overflow)."""
        return self._stepper.last_step_skipped

    def backward(self, loss: Tensor, *, sync_gradients: bool = True) -> None:
        """``loss.backward()`` (times the fp16 loss scale); gradients add up until ``step``;
        ``sync_gradients=False`` keeps them on the device for the next synchronizing one."""
        self._check_open()
        if self.loss_scale is not None:  # an fp16 loss times 2**16 could overflow: in fp32
            loss = loss.float() * self.loss_scale
        group = self.tp.group if self.tp is not None else self.process_group  # DTensor's, ours
        with collectives.reported("backward", group), self._streamer.backward_pass(sync_gradients):
            loss.backward()
        self._timer.backward_ended()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside skip the cross-rank reduction (gradients accumulate locally)."""
        return self._streamer.no_sync()

    # -- step ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Collective. ``torch.nn.utils.clip_grad_norm_`` over the whole model on all ranks, the
        coefficient folded into the next ``step``; returns the norm before this clip."""
        self._check_open()
        return torch.tensor(self._stepper.clip_grad_norm_(max_norm, norm_type))

    def step(self) -> Tensor | None:
        """Collective. One step over this rank's shard; the global pre-clip gradient norm (None
        when not needed). Delayed update: the CPU step runs on the worker, lands next ``step()``."""
        try:
            mark_stepped(self.optimizer)  # LR schedulers check that the optimizer stepped
            self._check_open()
            self._check_params()
            self._calls += 1
            self._timer.close(self._calls)
            self._stepper.step(self.optimizer.param_groups, self._calls, self.optimizer.hooked)
            self._state.saves.poll()  # an asynchronous save published once every rank wrote it
            if self._part.wants_move:  # "auto": once, after the first step
                self._part.move(self._buckets, self._delayed, self._streamer)
            # The caller's next work is compute-stream work: the emulated device's copies end here.
            self._dev.compute_point()
            return None if self.last_grad_norm is None else torch.tensor(self.last_grad_norm)
        except BaseException as e:  # peers stuck in a collective name this rank
            collectives.report_failure(e)
            raise

    @property
    def offload_fraction(self) -> float:
        """The share of the trained optimizer state kept on the host (``"auto"`` resolved)."""
        return self._part.resolved

    def zero_grad(self, set_to_none: bool = True) -> None:  # False: keep zero grads, as torch
        self._check_open()
        self._streamer.reset(set_to_none)

    def _zero_grad_with_module(self, set_to_none: bool = True) -> None:
        self.zero_grad(set_to_none)
        nn.Module.zero_grad(self.module, set_to_none)

    def synchronize(self) -> None:
        """Local (never a collective): wait for the delayed CPU step and every transfer. The
        module's weights then hold every step with one rank; with several, after the next
        collective call (``step``, ``gather_weights``, saves, loads, ``teardown``)."""
        self._check_open()
        # the delayed update lands with one rank (with several that is a collective)
        (self._delayed.land if self.world_size == 1 else self._delayed.join)()
        self._streamer.drain()
        self._dev.synchronize()

    def gather_weights(self) -> None:
        """Collective: the module's weights include every step (for validation on all ranks)."""
        self._check_open()
        self._delayed.land()  # collective with several ranks
        self.synchronize()  # the copies it started

    @property
    def torn_down(self) -> bool:
        """Whether ``teardown()`` ran (only a kept state can still be read and saved)."""
        return getattr(self, "_closed", True)

    @property
    def profile(self) -> list[StepProfile]:
        """Timings of the recent landed steps (``device.profile.StepProfile``), oldest first."""
        return self._profile.records

    @property
    def last_profile(self) -> StepProfile | None:
        """The newest landed step's timings; on CUDA waits for its weight copies."""
        return (self._profile.records or [None])[-1]

    def finished_profile(self) -> StepProfile | None:
        """The newest step with all timings in, never waiting (CUDA: maybe before last_profile)."""
        return (self._profile.finished() or [None])[-1]

    def _check_readable(self) -> bool:
        """Whether only the kept state is left (``teardown(keep_state=True)``)."""
        if self._closed and not self._readable:
            self._check_open()
        return self._closed

    def _check_open(self) -> None:
        checks.check_open(self._closed)

    def _check_params(self) -> None:
        checks.check_unchanged(self.optimizer.param_groups, self._groups, self.module,
                               self._num_module_params)
        self._weights.check_views()

    # -- state --------------------------------------------------------------------------------
    def _load(self, load: Callable[[Any], None], source: object) -> None:
        """Collective: every step lands, ``load(source)`` fills the host state, then the weights."""
        self.gather_weights()
        load(source)
        self._weights.push_all([bucket.shard.master for bucket in self._buckets])
        self._dev.compute_point()

    def state_dict(self) -> dict:
        """Local. This rank's shard; its tensors are the live buffers (as torch's are)."""
        if not self._check_readable():
            self.synchronize()
        return self._state.shard()

    def load_state_dict(self, state: dict) -> None:
        """Collective. Resume from this rank's ``state_dict()`` (same world size and model)."""
        self._load(self._state.load_shard, state)

    def full_state_dict(self, *, model: bool = True, optimizer: bool = True) -> dict:
        """Collective. ``{"model": fp32 state_dict, "optimizer": torch AdamW format}`` for a plain
        model, ``torch.optim.AdamW`` or an engine of any world size; ``optimizer=False`` or
        ``model=False`` leaves that part out and does not gather it."""
        return stream.materialize(self.consolidated(model=model, optimizer=optimizer))

    def consolidated(self, *, model: bool = True, optimizer: bool = True) -> dict:
        """``full_state_dict()`` with stand-ins, each made only as :meth:`save_file` writes it."""
        if not self._check_readable():
            self.gather_weights()
        return self._state.full_later(model=model, optimizer=optimizer)

    def save_file(self, obj: dict, path: str | os.PathLike,
                  blocking: bool = True) -> PendingSave | None:
        """Collective. ``obj`` (with :meth:`consolidated`'s stand-ins) as one checksummed file."""
        return self._state.save_file(obj, path, blocking or self._closed, owner=self)

    def load_full_state_dict(self, state: dict) -> None:
        """Collective. The consolidated form (any world size) or plain model/AdamW states."""
        self._load(self._state.load_full, state)

    def save_checkpoint(self, path: str | os.PathLike, *, sharded: bool = True,
                        extra: dict[str, dict] | None = None,
                        blocking: bool = True) -> PendingSave | None:
        """Collective. ``sharded=True``: a folder of one file per rank; ``False``: one
        consolidated file; ``extra``: more files rank 0 writes into the folder. Renamed into
        place once written, replacing only an empty folder or one of ours. ``blocking=False``:
        returns once the state is copied to host memory (a handle with ``wait()``, ``done()``;
        None: no room for the copy, saved blocking), published once every rank wrote it."""
        if not self._check_readable():
            self.gather_weights()
        return self._state.save(path, sharded=sharded, extra=extra, owner=self,
                                blocking=blocking or self._closed)  # torn down: none settles it

    def wait_for_save(self) -> None:
        """Collective: a save in flight (``blocking=False``) ends, published or raising."""
        self._state.saves.settle()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Collective. Load what ``save_checkpoint`` wrote, at this or any other world size."""
        self._load(self._state.load, path)

    # -- teardown -----------------------------------------------------------------------------
    def teardown(self, *, copy_weights_to_module: bool = True, keep_state: bool = False,
                 device: torch.device | str | None = None,
                 failure: BaseException | None | EllipsisType = ...) -> None:
        """Remove hooks, free buffers. ``copy_weights_to_module`` (collective): ordinary fp32
        parameters (on ``device``, default the compute device), other tensors' dtypes restored.
        ``keep_state``: the state can still be read and saved. ``failure``: the error ending the
        run, or None (default: the one handled here); then no collective starts, peers time out."""
        if self._closed:
            return
        error, broken = (sys.exc_info()[1] if failure is ... else failure), None
        if error is not None:
            collectives.report_failure(error)
            copy_weights_to_module &= self.world_size == 1
        try:  # a save in flight ends first (a failed run drops it, no collective)
            (self._state.saves.close if error is None else self._state.saves.abandon)()
            self.gather_weights() if copy_weights_to_module else self.synchronize()
        except Exception as e:
            broken = e
            if error is None:  # raised once everything is released (no news if one propagates)
                copy_weights_to_module = keep_state = False
        self._readable = keep_state and (copy_weights_to_module or self.world_size == 1)
        restore = ((lambda: self._weights.restore(self._state.gather_full(self._state.masters()),
                                                  device)) if copy_weights_to_module else None)
        lost = setup.release(self._owners, self._hooks, self.module, drain=broken is None,
                             restore=restore, keep_host=self._readable,
                             release_group=self._release_group)
        self._closed = True
        collectives.raise_unless_failing(broken or lost, error)
