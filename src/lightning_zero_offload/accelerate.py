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

Not supported with the flag on (each raises): DeepSpeed, FSDP, Megatron-LM, XLA, tensor/context
parallelism, ``torch.compile`` through Accelerate, fp8, more than one engine model per plugin,
``accelerator.clip_grad_value_`` on the engine's parameters, ``accelerator.backward`` with
keyword arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn

from lightning_zero_offload.core import ZeroOffload, ZeroOffloadConfig

__all__ = [
    "ZeroOffloadPlugin",
    "ZeroOffloadAcceleratedOptimizer",
    "zero_offload_enabled",
    "config_overrides_from_env",
    "load_config_file",
    "mixed_precision_to_precision",
]

ENV_FLAG = "ZERO_OFFLOAD"
ENV_CONFIG = "ZERO_OFFLOAD_CONFIG"
ENV_PREFIX = "ZERO_OFFLOAD_"
CHECKPOINT_SUBDIR = "zero_offload"  # per-rank engine shards inside an accelerate/Trainer checkpoint
_SHARDED_MARKER = "zero_offload_sharded_checkpoint"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


# ----------------------------------------------------------------------------------------------
# Options from the environment


def _parse_bool(source: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{source}={text!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def zero_offload_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ZERO_OFFLOAD`` turns the engine on (unset or empty means off)."""
    env = os.environ if environ is None else environ
    return _parse_bool(ENV_FLAG, env.get(ENV_FLAG, ""))


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(ZeroOffloadConfig)


def _coerce(source: str, value: Any, hint: Any) -> Any:
    """``value`` (text from a variable, or a JSON/YAML scalar) as the field's type, or a
    ValueError that names ``source``."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if args else hint
    expected = getattr(base, "__name__", str(base)) + (" or none" if optional else "")
    if typing.get_origin(base) is tuple:  # cpu_affinity: "0,1,2" (or "[0, 1, 2]", a list)
        return _coerce_ints(source, value, optional)
    if base not in (bool, int, float, str):
        raise TypeError(f"no parser for option {source} of type {hint}")
    if isinstance(value, str) and base is not str:
        text = value.strip()
        if optional and text.lower() in ("none", "null"):
            return None
        if base is bool:
            return _parse_bool(source, text)
        try:
            return base(text)
        except ValueError:
            raise ValueError(f"{source}={value!r}: expected {expected}") from None
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise ValueError(f"{source}={value!r}: expected {expected}")


def _coerce_ints(source: str, value: Any, optional: bool) -> tuple[int, ...] | None:
    """Comma-separated ints from a variable, or a list of ints from a file."""
    text = value.strip() if isinstance(value, str) else None
    if optional and (value is None or (text or "").lower() in ("none", "null")):
        return None
    items = value if text is None else text.strip("[]()").replace(",", " ").split()
    try:
        if not isinstance(items, (list, tuple)) or not items or any(
            isinstance(i, (bool, float)) for i in items
        ):
            raise ValueError
        return tuple(int(i) for i in items)
    except (TypeError, ValueError):
        raise ValueError(
            f"{source}={value!r}: expected comma-separated integers such as 0,1,2"
            + (" (or none)" if optional else "")
        ) from None


def load_config_file(path: str | os.PathLike, *, source: str = ENV_CONFIG) -> dict[str, Any]:
    """ZeroOffloadConfig fields from a ``.json`` or ``.yaml``/``.yml`` mapping (checked)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{source}={str(path)!r}: no such file")
    text = file.read_text()
    try:
        if file.suffix == ".json":
            data = json.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ValueError(f"{source}={str(path)!r}: use a .json, .yaml or .yml file")
    except (json.JSONDecodeError, ImportError) as e:
        raise ValueError(f"{source}={str(path)!r} could not be read: {e}") from None
    except Exception as e:  # yaml.YAMLError without importing yaml at module level
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"{source}={str(path)!r} could not be read: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}={str(path)!r} must hold a mapping of ZeroOffloadConfig fields")
    hints = _field_types()
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ValueError(f"{source}={str(path)!r}: unknown option(s) {unknown}; "
                         f"ZeroOffloadConfig fields are {sorted(hints)}")
    return {k: _coerce(f"{path}: {k}", v, hints[k]) for k, v in data.items()}


def config_overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """ZeroOffloadConfig fields set by ``ZERO_OFFLOAD_CONFIG`` and ``ZERO_OFFLOAD_<FIELD>``
    (the variables win over the file). A misspelt variable raises instead of being ignored."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if env.get(ENV_CONFIG, "").strip():
        values.update(load_config_file(env[ENV_CONFIG].strip()))
    hints = _field_types()
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG:
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in hints:
            known = [ENV_CONFIG] + [ENV_PREFIX + n.upper() for n in sorted(hints)]
            raise ValueError(f"{var} is not a ZeroOffload option; the variables are {known}")
        values[name] = _coerce(var, env[var], hints[name])
    return values


def mixed_precision_to_precision(mixed_precision: str) -> str:
    """Accelerate's ``mixed_precision`` as the engine's ``precision``."""
    if mixed_precision not in _PRECISION:
        raise ValueError(
            f"ZeRO-Offload supports Accelerate mixed_precision 'no', 'bf16' and 'fp16', not "
            f"{mixed_precision!r}; launch with one of those or without ZERO_OFFLOAD=1"
        )
    return _PRECISION[mixed_precision]


def _build_config(values: dict[str, Any], where: str) -> ZeroOffloadConfig:
    try:
        return ZeroOffloadConfig(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (options from {where})") from None


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

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ZeRO-Offload's optimizer.step() takes no closure")
        if self.gradient_state.sync_gradients:
            self.optimizer.step()
            # The user's scheduler wrapped the user's optimizer.step (never called now); this is
            # the flag that wrapper would set, so torch does not warn about the call order.
            self._user_optimizer._opt_called = True

    @property
    def step_was_skipped(self) -> bool:
        return bool(self.engine.last_step_skipped)

    def state_dict(self) -> dict:
        if self._saving:  # accelerate's save_state: the shards are in CHECKPOINT_SUBDIR
            self._saving = False
            return {_SHARDED_MARKER: CHECKPOINT_SUBDIR, "world_size": self.engine.world_size}
        return self.optimizer.state_dict()

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
    set); otherwise options come from the environment. ``overrides``: config fields set in code
    (a variable that sets the same field differently raises). ``enabled``: None reads
    ``ZERO_OFFLOAD``. After ``prepare``, ``plugin.engine`` is the engine.
    """

    def __init__(
        self,
        config: ZeroOffloadConfig | None = None,
        *,
        enabled: bool | None = None,
        **overrides: Any,
    ) -> None:
        unknown = sorted(set(overrides) - set(_field_types()))
        if unknown:
            raise TypeError(f"ZeroOffloadPlugin: unknown option(s) {unknown}; ZeroOffloadConfig "
                            f"fields are {sorted(_field_types())}")
        self.enabled = zero_offload_enabled() if enabled is None else bool(enabled)
        self._config = config
        self._overrides = overrides
        self.engine: ZeroOffload | None = None
        self.optimizer: ZeroOffloadAcceleratedOptimizer | None = None

    def resolve_config(self, mixed_precision: str) -> ZeroOffloadConfig:
        """The engine's options: code, then environment, with precision from Accelerate."""
        precision = mixed_precision_to_precision(mixed_precision)
        env = config_overrides_from_env()
        if self._config is not None:
            if env:
                raise ValueError(
                    "ZeroOffloadPlugin got a ZeroOffloadConfig in code and ZeRO-Offload options in "
                    f"the environment ({sorted(env)}); use one of the two"
                )
            values, where = dataclasses.asdict(self._config), "the ZeroOffloadConfig passed in"
        else:
            values, where = dict(env), "ZERO_OFFLOAD_* environment variables"
        for name, value in self._overrides.items():
            if name in env and env[name] != value:
                raise ValueError(
                    f"ZeroOffloadPlugin({name}={value!r}) conflicts with the environment's "
                    f"{ENV_PREFIX}{name.upper()} / {ENV_CONFIG} value {env[name]!r}; set it once"
                )
            values[name] = value
        if values.get("precision", precision) != precision:
            raise ValueError(
                f"ZeRO-Offload precision {values['precision']!r} (from {where}) does not match "
                f"Accelerator(mixed_precision={mixed_precision!r}), which means {precision!r}; "
                "set the precision through Accelerate (mixed_precision / --mixed_precision)"
            )
        values["precision"] = precision
        return _build_config(values, where)

    def prepare(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
        *other: Any,
    ) -> tuple:
        """What ``accelerator.prepare(model, optimizer, *other)`` returns, with the model and
        the optimizer driven by the engine when ZeRO-Offload is on."""
        if not self.enabled:
            return accelerator.prepare(model, optimizer, *other)
        if self.engine is not None:
            raise RuntimeError("this ZeroOffloadPlugin already prepared a model; use one plugin "
                               "(and one Accelerator) per engine model")
        _check_supported(accelerator, model, optimizer)
        config = self.resolve_config(accelerator.mixed_precision)
        device = accelerator.device
        if device.type == "cpu":
            device = torch.device("cpu")  # MULTI_CPU reports "cpu:0"; the host has one device
        engine = ZeroOffload(model, optimizer, config, device=device)
        module = engine.module
        module._is_accelerate_prepared = True
        # A model prepared for evaluation earlier (Trainer.evaluate before train) is listed once.
        accelerator._models[:] = [m for m in accelerator._models if m is not module] + [module]
        wrapped = ZeroOffloadAcceleratedOptimizer(engine, optimizer)
        wrapped._is_accelerate_prepared = True
        accelerator._optimizers.append(wrapped)
        self.engine, self.optimizer = engine, wrapped
        _route_accelerator(accelerator, engine, wrapped)
        rest = accelerator.prepare(*other) if other else ()
        return (module, wrapped, *(rest if len(other) > 1 else (rest,) if other else ()))


def _check_supported(accelerator: Accelerator, model: Any, optimizer: Any) -> None:
    if accelerator.distributed_type not in _SUPPORTED:
        raise ValueError(
            f"ZeRO-Offload runs on one or several processes without another sharding backend; "
            f"Accelerate is set up for {accelerator.distributed_type}. Launch without "
            "DeepSpeed/FSDP/Megatron/XLA, or without ZERO_OFFLOAD=1"
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


def _route_accelerator(
    accelerator: Accelerator, engine: ZeroOffload, wrapped: ZeroOffloadAcceleratedOptimizer
) -> None:
    """Point this accelerator's gradient and checkpoint methods at the engine (instance
    attributes, so other accelerators are untouched)."""
    managed = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    plain_clip = accelerator.clip_grad_norm_
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

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
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

    def clip_grad_value_(parameters: Any, clip_value: float) -> None:
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
        engine.save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR), sharded=True)
        weights[:] = [w for m, w in zip(models, weights, strict=True) if m is not engine.module]
        wrapped._saving = True

    def load_hook(models: list, input_dir: str) -> None:
        path = os.path.join(input_dir, CHECKPOINT_SUBDIR)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} does not exist: {input_dir} was not written by accelerator.save_state "
                "with ZeroOffloadPlugin, so it holds no ZeRO-Offload optimizer shards"
            )
        engine.load_checkpoint(path)
        models[:] = [m for m in models if m is not engine.module]
        wrapped._loaded = True

    accelerator.backward = backward
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    accelerator.get_state_dict = get_state_dict
    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
