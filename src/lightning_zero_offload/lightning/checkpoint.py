"""Checkpoint layouts of the Lightning and Fabric strategies.

Consolidated (default): an ordinary Lightning/Fabric file. The model entry holds the fp32 master
weights keyed like the module, the optimizer entry ``torch.optim.AdamW``'s format (plus the fp16
loss scaler under :data:`SCALER_KEY` for "16-mixed"), so plain PyTorch, ``load_from_checkpoint``
and the default strategies can read it.

Sharded (``sharded_checkpoint=True``), for models too large to gather on one rank: a directory
written by ``ZeroOffload.save_checkpoint(sharded=True)`` (one file per rank) plus ``meta.pt`` from
rank 0 with everything else (loops, callbacks, schedulers, hyperparameters). It resumes at any
world size; :func:`consolidate_checkpoint` turns it into a consolidated file offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import _load
from lightning.fabric.utilities.types import _PATH

from lightning_zero_offload.core import ZeroOffload
from lightning_zero_offload.core import state as engine_state

META = "meta.pt"
SCALER_KEY = "zero_offload_scaler"
SHARDED_KEY = "zero_offload_sharded"  # in a loaded meta dict: the checkpoint directory
_ALIASES = "zero_offload_aliases"  # state_dict key -> name of the trained parameter it holds


def optimizer_entry(full: dict[str, Any]) -> dict[str, Any]:
    """The optimizer part of ``engine.full_state_dict()``, with the fp16 loss scaler if any."""
    if full.get("scaler"):
        return {**full["optimizer"], SCALER_KEY: full["scaler"]}
    return full["optimizer"]


def full_state(model: dict[str, Any], optimizer: dict[str, Any] | None) -> dict[str, Any]:
    """The argument of ``engine.load_full_state_dict`` from a model and an optimizer entry."""
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        optimizer = dict(optimizer)
        scaler = optimizer.pop(SCALER_KEY, None)
        state["optimizer"] = optimizer
        if scaler:
            state["scaler"] = scaler
    return state


def is_sharded(path: object) -> bool:
    return isinstance(path, (str, os.PathLike)) and (Path(path) / META).is_file()


def save_sharded(engine: ZeroOffload, meta: dict[str, Any], path: _PATH,
                 is_global_zero: bool) -> None:
    """Collective: every rank writes its shard, then rank 0 adds ``meta``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file; a sharded checkpoint is written as a directory")
    engine.save_checkpoint(path, sharded=True)
    if is_global_zero:
        trained = {id(s.param): s.name for s in engine.layout.slots}
        aliases = {
            key: trained[id(t)]
            for key, t in engine.module.state_dict(keep_vars=True).items()
            if id(t) in trained
        }
        engine_state.atomic_save({**meta, _ALIASES: aliases}, path / META)


def load_sharded_meta(path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
    """Rank 0's metadata; ``SHARDED_KEY`` names the directory for ``engine.load_checkpoint``."""
    meta = _load(Path(path) / META, map_location="cpu", weights_only=bool(weights_only))
    meta.pop(_ALIASES, None)
    meta[SHARDED_KEY] = str(path)
    return meta


def consolidate_checkpoint(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Turn a sharded Lightning checkpoint directory into one consolidated ``.ckpt`` file.

    The result loads with ``LightningModule.load_from_checkpoint`` and resumes with any
    strategy (``"state_dict"`` holds fp32 weights, ``"optimizer_states"`` AdamW's format).
    Needs host memory for the whole model's fp32 weights and moments.
    """
    import torch

    path = Path(path)
    if not is_sharded(path):
        raise ValueError(f"{path} is not a sharded zero_offload checkpoint (no {META} in it)")
    meta = _load(path / META, map_location="cpu", weights_only=False)
    aliases = meta.pop(_ALIASES)
    shards = engine_state.read_shard_dir(path)
    full = engine_state.consolidate(shards)
    extra = shards[0].get("module_extra", {})
    model = {
        key: full["model"][aliases[key]] if key in aliases else extra[key]
        for key in [*aliases, *extra]
    }
    meta["state_dict"] = model
    meta["optimizer_states"] = [optimizer_entry({**full, "scaler": shards[0].get("scaler")})]
    torch.save(meta, output)
