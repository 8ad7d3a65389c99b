"""Checkpoint formats and files: per-rank shards, the consolidated (torch AdamW) form, atomic I/O.

A shard is ``ZeroOffload.state_dict()``: this rank's fp32 master weights and moments per group,
step counts, hyperparameters, the loss scaler and the layout that produced it. The layout lets
:func:`consolidate` rebuild the full, world-size-independent form from all shards: a fp32 model
state_dict plus a ``torch.optim.AdamW``-format optimizer state_dict.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

SHARD_FORMAT = "lightning_zero_offload.shard/1"
FULL_FORMAT = "lightning_zero_offload.full/1"


class CheckpointError(ValueError):
    """A checkpoint that does not exist, cannot be read, or does not fit this engine."""


def group_hparams(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def consolidate(shards: list[dict]) -> dict:
    """Full state ``{"model": {name: fp32}, "optimizer": AdamW state_dict}`` from every shard.

    ``model`` holds the trained parameters only (first name of tied ones); callers add buffers.
    """
    if not shards:
        raise CheckpointError("consolidate: no shards given")
    desc = shards[0]["layout"]
    world = desc["world_size"]
    by_rank = {s["rank"]: s for s in shards}
    if sorted(by_rank) != list(range(world)):
        raise CheckpointError(
            f"consolidate: the checkpoint was written by {world} ranks but shards for ranks "
            f"{sorted(by_rank)} were found; all {world} shard files are needed"
        )
    keys = ("master", "exp_avg", "exp_avg_sq")
    flats = {k: [torch.zeros(n) for n in desc["group_numel"]] for k in keys}
    for g, start, numel, host in desc["buckets"]:
        size = numel // world
        for r in range(world):
            for k in keys:
                flats[k][g][start + r * size : start + (r + 1) * size] = by_rank[r]["groups"][g][
                    k
                ][host : host + size]
    steps = [int(grp["step"]) for grp in shards[0]["groups"]]
    return assemble(desc, flats, steps, shards[0]["param_groups"])


def assemble(desc: dict, flats: dict[str, list[Tensor]], steps: list[int],
             hparams: list[dict]) -> dict:
    """Full state from full flat fp32 buffers per group (``flats[key][group]``); without
    ``"master"`` the model is empty, without ``"exp_avg"``/``"exp_avg_sq"`` the optimizer state."""
    model: dict[str, Tensor] = {}
    state: dict[int, dict] = {}
    for name, g, index, offset, numel, shape in desc["params"]:
        sl = slice(offset, offset + numel)
        if "master" in flats:
            model[name] = flats["master"][g][sl].view(shape).clone()
        if steps[g] > 0 and "exp_avg" in flats:
            state[index] = {
                "step": torch.tensor(float(steps[g])),
                "exp_avg": flats["exp_avg"][g][sl].view(shape).clone(),
                "exp_avg_sq": flats["exp_avg_sq"][g][sl].view(shape).clone(),
            }
    param_groups, index = [], 0
    for hp, size in zip(hparams, desc["group_sizes"], strict=True):
        param_groups.append({**hp, "params": list(range(index, index + size))})
        index += size
    return {"model": model, "optimizer": {"state": state, "param_groups": param_groups}}


def atomic_save(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary name in the same folder, fsync, then rename over ``path``:
    a crash leaves either the old file or the new one, never a half-written file at ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def safe_load(path: str | os.PathLike) -> dict:
    """``torch.load`` (weights only, to the CPU) with a clear error for missing/corrupt files."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated/corrupt archives
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read; it is corrupt or truncated "
            f"({type(e).__name__}: {e}). Use another checkpoint."
        ) from None
    if not isinstance(obj, dict) or obj.get("format") not in (SHARD_FORMAT, FULL_FORMAT):
        raise CheckpointError(
            f"{str(path)!r} is not a lightning_zero_offload checkpoint (no 'format' marker); "
            "for a plain model/optimizer state use ZeroOffload.load_full_state_dict"
        )
    return obj


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def publish_dir(tmp: Path, path: Path) -> None:
    """Move a completely written checkpoint folder into place (rank 0 only)."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)


def read_shard_dir(path: Path) -> list[dict]:
    files = sorted(path.glob("shard-*-of-*.pt"))
    if not files:
        raise CheckpointError(f"checkpoint folder {str(path)!r} holds no shard files")
    return [safe_load(f) for f in files]
