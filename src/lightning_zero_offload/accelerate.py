"""Accelerate integration: the user's loop stays Accelerate's, the engine trains the model.

Accelerate has no plugin registry and rejects unknown keys in its launch config, but
``accelerate launch`` passes the environment to every worker, so the switch is an environment
variable: ``ZERO_OFFLOAD=1`` (options as ``ZERO_OFFLOAD_<FIELD>`` variables, e.g.
``ZERO_OFFLOAD_BUCKET_SIZE_MB=50``, or a JSON/YAML file named by ``ZERO_OFFLOAD_CONFIG``)::

    plugin = ZeroOffloadPlugin()                      # reads ZERO_OFFLOAD*; off -> plain prepare
    model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer,
                                                         loader, scheduler)

With the flag on, ``prepare`` builds a :class:`~lightning_zero_offload.ZeroOffload` engine on
``accelerator.device`` (no DDP wrapper, no autocast: the engine holds the half-precision weights
and reduces the gradients) and makes this accelerator's ``backward``, ``clip_grad_norm_``,
``get_state_dict``, ``save_state`` and ``load_state`` go through it. Precision follows
``Accelerator(mixed_precision=...)``: ``"no"`` -> ``"32-true"``, ``"bf16"`` -> ``"bf16-mixed"``,
``"fp16"`` -> ``"16-mixed"`` (the engine's own dynamic loss scaler).

Checkpoints: ``save_state`` writes each rank's optimizer shard (with the fp32 master weights and
the module's buffers) under ``zero_offload/`` and no ``model.safetensors``; ``load_state`` reads
them back at the same or another world size. ``accelerator.get_state_dict(model)`` gathers the
fp32 master weights (call it on every process) for ``save_pretrained(..., state_dict=...)``.
With ``delayed_update`` the weights the loop sees are one step stale until
``plugin.engine.synchronize()``; checkpoints and ``get_state_dict`` include the pending update.
With several processes the process group is destroyed at the interpreter's exit if the script
did not call ``accelerator.end_training()`` (a gloo group left to the exit can abort it).

With Accelerate's FSDP2 (``fsdp_version: 2``) Accelerate shards the model in ``prepare`` as
usual and the engine is built over it (``lightning_zero_offload.accelerate_fsdp2``): FSDP2 keeps
each rank's weight shards on the device in the run's half precision, the engine their fp32
master and optimizer state on the host; ``save_state``/``load_state`` work as without FSDP.
With ``fsdp_offload_params`` FSDP2's fp32 shards live on the host and the engine steps them in
place, under the next forward.

Not supported with the flag on (each raises): DeepSpeed, FSDP1, FSDP2's HSDP, Megatron-LM, XLA,
tensor/context parallelism, ``torch.compile`` through Accelerate, fp8, more than one engine model
per plugin, ``accelerator.clip_grad_value_`` on the engine's parameters, ``accelerator.backward``
with keyword arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from lightning_zero_offload._extras import require_extra

require_extra("lightning_zero_offload.accelerate", "accelerate", "accelerate")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType, DynamoBackend  # noqa: E402
from torch import nn  # noqa: E402
from typing_extensions import override  # noqa: E402

from lightning_zero_offload import accelerate_fsdp2  # noqa: E402
from lightning_zero_offload.config_env import (  # noqa: E402
    ENV_CONFIG,
    ENV_PREFIX,
    build_config,
    config_overrides_from_env,
    load_config_file,
    zero_offload_enabled,
)
from lightning_zero_offload.core import ZeroOffload, ZeroOffloadConfig  # noqa: E402
from lightning_zero_offload.core.optimizer import mark_stepped  # noqa: E402
from lightning_zero_offload.core.rules.rules import supported  # noqa: E402

__all__ = [
    "ZeroOffloadPlugin",
    "ZeroOffloadAcceleratedOptimizer",
    "zero_offload_enabled",
    "config_overrides_from_env",
    "load_config_file",
    "mixed_precision_to_precision",
]

CHECKPOINT_SUBDIR = "zero_offload"  # per-rank engine shards inside an accelerate/Trainer checkpoint
_SHARDED_MARKER = "zero_offload_sharded_checkpoint"
_PREPARED = "_is_accelerate_prepared"  # Accelerate's mark on what its prepare() returned
_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def mixed_precision_to_precision(mixed_precision: str) -> str:
    """Accelerate's ``mixed_precision`` as the engine's ``precision``."""
    if mixed_precision not in _PRECISION:
        raise ValueError(
            f"ZeRO-Offload supports Accelerate mixed_precision 'no', 'bf16' and 'fp16', not "
            f"{mixed_precision!r}; launch with one of those or without ZERO_OFFLOAD=1"
        )
    return _PRECISION[mixed_precision]


def save_shards(engine: ZeroOffload, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Collective: every rank writes its engine shard into ``checkpoint_dir/zero_offload``."""
    engine.save_checkpoint(os.path.join(checkpoint_dir, CHECKPOINT_SUBDIR), sharded=True)


def load_shards(engine: ZeroOffload, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Collective: the engine state from ``save_shards``' folder, at any world size."""
    path = os.path.join(checkpoint_dir, CHECKPOINT_SUBDIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path} does not exist: {checkpoint_dir} was saved without ZeRO-Offload, so it holds "
            "no ZeRO-Offload optimizer shards to resume from; resume it without ZeRO-Offload"
        )
    engine.load_checkpoint(path)


# ----------------------------------------------------------------------------------------------
# Accelerate objects


class ZeroOffloadAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around the engine's optimizer facade.

    ``step``/``zero_grad`` act only when ``accelerator.sync_gradients`` is True (as Accelerate's
    own wrapper); ``step_was_skipped`` reports an fp16 overflow skip so the prepared scheduler
    holds still; ``state_dict`` is this rank's shard.
    """

    def __init__(self, engine: ZeroOffload, user_optimizer: torch.optim.Optimizer) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self._user_optimizer = user_optimizer
        self._saving = False  # set by the save_state hook: state_dict() returns the marker once
        self._loaded = False  # set by the load_state hook: the marker is then accepted once

    @override
    def step(self, closure: Callable[[], object] | None = None) -> None:
        if closure is not None:
            raise ValueError("ZeRO-Offload's optimizer.step() takes no closure")
        if self.gradient_state.sync_gradients:
            self.optimizer.step()
            # The user's scheduler wrapped the user's optimizer.step (never called now); this is
            # the flag that wrapper would set, so torch does not warn about the call order.
            mark_stepped(self._user_optimizer)

    @property
    @override
    def step_was_skipped(self) -> bool:
        return bool(self.engine.last_step_skipped)

    @override
    def state_dict(self) -> dict:
        if self._saving:  # accelerate's save_state: the shards are in CHECKPOINT_SUBDIR
            self._saving = False
            return {_SHARDED_MARKER: CHECKPOINT_SUBDIR, "world_size": self.engine.world_size}
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        if _SHARDED_MARKER in state_dict:
            if not self._loaded:
                raise RuntimeError(
                    "this optimizer state points at ZeRO-Offload shards in the checkpoint's "
                    f"'{CHECKPOINT_SUBDIR}' folder; load it with accelerator.load_state(dir) on an "
                    "accelerator prepared by ZeroOffloadPlugin"
                )
            self._loaded = False
            return
        self.optimizer.load_state_dict(state_dict)


class ZeroOffloadPlugin:
    """Builds the engine inside an existing ``Accelerator`` when ZeRO-Offload is on.

    ``config``: a :class:`ZeroOffloadConfig` (then no ``ZERO_OFFLOAD_*`` option variables may be
    set); otherwise options come from the environment. ``overrides``: config fields set in code,
    checked here (a variable that sets the same field differently raises). ``enabled``: None reads
    ``ZERO_OFFLOAD``. After ``prepare``, ``plugin.engine`` is the engine.
    """

    def __init__(
        self,
        config: ZeroOffloadConfig | None = None,
        *,
        enabled: bool | None = None,
        **overrides: object,
    ) -> None:
        # bad names or values raise here, where the options are given, not at prepare: the
        # arguments, then the ZERO_OFFLOAD_* variables with them
        build_config(config, overrides, who="ZeroOffloadPlugin",
                     where="the ZeroOffloadPlugin arguments")
        self._config, self._overrides = config, overrides
        self._options()
        self.enabled = zero_offload_enabled() if enabled is None else bool(enabled)
        self.engine: ZeroOffload | None = None
        self.optimizer: ZeroOffloadAcceleratedOptimizer | None = None

    def resolve_config(self, mixed_precision: str, *, source: str | None = None
                       ) -> ZeroOffloadConfig:
        """The engine's options: code, then environment, with precision from Accelerate
        (``source`` names the user's setting behind ``mixed_precision`` in errors)."""
        precision = mixed_precision_to_precision(mixed_precision)
        return self._options().resolve_precision(
            precision, source=source or f"Accelerator(mixed_precision={mixed_precision!r})")

    def _options(self) -> ZeroOffloadConfig:
        """The options from code and the environment, checked against each other."""
        env = config_overrides_from_env()
        if self._config is not None and env:
            raise ValueError(
                "ZeroOffloadPlugin got a ZeroOffloadConfig in code and ZeRO-Offload options in "
                f"the environment ({sorted(env)}); use one of the two"
            )
        for name, value in self._overrides.items():
            if name in env and env[name] != value:
                raise ValueError(
                    f"ZeroOffloadPlugin({name}={value!r}) conflicts with the environment's "
                    f"{ENV_PREFIX}{name.upper()} / {ENV_CONFIG} value {env[name]!r}; set it once"
                )
        variables = sorted(v for v in os.environ if v.startswith(ENV_PREFIX))
        where = ("the ZeroOffloadConfig passed in" if self._config is not None
                 else f"the environment: {', '.join(variables)}" if env
                 else "the ZeroOffloadPlugin arguments")
        return build_config(self._config, {**env, **self._overrides}, who="ZeroOffloadPlugin",
                            where=where)

    def prepare(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
        *other: Any, gradient_accumulation_steps: int | None = None,
    ) -> tuple:
        """What ``accelerator.prepare(model, optimizer, *other)`` returns, with the model and
        the optimizer driven by the engine when ZeRO-Offload is on. The engine's ``accumulate``
        (unless the config sets it) follows ``gradient_accumulation_steps``, by default the
        Accelerator's."""
        if not self.enabled:
            return accelerator.prepare(model, optimizer, *other)
        if self.engine is not None:
            raise RuntimeError("this ZeroOffloadPlugin already prepared a model; use one plugin "
                               "(and one Accelerator) per engine model")
        _check_supported(accelerator, model, optimizer)
        _check_other_optimizers(model, other)
        steps = (accelerator.gradient_accumulation_steps if gradient_accumulation_steps is None
                 else gradient_accumulation_steps)
        config = self.resolve_config(accelerator.mixed_precision).resolve_accumulate(steps)
        device = accelerator.device
        if device.type == "cpu":
            device = torch.device("cpu")  # MULTI_CPU reports "cpu:0"; the host has one device
        if accelerator.is_fsdp2:
            config = accelerate_fsdp2.engine_config(accelerator, config)
            model, optimizer = accelerate_fsdp2.shard(accelerator, model, optimizer)
        engine = ZeroOffload(model, optimizer, config, device=device)
        module = engine.module
        setattr(module, _PREPARED, True)
        # A model prepared for evaluation earlier (Trainer.evaluate before train) is listed once.
        accelerator._models[:] = [m for m in accelerator._models if m is not module] + [module]
        wrapped = ZeroOffloadAcceleratedOptimizer(engine, optimizer)
        setattr(wrapped, _PREPARED, True)
        accelerator._optimizers.append(wrapped)
        self.engine, self.optimizer = engine, wrapped
        _route_accelerator(accelerator, engine, wrapped)
        rest = accelerator.prepare(*other) if other else ()
        return (module, wrapped, *(rest if len(other) > 1 else (rest,) if other else ()))


def _check_supported(accelerator: Accelerator, model: object, optimizer: object) -> None:
    if accelerator.distributed_type == DistributedType.FSDP:
        accelerate_fsdp2.check(accelerator)
    elif accelerator.distributed_type not in _SUPPORTED:
        raise ValueError(
            f"ZeRO-Offload runs on one or several processes without another sharding backend; "
            f"Accelerate is set up for {accelerator.distributed_type}. Launch without "
            "DeepSpeed/Megatron/XLA, or without ZERO_OFFLOAD=1"
        )
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (pc.tp_enabled or pc.cp_enabled):
        raise ValueError("ZeRO-Offload does not combine with tensor or context parallelism")
    dynamo = getattr(accelerator.state, "dynamo_plugin", None)
    if dynamo is not None and dynamo.backend != DynamoBackend.NO:
        raise ValueError("ZeRO-Offload does not support torch.compile through Accelerate "
                         "(dynamo_backend); compile the model yourself or turn it off")
    if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("ZeroOffloadPlugin.prepare(accelerator, model, optimizer, *other): pass "
                        f"the model and its optimizer first, got {type(model).__name__} and "
                        f"{type(optimizer).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel) or isinstance(
        optimizer, AcceleratedOptimizer
    ):
        raise ValueError("pass the raw model and optimizer to ZeroOffloadPlugin.prepare, not ones "
                         "already returned by accelerator.prepare")
    if getattr(model, "hf_device_map", None) is not None:
        raise ValueError("ZeRO-Offload places the model itself; load it without device_map")


def _check_other_optimizers(model: nn.Module, other: tuple) -> None:
    """A second optimizer over the engine model's parameters would step weights the engine owns
    (its half-precision device copies), silently: refuse it before anything is built."""
    ours = {id(p) for p in model.parameters()}
    for i, o in enumerate(other):
        if isinstance(o, torch.optim.Optimizer) and any(
                id(p) in ours for g in o.param_groups for p in g["params"]):
            raise ValueError(
                f"ZeroOffloadPlugin.prepare: the optimizer at position {i + 3} ("
                f"{type(o).__name__}) holds parameters of the ZeRO-Offload model; one engine keeps "
                "one optimizer's state (fp32 master weights and moments) on the host, and its CPU "
                "step is one fused update of that optimizer over those parameters. Give that "
                "optimizer only another model's parameters (that model is then prepared by "
                "Accelerate as usual, without offload), or, if the optimizers differ only in "
                f"hyperparameters and step together, pass one optimizer ({supported()}) with a "
                "parameter group for each")


def _route_accelerator(
    accelerator: Accelerator, engine: ZeroOffload, wrapped: ZeroOffloadAcceleratedOptimizer
) -> None:
    """Point this accelerator's gradient and checkpoint methods at the engine (instance
    attributes, so other accelerators are untouched)."""
    managed = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    plain_clip: Callable[..., torch.Tensor | None] = accelerator.clip_grad_norm_
    plain_clip_value = accelerator.clip_grad_value_
    plain_get_state_dict = accelerator.get_state_dict

    def split(parameters: Iterable[torch.Tensor] | torch.Tensor) -> tuple[list, bool]:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return params, any(id(p) in managed for p in params)

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"accelerator.backward: {sorted(kwargs)} are not supported with "
                            "ZeRO-Offload (the engine runs the backward pass)")
        engine.backward(loss / accelerator.gradient_accumulation_steps,
                        sync_gradients=accelerator.sync_gradients)

    def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2) -> torch.Tensor | None:
        params, ours = split(parameters)
        if not ours:
            return plain_clip(params, max_norm, norm_type)
        extra = [p for p in params if id(p) not in managed and p.grad is not None]
        if len({id(p) for p in params} & managed) != len(managed) or extra:
            raise ValueError(
                "accelerator.clip_grad_norm_: pass exactly the ZeRO-Offload model's parameters "
                "(model.parameters()); the engine clips by the global norm of all its gradients "
                "and cannot clip a subset or other models' gradients with them"
            )
        if not accelerator.sync_gradients:
            raise RuntimeError(
                "accelerator.clip_grad_norm_ was called on a micro-batch that does not end an "
                "accumulation window; clip under `if accelerator.sync_gradients:` as Accelerate's "
                "examples do (clipping partial sums would change the result)"
            )
        return engine.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(parameters: Iterable[torch.Tensor] | torch.Tensor,
                         clip_value: float) -> None:
        params, ours = split(parameters)
        if ours:
            raise NotImplementedError("clip_grad_value_ is not supported with ZeRO-Offload (the "
                                      "gradients live on the host); use clip_grad_norm_")
        return plain_clip_value(params, clip_value)

    def get_state_dict(model: nn.Module, unwrap: bool = True) -> dict:
        # unwrap=True is the "save the trained model" call: the fp32 master weights (a collective
        # call, as for DeepSpeed). save_state uses unwrap=False and keeps the device weights:
        # the master weights go into the engine's shards there.
        if model is engine.module and unwrap:
            return engine.full_state_dict(optimizer=False)["model"]
        return plain_get_state_dict(model, unwrap=unwrap)

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        # The engine's folder holds the whole module (master weights, buffers, untrained
        # parameters), so Accelerate does not write it again: its parameters are views of one
        # flat buffer, which safetensors refuses to save or load into.
        save_shards(engine, output_dir)
        weights[:] = [w for m, w in zip(models, weights, strict=True) if m is not engine.module]
        wrapped._saving = listed()  # Accelerate asks it for a state where it is listed

    def load_hook(models: list, input_dir: str) -> None:
        load_shards(engine, input_dir)
        models[:] = [m for m in models if m is not engine.module]
        wrapped._loaded = listed()

    def listed() -> bool:
        return any(o is wrapped for o in accelerator._optimizers)

    accelerator.backward = backward
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    accelerator.get_state_dict = get_state_dict
    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    if accelerator.is_fsdp2:
        accelerate_fsdp2.keep_out_of_fsdp_checkpoints(accelerator, engine.module, wrapped)
