"""ZeRO-Offload options on any ``TrainingArguments`` subclass, without a hand-written dataclass.

``with_zero_offload(SFTConfig)`` returns a dataclass subclass of ``SFTConfig`` with two more
fields, ``zero_offload`` and ``zero_offload_config``, which ``ZeroOffloadMixin`` reads; it is
cached, so calling it twice gives the same class. ``HfArgumentParser`` accepts the bare flag
``--zero_offload`` (as well as ``--zero_offload true/false``); left out, the ``ZERO_OFFLOAD``
environment flag decides. With TRL installed, ``ZeroOffloadSFTConfig`` is ready-made::

    from lightning_zero_offload.transformers import ZeroOffloadSFTConfig
    from lightning_zero_offload.transformers import ZeroOffloadMixin
    from trl import SFTTrainer

    class OffloadSFTTrainer(ZeroOffloadMixin, SFTTrainer):
        pass

    args = ZeroOffloadSFTConfig(output_dir="out", zero_offload=True)

The classes are registered in this module under their names, so the ``training_args.bin`` the
Trainer pickles into checkpoints loads again once the class has been built.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lightning_zero_offload.config_env import build_config

__all__ = ["with_zero_offload"]  # and ZeroOffloadSFTConfig, built on first access (needs TRL)

_HF_EXTRA = "pip install 'lightning-zero-offload[hf]'"
_cache: dict[type, type] = {}


def enabled(args: Any) -> bool:
    """Whether ``args`` turn ZeRO-Offload on (its flag, else the ZERO_OFFLOAD environment)."""
    flag = getattr(args, "zero_offload", None)
    if flag is not None:
        return bool(flag)
    from lightning_zero_offload.config_env import zero_offload_enabled

    return zero_offload_enabled()


def _post_init(self: Any) -> None:
    # The parent's __post_init__ is looked up on the class this was attached to (super() with
    # no arguments does not work in a function defined outside the class body).
    super(type(self).__zero_offload_class__, self).__post_init__()
    cfg = self.zero_offload_config
    if isinstance(cfg, str) and cfg.strip().startswith("{"):
        try:
            self.zero_offload_config = json.loads(cfg)
        except json.JSONDecodeError as e:
            raise ValueError(f"zero_offload_config is not valid JSON: {e}") from None
    if isinstance(self.zero_offload_config, dict):  # checked here, where it is given
        build_config(None, self.zero_offload_config, who=type(self).__name__,
                     where=f"{type(self).__name__}(zero_offload_config=...)")
    flag = self.zero_offload
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"zero_offload must be True, False or None (follow the ZERO_OFFLOAD "
                        f"environment flag), got {flag!r}")


def _place_model_on_device(self: Any) -> bool | None:
    # The engine moves the model itself, in the compute dtype: never a full fp32 copy.
    parent = super(type(self).__zero_offload_class__, self).place_model_on_device
    return False if enabled(self) else parent


def with_zero_offload(args_cls: type, name: str | None = None, *,
                      module: str | None = None) -> type:
    """A dataclass subclass of ``args_cls`` (``TrainingArguments`` or a subclass such as TRL's
    ``SFTConfig``) with the ``zero_offload`` and ``zero_offload_config`` fields, named ``name``
    (default ``ZeroOffload<ArgsClass>``). It is registered here for pickle unless ``module``
    names the module that will hold it under ``name`` (the caller then assigns it there)."""
    from transformers import TrainingArguments

    if not (isinstance(args_cls, type) and issubclass(args_cls, TrainingArguments)):
        raise TypeError(f"with_zero_offload needs a TrainingArguments subclass, got {args_cls!r}")
    if any(f.name == "zero_offload" for f in dataclasses.fields(args_cls)):
        return args_cls  # already has the options (e.g. ZeroOffloadTrainingArguments)
    if args_cls in _cache:
        return _cache[args_cls]
    name = name or f"ZeroOffload{args_cls.__name__}"
    fields = [
        ("zero_offload", bool | None, dataclasses.field(default=None, metadata={
            # nargs/const: HfArgumentParser gives an Optional[bool] with default None no bare
            # flag form, so "--zero_offload" alone would ask for a value.
            "nargs": "?", "const": True,
            "help": "Train with ZeRO-Offload. Default: the ZERO_OFFLOAD environment flag."})),
        ("zero_offload_config", dict | str | None, dataclasses.field(default=None, metadata={
            "help": "ZeroOffloadConfig fields: a dict, a JSON string or a .json/.yaml file. "
                    "Precision follows bf16/fp16 and clipping follows max_grad_norm."})),
    ]
    namespace = {"__post_init__": _post_init,
                 "place_model_on_device": property(_place_model_on_device),
                 "__doc__": f"``{args_cls.__name__}`` with ZeRO-Offload options "
                            "(``zero_offload``, ``zero_offload_config``; also as flags)."}
    cls = dataclasses.make_dataclass(name, fields, bases=(args_cls,), namespace=namespace)
    cls.__zero_offload_class__ = cls
    cls.__module__ = module or __name__
    _cache[args_cls] = cls
    if module is None:
        globals().setdefault(name, cls)  # pickle finds it by module and name
    return cls


def __getattr__(name: str) -> Any:
    if name == "ZeroOffloadSFTConfig":
        try:
            from trl import SFTConfig  # pyright: ignore[reportPrivateImportUsage]  (lazy export)
        except ImportError as e:
            raise ImportError(f"ZeroOffloadSFTConfig needs TRL ({e}); {_HF_EXTRA}") from e
        return with_zero_offload(SFTConfig, "ZeroOffloadSFTConfig")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
