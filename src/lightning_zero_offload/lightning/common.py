"""What the Trainer and the Fabric strategies share: options, the engine's life cycle, the
starting weights, the scheduler hand-over and registration.

As in Lightning itself, the Trainer side builds on the Fabric side: this module imports only
``lightning.fabric`` (and the engine), and both ``strategy.py`` and ``fabric.py`` import it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import EllipsisType

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from lightning_zero_offload.config_env import build_config
from lightning_zero_offload.core import ZeroOffload, ZeroOffloadConfig
from lightning_zero_offload.core.dist.collectives import collective_device
from lightning_zero_offload.core.optimizer import OffloadOptimizer, mark_stepped
from lightning_zero_offload.core.rules.rules import supported

Scheduler = LRScheduler | ReduceLROnPlateau


def strategy_config(config: ZeroOffloadConfig | None, overrides: dict[str, object],
                    who: str = "ZeroOffloadStrategy") -> ZeroOffloadConfig:
    """The strategy's config: ``config`` (or defaults) with keyword shortcuts applied; a
    shortcut equal to the field's default leaves ``config``'s value (signature readers such as
    jsonargparse pass every parameter).

    ``precision`` is not a shortcut: the Trainer's or Fabric's ``precision=`` chooses it, so
    there is one place to set it.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(ZeroOffloadConfig)}
    overrides = {k: v for k, v in overrides.items()
                 if k not in defaults or v is not defaults[k] and v != defaults[k]}
    if "precision" in overrides:
        raise TypeError(
            f"{who}(precision=...) is not an option: set the precision on the "
            "Trainer or Fabric, e.g. Trainer(strategy='zero_offload', precision='bf16-mixed')"
        )
    return build_config(config, overrides, who=who, where=f"the {who} arguments")


def norm_clipping_only(fix: str) -> ValueError:
    """The error for any clipping but by the global norm; ``fix`` says what to call instead."""
    return ValueError(
        "ZeroOffloadStrategy clips by the global gradient norm only: the gradients live "
        f"partitioned on the host and are scaled inside the CPU step. {fix}"
    )


def check_clip_algorithm(algorithm: object) -> None:
    """The Trainer's ``gradient_clip_algorithm`` (``None`` means the default, norm)."""
    if algorithm not in (None, "norm"):
        raise norm_clipping_only("Use gradient_clip_algorithm='norm'")


def single_optimizer(optimizers: Sequence[Optimizer]) -> Optimizer:
    """The one optimizer the engine takes over (its kind is checked by the engine)."""
    if len(optimizers) != 1:
        raise ValueError(
            f"ZeroOffloadStrategy needs exactly one optimizer ({supported()}) from "
            f"configure_optimizers, got {len(optimizers)}: one engine keeps one optimizer's state "
            "(fp32 master weights and moments) on the host, and its CPU step is one fused update "
            "of that optimizer over those parameters. For a module with several optimizers (a "
            "GAN's generator and discriminator) use strategy=\"auto\" (or another strategy) for "
            "that module; if the optimizers differ only in hyperparameters (lr, betas, "
            "weight_decay) and step together, return one optimizer with a parameter group for "
            "each"
        )
    return optimizers[0]


def broadcast_start_weights(module: Module, device: torch.device) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP's wrapper ensures at its start.

    The module may still be on the host (the engine moves it later); a backend that only
    talks between devices (NCCL) gets each tensor through ``device`` one at a time. A DTensor
    (``parallelize_module``, ``fully_shard``) is each rank's own piece: it stays, as under
    ``ModelParallelStrategy``.
    """
    if not _distributed_is_initialized() or dist.get_world_size() < 2:
        return
    wire = collective_device(dist.group.WORLD, device)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if isinstance(tensor, DTensor):
            continue
        data = tensor.data
        sent = data.to(wire)
        dist.broadcast(sent, src=0)
        if sent is not data:
            data.copy_(sent)


class EngineOwner:
    """The engine state of a strategy (a base placed before ``DDPStrategy``)."""

    config: ZeroOffloadConfig
    sharded_checkpoint: bool
    engine: ZeroOffload | None

    def _init_engine_owner(self, config: ZeroOffloadConfig | None, sharded_checkpoint: bool,
                           overrides: dict[str, object], async_checkpoint: bool = False) -> None:
        self.config = strategy_config(config, overrides, who=self._front_end)
        self.sharded_checkpoint, self.async_checkpoint = sharded_checkpoint, async_checkpoint
        self.engine = None
        self.finished_engine: ZeroOffload | None = None  # torn down, its state kept for saving

    @property
    def _front_end(self) -> str:
        """The name errors give this strategy (Lightning's or Fabric's)."""
        from lightning.fabric.strategies.strategy import Strategy as FabricStrategy

        fabric = isinstance(self, FabricStrategy)
        return "ZeroOffloadFabricStrategy" if fabric else "ZeroOffloadStrategy"

    def process_group_timeout(self, timeout: timedelta | None) -> timedelta:
        """The timeout of a process group the strategy starts: ``timeout``, else the engine's
        ``collective_timeout_s`` (the framework's own collectives, e.g. Lightning's per-batch
        broadcast, would otherwise keep the peers of a failed rank for 30 minutes)."""
        if timeout is not None:
            return timeout
        return timedelta(seconds=self.config.collective_timeout_s)

    @property
    def offload_fraction(self) -> float | str:
        """The share of the trained optimizer state on the host: the engine's, resolved (kept
        after ``fit``), else the configured value."""
        engine = self.saving_engine
        return engine.offload_fraction if engine is not None else self.config.offload_fraction

    @property
    def saving_engine(self) -> ZeroOffload | None:
        """The engine whose state a checkpoint holds: the live one, or the one fit finished."""
        return self.engine if self.engine is not None else self.finished_engine

    def _start_engine(self, module: Module, optimizers: Sequence[Optimizer], precision: str,
                      source: str, device: torch.device, accumulate_steps: int | None = None
                      ) -> tuple[Optimizer, ZeroOffload]:
        """Build the engine over ``module`` and its one optimizer; returns the user's
        optimizer and the engine. ``source`` names the framework's precision setting;
        ``accumulate_steps`` the framework's backward passes per step (None: it has none)."""
        if self.engine is not None:
            raise RuntimeError(
                "ZeroOffloadStrategy manages one model and optimizer; it already has an engine "
                "(fabric.setup() with an optimizer was already called)"
            )
        optimizer = single_optimizer(optimizers)
        _refuse_async_io(getattr(self, "checkpoint_io", None))
        self.finished_engine = None  # a new run: the previous one's kept state goes
        # the strategy reports the precision in use (config.precision) from here on
        self.config = config = self.config.resolve_precision(precision, source=source)
        process_group = dist.group.WORLD if _distributed_is_initialized() else None
        mesh = getattr(self, "device_mesh", None)  # tensor parallelism: the groups of the mesh
        # not kept in self.config: the next fit may accumulate differently
        self.engine = ZeroOffload(module, optimizer, config.resolve_accumulate(accumulate_steps),
                                  process_group=process_group if mesh is None else None,
                                  device=device, device_mesh=mesh)
        return optimizer, self.engine

    def wait_for_save(self) -> None:
        """Collective: the asynchronous save in flight (``async_checkpoint=True``), if any, is
        published, or raises on every rank. Loads, ``teardown`` and the next save wait for it
        themselves; a script that ends first has it published at exit."""
        if self.saving_engine is not None:
            self.saving_engine.wait_for_save()

    def remove_checkpoint(self, filepath: object) -> None:
        """``ModelCheckpoint`` replacing an older file: after the save in flight (collective)."""
        self.wait_for_save()
        super().remove_checkpoint(filepath)  # type: ignore[misc]

    def _stop_engine(self, failure: BaseException | None | EllipsisType = ...) -> None:
        """Collective: the engine's fp32 master weights go back into the module; its host state
        is kept for a save after training (``trainer.save_checkpoint`` once ``fit`` returned).
        ``failure``: the error ending the run (see ``ZeroOffload.teardown``)."""
        if self.engine is not None:
            self.engine.teardown(copy_weights_to_module=True, keep_state=True, failure=failure)
            self.finished_engine, self.engine = self.engine, None


def _refuse_async_io(checkpoint_io: object) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if isinstance(checkpoint_io, AsyncCheckpointIO):
        raise ValueError(
            "zero_offload: Lightning's AsyncCheckpointIO clones every tensor of a checkpoint on "
            "the training thread, a whole second copy of the optimizer state that nothing checks "
            "against host memory. Remove the plugin and use ZeroOffloadStrategy("
            "async_checkpoint=True) (Fabric: ZeroOffloadFabricStrategy(async_checkpoint=True)), "
            "which copies the state only where host memory allows it")


def with_config_fields(init: Callable[..., None]) -> Callable[..., None]:
    """``init``'s signature with every ``ZeroOffloadConfig`` field as a keyword-only parameter
    in place of ``**config_overrides``: tools that read signatures (LightningCLI's jsonargparse)
    then accept ``init_args: {delayed_update: true}``, the same as the keyword shortcut."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    hints = {f.name: f.type for f in dataclasses.fields(ZeroOffloadConfig)}
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                 annotation=hints[f.name])
               for f in dataclasses.fields(ZeroOffloadConfig) if f.name != "precision"]
    init.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return init



def retarget_scheduler(scheduler: Scheduler, user_optimizer: Optimizer,
                       facade: OffloadOptimizer) -> None:
    """Point an LR scheduler at the engine's optimizer (same group dicts, so nothing moves).

    Lightning and ``LearningRateMonitor`` then see one optimizer, not the user's idle AdamW
    next to the engine's. The step-tracking mark torch's scheduler put on the user's optimizer
    is carried over, so the scheduler does not warn that ``optimizer.step()`` was never called.
    """
    if getattr(scheduler, "optimizer", None) is not user_optimizer:
        raise ValueError(
            "ZeroOffloadStrategy: an LR scheduler from configure_optimizers is attached to "
            "another optimizer than the one returned with it"
        )
    scheduler.optimizer = facade
    mark_stepped(facade)
    step: Callable[..., object] = facade.step
    if not hasattr(step, "_wrapped_by_lr_sched"):

        @functools.wraps(step)
        def tracked_step(*args: object, **kwargs: object) -> object:
            return step(*args, **kwargs)

        tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        facade.step = tracked_step  # type: ignore[method-assign]
