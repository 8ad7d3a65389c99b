"""transformers ``Trainer`` integration: ``ZeroOffloadTrainer`` and ``ZeroOffloadMixin``.

``ZeroOffloadTrainer(model=..., args=ZeroOffloadTrainingArguments(..., zero_offload=True))``
trains with the engine; so does any ``Trainer`` built with ``ZERO_OFFLOAD=1`` in the environment.
The mixin composes with other trainers: ``class OffloadSFTTrainer(ZeroOffloadMixin, SFTTrainer)``.

The Trainer's own loop stays: the optimizer it creates (``torch.optim.AdamW``/``Adam`` for the
``adamw_torch*`` optims; others per ``transformers.optim``) is handed to the engine right after
``create_optimizer``, together with the model, through
:class:`~lightning_zero_offload.accelerate.ZeroOffloadPlugin` on the Trainer's accelerator, so
backward, ``max_grad_norm`` clipping and the logged ``grad_norm`` go through the
engine. Precision follows ``bf16``/``fp16`` (neither: fp32). Checkpoints keep the Trainer's layout
plus a ``zero_offload/`` folder with one optimizer shard per rank; ``save_model`` writes the fp32
master weights. With the Trainer's FSDP2 (``fsdp="full_shard"``, ``fsdp_config`` with
``fsdp_version`` 2) Accelerate shards the model as usual and the engine steps each rank's shards;
with ``fsdp="full_shard offload"`` the shards live on the host and the engine steps them in place.
Not supported (each raises): DeepSpeed, FSDP1, several GPUs in one process
(``DataParallel``), optimizers the engine has no rule for, ``max_grad_norm`` inside the
ZeRO-Offload options (use ``TrainingArguments.max_grad_norm``), resuming a checkpoint saved
without ZeRO-Offload.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Any

from lightning_zero_offload._extras import require_extra

require_extra("lightning_zero_offload.transformers", "transformers", "transformers", "accelerate")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim.lr_scheduler import LRScheduler  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer import SCHEDULER_NAME  # noqa: E402
from typing_extensions import override  # noqa: E402

from lightning_zero_offload.accelerate import (  # noqa: E402
    ZeroOffloadAcceleratedOptimizer,
    ZeroOffloadPlugin,
    load_shards,
    save_shards,
)
from lightning_zero_offload.config_env import build_config, load_config_file  # noqa: E402
from lightning_zero_offload.core import ZeroOffload  # noqa: E402
from lightning_zero_offload.core.device.profile import FIELDS  # noqa: E402
from lightning_zero_offload.transformers.args import enabled, with_zero_offload  # noqa: E402
from lightning_zero_offload.transformers.optim import optimizer_for  # noqa: E402

__all__ = ["ZeroOffloadTrainingArguments", "ZeroOffloadMixin", "ZeroOffloadTrainer",
           "with_zero_offload"]  # and ZeroOffloadSFTConfig, built on first access (needs TRL)


# ``TrainingArguments`` with the ZeRO-Offload options (also as ``--zero_offload`` flags);
# ``with_zero_offload(AnyArgs)`` gives the same for any subclass (TRL's ``SFTConfig``...).
ZeroOffloadTrainingArguments = with_zero_offload(
    TrainingArguments, "ZeroOffloadTrainingArguments", module=__name__)


def _options(args: TrainingArguments) -> dict[str, object]:
    """The ``zero_offload_config`` fields, checked (a bad name or value raises naming it)."""
    cfg = getattr(args, "zero_offload_config", None)
    if cfg is None:
        return {}
    if isinstance(cfg, (str, os.PathLike)):
        options = load_config_file(cfg, source="zero_offload_config")
    elif isinstance(cfg, dict):
        options = dict(cfg)
    else:
        raise TypeError(f"zero_offload_config must be a dict, JSON string or file path, got "
                        f"{type(cfg).__name__}")
    build_config(None, options, who="ZeroOffloadTrainer",
                 where="TrainingArguments.zero_offload_config")
    return options


if TYPE_CHECKING:  # the mixin's methods run on a Trainer (it is listed before one)
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ZeroOffloadMixin(_TrainerBase):
    """Puts a Trainer's model and optimizer on the engine; put it first in the bases."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._zero_offload_plugin()  # bad options raise here, not at the first step

    def _zero_offload_plugin(self) -> ZeroOffloadPlugin | None:
        """The plugin when ZeRO-Offload is on for this Trainer's args, else None."""
        if "_zo_plugin" not in self.__dict__:
            self._zo_plugin = (ZeroOffloadPlugin(None, enabled=True, **_options(self.args))
                               if enabled(self.args) else None)
        return self._zo_plugin

    @property
    def zero_offload_engine(self) -> ZeroOffload | None:
        """The engine training the model; None before ``create_optimizer`` or when off."""
        plugin = self._zero_offload_plugin()
        return plugin.engine if plugin is not None else None

    @override
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Training logs gain the engine's step profile in milliseconds, the fields the
        Lightning strategy logs: ``zero_offload/fwd_bwd_ms``, ``grad_wait_ms``,
        ``cpu_step_ms``, ``weight_copy_ms``, ``stall_ms`` (the newest finished step's)."""
        engine = self.zero_offload_engine
        if engine is not None and not engine.torn_down and "loss" in logs:
            prof = engine.finished_profile()  # never waits for the device
            if prof is not None:
                logs = {**logs, **{f"zero_offload/{k}_ms": round(1e3 * getattr(prof, k), 3)
                                   for k in FIELDS}}
        super().log(logs, *args, **kwargs)

    @override
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if self._zero_offload_plugin() is None:
            super()._move_model_to_device(model, device)

    @override
    def get_optimizer_cls_and_kwargs(self, args: Any, model: nn.Module | None = None
                                     ) -> tuple[Any, Any]:
        """Under ZeRO-Offload, an ``optim`` the engine implements with another package's
        optimizer gets that one (``transformers.optim``); everything else is the Trainer's."""
        mine = optimizer_for(args) if self._zero_offload_plugin() is not None else None
        return mine if mine is not None else super().get_optimizer_cls_and_kwargs(
            args, model)  # type: ignore[arg-type]

    @override
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        plugin = self._zero_offload_plugin()
        if plugin is None or isinstance(optimizer, ZeroOffloadAcceleratedOptimizer):
            return optimizer
        if plugin.engine is not None:
            raise RuntimeError("ZeroOffloadTrainer: the optimizer was replaced after the engine "
                               "was built; create one Trainer per model")
        if self.is_deepspeed_enabled:
            raise ValueError("ZeRO-Offload does not combine with DeepSpeed; turn one off")
        if self.args.n_gpu > 1:
            raise ValueError("ZeRO-Offload needs one process per GPU (torchrun or accelerate "
                             "launch), not DataParallel over several GPUs in one process")
        source = f"TrainingArguments(bf16={self.args.bf16}, fp16={self.args.fp16})"
        if plugin.resolve_config(self.accelerator.mixed_precision,
                                 source=source).max_grad_norm is not None:
            raise ValueError("set gradient clipping with TrainingArguments.max_grad_norm, not in "
                             "the ZeRO-Offload options (the Trainer clips through the engine)")
        # The Trainer accumulates itself (its Accelerator says 1 step): its own setting counts.
        self.model, self.optimizer = plugin.prepare(
            self.accelerator, self.model, optimizer,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps)
        self.model_wrapped = self.model
        return self.optimizer

    @override
    def train(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.zero_offload_engine
        if engine is not None and engine.torn_down:
            raise RuntimeError("ZeroOffloadTrainer: train() already ran and handed the fp32 "
                               "weights back to the model; create a new trainer to train again "
                               "(resume_from_checkpoint= continues a saved run)")
        output = super().train(*args, **kwargs)
        engine = self.zero_offload_engine
        if engine is not None:
            # As after a plain Trainer's run, the model holds the fp32 weights (save_pretrained,
            # merge_and_unload and push_to_hub export them unrounded); the engine's state stays
            # readable for save_model/save_state.
            engine.teardown(copy_weights_to_module=True, keep_state=True,
                            device=_fp32_home(engine), failure=None)  # train() returned
        return output

    @override
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.zero_offload_engine
        if engine is not None and not engine.torn_down:
            engine.gather_weights()  # evaluate the latest weights, not one step stale
        return super().evaluation_loop(*args, **kwargs)

    @override
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.zero_offload_engine
        if engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_shards(engine, output_dir)
        if self.args.should_save:
            torch.save(self._scheduler().state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    @override
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self.zero_offload_engine
        if engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_shards(engine, checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self._scheduler().load_state_dict(torch.load(scheduler, weights_only=True))

    @override
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Under FSDP the Trainer loads the weights after the engine is built, from FSDP's own
        # files; the engine's shards hold them (fp32 master and buffers), loaded just after.
        if self.zero_offload_engine is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _scheduler(self) -> LRScheduler:
        scheduler = self.lr_scheduler
        if not isinstance(scheduler, LRScheduler):  # the Trainer creates it before any save/load
            raise RuntimeError(f"ZeroOffloadTrainer: expected a torch LR scheduler, got "
                               f"{type(scheduler).__name__}")
        return scheduler

    @override
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The fp32 master weights (collective: call it on every rank, as the Trainer does)."""
        engine = self.zero_offload_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        state_dict = engine.full_state_dict(optimizer=False)["model"]
        out = output_dir if output_dir is not None else self.args.output_dir
        self._save(out, state_dict=state_dict)
        if self.args.should_save and out is not None:
            _record_fp32(out)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _fp32_home(engine: ZeroOffload) -> torch.device:
    """Where the fp32 weights go after training: the compute device when they fit there (as a
    plain Trainer keeps them), else the host, with a warning."""
    device = engine.device
    if device.type != "cuda":
        return device
    need = sum(4 * p.numel() for p in engine.module.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    if need < 0.9 * free:
        return device
    warnings.warn(f"ZeroOffloadTrainer: the fp32 weights ({need / 2**30:.1f} GiB) do not fit on "
                  f"{device} after training; the model now holds them on the CPU", stacklevel=3)
    return torch.device("cpu")


def _record_fp32(folder: str) -> None:
    """``save_model`` writes the fp32 master weights: say so in config.json (transformers
    records the dtype of the live model, which in training is the half-precision copy)."""
    path = os.path.join(folder, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
        if "dtype" in cfg or "torch_dtype" in cfg:
            cfg.update({k: "float32" for k in ("dtype", "torch_dtype") if k in cfg})
            with open(path, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)


class ZeroOffloadTrainer(ZeroOffloadMixin, Trainer):
    """``transformers.Trainer`` trained by the ZeRO-Offload engine when it is enabled."""


def __getattr__(name: str) -> Any:
    if name == "ZeroOffloadSFTConfig":  # built by ``args`` on first access (needs TRL)
        from lightning_zero_offload.transformers import args

        return args.ZeroOffloadSFTConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
