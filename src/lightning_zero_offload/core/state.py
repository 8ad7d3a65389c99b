"""Checkpoint formats and files: per-rank shards, the consolidated (torch AdamW) form, atomic I/O.

A shard is ``ZeroOffload.state_dict()``: this rank's fp32 master weights and its moments per group
as the engine holds them (``"moment_dtype"``: fp32, bf16, or 8-bit codes with their per-block
``exp_avg_scales``/``exp_avg_sq_scales``; format ``/1`` shards are fp32), step counts,
hyperparameters, the loss scaler and the layout that produced it. The layout lets
:func:`consolidate` rebuild the full, world-size-independent form from all shards: a fp32 model
state_dict plus a ``torch.optim.AdamW``-format optimizer state_dict.

Files: every file carries a CRC-32 of its content (tensor bytes and plain values), checked on
load; every load is ``weights_only=True``, so a file cannot run code. A file is written under a
per-process temporary name next to the target and renamed over it. A sharded checkpoint is a
folder marked by :data:`MANIFEST` (JSON, written last): it is written under
``.NAME.tmp-TOKEN`` and published by two renames (the old folder to ``.NAME.old-TOKEN``, the new
one into place); a save killed between them leaves the old folder, which a load then falls back
to. Only folders holding a manifest and exactly the files it lists are ever replaced, and only
leftovers named as above whose process is gone are ever removed.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import secrets
import shutil
import socket
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.collectives import capture
from lightning_zero_offload.ops.moments import MOMENT_DTYPES, Moments, num_blocks

MOMENT_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}

SHARD_FORMAT = "lightning_zero_offload.shard/2"  # /2: compact moments ("moment_dtype")
SHARD_FORMATS = ("lightning_zero_offload.shard/1", SHARD_FORMAT)  # what loads read
FULL_FORMAT = "lightning_zero_offload.full/1"
DIR_FORMAT = "lightning_zero_offload.dir/1"
MANIFEST = "zero_offload.json"  # marks (and completes) a checkpoint folder of this library
CHECKSUM_KEY = "zero_offload_checksum"


class CheckpointError(ValueError):
    """A checkpoint that does not exist, cannot be read, or does not fit this engine."""


def group_hparams(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def shard_moment_dtype(shard: dict) -> str:
    """The moment format of a shard (format ``/1`` shards hold fp32 moments)."""
    return shard.get("moment_dtype", "fp32")


def group_moments(shard: dict, g: int) -> Moments:
    """Group ``g``'s saved moments as ``ops.Moments`` (views of the shard's tensors)."""
    grp = shard["groups"][g]
    return Moments(shard_moment_dtype(shard), grp["exp_avg"], grp["exp_avg_sq"],
                   grp.get("exp_avg_scales"), grp.get("exp_avg_sq_scales"))


def moments_fields(mom: Moments) -> dict[str, Tensor]:
    """The tensors a shard group stores for ``mom`` (the inverse of :func:`group_moments`)."""
    out = {"exp_avg": mom.exp_avg, "exp_avg_sq": mom.exp_avg_sq}
    if mom.exp_avg_scales is not None and mom.exp_avg_sq_scales is not None:
        out["exp_avg_scales"], out["exp_avg_sq_scales"] = mom.exp_avg_scales, mom.exp_avg_sq_scales
    return out


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
            sl = slice(start + r * size, start + (r + 1) * size)
            flats["master"][g][sl] = by_rank[r]["groups"][g]["master"][host : host + size]
            # Compact moments are dequantized bucket shard by bucket shard (block-aligned).
            m, v = group_moments(by_rank[r], g).chunk(host, size).to_fp32()
            flats["exp_avg"][g][sl], flats["exp_avg_sq"][g][sl] = m, v
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


# -- checksums ------------------------------------------------------------------------------------
def _feed(obj: Any, crc: int) -> int:
    """CRC-32 over a canonical walk of ``obj``: tensors by dtype, shape and bytes, plain values by
    repr; other objects by type only (their repr may hold addresses)."""
    if isinstance(obj, Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"T{t.dtype}{tuple(obj.shape)}".encode(), crc)
        data = memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]  # a buffer
        return zlib.crc32(data, crc) if t.numel() else crc
    if isinstance(obj, Mapping):
        crc = zlib.crc32(f"D{len(obj)}".encode(), crc)
        for key in sorted(obj, key=repr):
            crc = _feed(obj[key], _feed(key, crc))
        return crc
    if isinstance(obj, (list, tuple)):
        crc = zlib.crc32(f"L{len(obj)}".encode(), crc)
        for item in obj:
            crc = _feed(item, crc)
        return crc
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype)):
        return zlib.crc32(f"{type(obj).__name__}:{obj!r}".encode(), crc)
    return zlib.crc32(f"O{type(obj).__qualname__}".encode(), crc)


def checksum(obj: Mapping) -> str:
    """The checksum stored under :data:`CHECKSUM_KEY` (computed without that entry)."""
    return f"crc32:{_feed({k: v for k, v in obj.items() if k != CHECKSUM_KEY}, 0):08x}"


def _verify(obj: dict, path: Path) -> dict:
    saved = obj.pop(CHECKSUM_KEY, None)
    if saved is None:
        raise CheckpointError(f"checkpoint file {str(path)!r} has no checksum (not written by this "
                              "version of lightning_zero_offload); use another checkpoint")
    if saved != checksum(obj):
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is damaged: its content does not match the checksum "
            "written with it (a changed byte on disk or in transfer). Use another checkpoint."
        )
    return obj


# -- names ----------------------------------------------------------------------------------------
def check_name(path: str | os.PathLike) -> Path:
    """``path`` as a Path, refusing names that cannot be written atomically (``""``, ``"."``)."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise CheckpointError(
            f"checkpoint path {str(path)!r} has no file or folder name to write; give one, "
            "e.g. 'checkpoints/step-100'"
        )
    return p


def new_token() -> str:
    """Unique per save and process; holds the pid and host so leftovers can be told stale."""
    return f"{os.getpid()}-{secrets.token_hex(4)}-{socket.gethostname()}"


def temp_path(path: Path, kind: str, token: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{token}")


def _leftovers(path: Path, kind: str) -> list[tuple[Path, int, str | None]]:
    """``(entry, pid, host)`` of our temporaries beside ``path`` (old ``.NAME.tmp-PID`` too)."""
    pattern = re.compile(re.escape(f".{path.name}.{kind}-") + r"(\d+)(?:-[0-9a-f]{8}-(.+))?")
    found = []
    for entry in path.parent.iterdir() if path.parent.is_dir() else []:
        m = pattern.fullmatch(entry.name)
        if m:
            found.append((entry, int(m.group(1)), m.group(2)))
    return found


def _owner_gone(pid: int, host: str | None) -> bool:
    if host not in (None, socket.gethostname()) or pid == os.getpid():
        return False  # another machine's process may still be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def clean_leftovers(path: Path) -> None:
    """Remove temporaries of killed saves beside ``path`` (only while ``path`` itself exists,
    since an ``.old`` folder may then be the only copy)."""
    if not path.exists():
        return
    for kind in ("tmp", "old"):
        for entry, pid, host in _leftovers(path, kind):
            if _owner_gone(pid, host):
                _remove(entry)


def resolve(path: str | os.PathLike) -> Path:
    """``path``, or, if a save was killed while publishing it, the previous folder it left."""
    path = Path(path)
    if path.exists():
        return path
    olds = [e for e, _, _ in _leftovers(path, "old") if (e / MANIFEST).is_file()]
    if not olds:
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    old = max(olds, key=lambda e: (e / MANIFEST).stat().st_mtime)
    warnings.warn(
        f"checkpoint {str(path)!r} is missing: a save was killed while replacing it. Loading the "
        f"previous checkpoint it left at {str(old)!r} (rename it to {path.name!r} to keep it).",
        stacklevel=3,
    )
    return old


# -- files ----------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. Windows); the rename itself is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_file_target(path: Path) -> None:
    if path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a folder; a single-file checkpoint cannot "
                              "replace it (use another name, or sharded=True for a folder)")


def atomic_save(obj: Mapping, path: str | os.PathLike) -> None:
    """``torch.save`` of ``obj`` plus its checksum to a per-process temporary name in the same
    folder, fsync, then rename over ``path``: a crash leaves the old file or the new one."""
    path = check_name(path)
    check_file_target(path)
    tmp = temp_path(path, "tmp", new_token())
    try:
        with open(tmp, "wb") as f:
            torch.save({**obj, CHECKSUM_KEY: checksum(obj)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    clean_leftovers(path)


def _unsafe_types(e: BaseException) -> bool:
    return isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower()


def _load_raw(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated/corrupt archives
        if _unsafe_types(e):  # torch's message is long; its "Unsupported global" line names it
            what = next((line.strip() for line in str(e).splitlines()
                         if "Unsupported global" in line), "")
            raise CheckpointError(
                f"checkpoint file {str(path)!r} holds objects other than tensors and plain Python "
                f"values; they are not loaded, since unpickling them could run code ({what}). If "
                "you trust the file, allow their types with torch.serialization.add_safe_globals"
            ) from None
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read; it is corrupt or truncated "
            f"({type(e).__name__}: {e}). Use another checkpoint."
        ) from None


def load_file(path: str | os.PathLike) -> dict:
    """A file written by :func:`atomic_save`: weights only, to the CPU, checksum verified."""
    path = Path(path)
    obj = _load_raw(path)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{str(path)!r} is not a lightning_zero_offload checkpoint")
    return _verify(obj, path)


def safe_load(path: str | os.PathLike) -> dict:
    """A shard or consolidated file (:func:`load_file` plus the format marker check)."""
    path = Path(path)
    obj = _load_raw(path)
    if not isinstance(obj, dict) or obj.get("format") not in (*SHARD_FORMATS, FULL_FORMAT):
        raise CheckpointError(
            f"{str(path)!r} is not a lightning_zero_offload checkpoint (no 'format' marker); "
            "for a plain model/optimizer state use ZeroOffload.load_full_state_dict"
        )
    return _verify(obj, path)


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


# -- folders --------------------------------------------------------------------------------------
def read_manifest(path: Path, *, vanished_ok: bool = False) -> dict:
    """The folder's manifest; ``vanished_ok``: a missing one raises FileNotFoundError as is."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        if vanished_ok and isinstance(e, FileNotFoundError):
            raise
        raise CheckpointError(f"checkpoint folder {str(path)!r}: {MANIFEST} cannot be read ({e}); "
                              "the save did not finish. Use another checkpoint.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != DIR_FORMAT:
        raise CheckpointError(f"checkpoint folder {str(path)!r}: {MANIFEST} is not ours")
    return manifest


def check_target(path: Path) -> None:
    """Refuse to replace anything but an empty folder or a complete checkpoint folder of ours."""
    try:
        _check_target(path)
    except FileNotFoundError:
        pass  # moved away meanwhile by another save of the same path: nothing to replace


def _check_target(path: Path) -> None:
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a file; a sharded checkpoint is written as a "
                              "folder (use another name, or sharded=False for one file)")
    entries = sorted(e.name for e in path.iterdir())
    if not entries:
        return
    if MANIFEST not in entries:
        raise CheckpointError(
            f"{str(path)!r} is a folder holding files not written by lightning_zero_offload "
            f"(e.g. {entries[0]!r}); it is not replaced. Save to a new or empty folder."
        )
    saved = read_manifest(path, vanished_ok=True)["files"]
    foreign = sorted(set(entries) - {MANIFEST, *saved})
    if foreign:
        raise CheckpointError(
            f"checkpoint folder {str(path)!r} also holds files it was not saved with "
            f"({foreign[:3]}); replacing it would delete them. Move them, or save elsewhere."
        )


def begin_dir(path: Path) -> tuple[str, Exception | None]:
    """Rank 0: check the target and create the temporary folder; ``(token, None)`` or
    ``("", error)``."""
    token = new_token()
    error = capture(lambda: (check_target(path), temp_path(path, "tmp", token).mkdir(parents=True)))
    return ("", error) if error else (token, None)


def discard(entry: Path) -> None:
    """Remove a temporary of this save (a no-op once it was published)."""
    if entry.exists():
        _remove(entry)


def publish_dir(tmp: Path, path: Path, world_size: int, token: str) -> None:
    """Mark ``tmp`` complete (manifest of its files) and move it to ``path`` (rank 0 only)."""
    files = sorted(e.name for e in tmp.iterdir())
    manifest = {"format": DIR_FORMAT, "world_size": world_size, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = temp_path(path, "old", token)
    for _ in range(1000):  # another process may publish the same path between our renames
        _remove(old)
        check_target(path)  # again: what is there now is what gets moved aside and deleted
        try:
            os.replace(path, old)
        except FileNotFoundError:
            pass
        try:
            os.rename(tmp, path)
            break
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    else:
        raise CheckpointError(f"could not publish the checkpoint at {str(path)!r}: other saves "
                              "keep replacing it")
    _fsync_dir(path.parent)
    _remove(old)
    clean_leftovers(path)


def read_shards(path: Path, rank: int, world_size: int) -> list[dict]:
    """This rank's shard if the folder was written at ``world_size``, else every shard."""
    manifest = read_manifest(path)
    mine = shard_name(rank, world_size)
    if manifest["world_size"] == world_size and mine in manifest["files"]:
        names = [mine]
    else:
        names = [n for n in manifest["files"] if n.startswith("shard-")]
    missing = [n for n in names if not (path / n).is_file()]
    if missing or not names:
        raise CheckpointError(f"checkpoint folder {str(path)!r} lacks shard files "
                              f"{missing or ['shard-*']}; use another checkpoint")
    return [safe_load(path / n) for n in names]


def read_shard_dir(path: Path) -> list[dict]:
    """Every shard of a checkpoint folder (for consolidation)."""
    return read_shards(resolve(path), -1, 0)


def shard_numel(desc: dict, group: int) -> int:
    return sum(numel // desc["world_size"] for g, _, numel, _ in desc["buckets"] if g == group)


def validate_shards(shards: list[dict], expected: Mapping[str, tuple[str | None, tuple]]) -> None:
    """Check shards against each other and the module before anything is loaded.

    ``expected`` maps each key of the module's state_dict to ``(name of the trained parameter it
    holds or None, shape)``; trained ones must be in the layout, the rest in ``module_extra``.
    """
    first = shards[0]
    for s in shards:
        if (s.get("format") not in SHARD_FORMATS or s["layout"] != first["layout"]
                or shard_moment_dtype(s) != shard_moment_dtype(first)):
            raise CheckpointError("checkpoint shards come from different saves; use another "
                                  "checkpoint")
        check_shard_groups(s, [shard_numel(s["layout"], g) for g in range(len(s["groups"]))],
                           f"shard of rank {s['rank']}")
    _check_module(first, expected)


def check_shard_groups(shard: dict, numels: list[int], who: str) -> None:
    """Every group of ``shard`` holds ``numels[g]`` elements of master and moments, in the
    dtypes its ``moment_dtype`` names, with one scale per block for 8-bit moments."""
    md = shard_moment_dtype(shard)
    if md not in MOMENT_DTYPES:
        raise CheckpointError(f"{who}: unknown moment_dtype {md!r}; use another checkpoint")
    if len(shard["groups"]) != len(numels):
        raise CheckpointError(f"{who}: {len(shard['groups'])} groups, expected {len(numels)}")
    for g, (grp, n) in enumerate(zip(shard["groups"], numels, strict=True)):
        want = {"master": (n, torch.float32), "exp_avg": (n, MOMENT_STORAGE[md]),
                "exp_avg_sq": (n, MOMENT_STORAGE[md])}
        if md == "int8":
            want["exp_avg_scales"] = want["exp_avg_sq_scales"] = (num_blocks(n), torch.float32)
        for key, (numel, dtype) in want.items():
            t = grp.get(key)
            if not isinstance(t, Tensor) or t.numel() != numel or t.dtype != dtype:
                raise CheckpointError(
                    f"{who}: group {g} {key} has the wrong size or dtype (expected {numel} "
                    f"{dtype} for {md} moments; corrupt shard?); use another checkpoint")


def _check_module(shard: dict, expected: Mapping[str, tuple[str | None, tuple]]) -> None:
    params = {name: tuple(shape) for name, _, _, _, _, shape in shard["layout"]["params"]}
    extra = shard["module_extra"]
    for key, (trained, shape) in expected.items():
        saved = params.get(trained) if trained is not None else (
            tuple(extra[key].shape) if key in extra else None)
        if saved is None:
            raise CheckpointError(f"the checkpoint has no entry for {key!r}: it was written for "
                                  "a different model")
        if saved != tuple(shape):
            raise CheckpointError(f"{key!r} has shape {saved} in the checkpoint, the module has "
                                  f"{tuple(shape)}: it was written for a different model")
    unexpected = sorted(set(extra) - set(expected))
    if unexpected:
        raise CheckpointError(f"the checkpoint holds {unexpected[:5]}, which the module lacks: "
                              "it was written for a different model")
