"""Checkpoint files: checksums, weights-only loads, atomic writes, temporaries, folder publish.

Every file carries a CRC-32 of its content (tensor bytes and plain values), checked on load;
every load is ``weights_only=True``, so a file cannot run code. A file is written under a
per-process temporary name next to the target and renamed over it. A sharded checkpoint is a
folder marked by :data:`MANIFEST` (JSON, written last): it is written under
``.NAME.tmp-TOKEN`` and published by two renames (the old folder to ``.NAME.old-TOKEN``, the new
one into place); a save killed between them leaves the old folder, which a load then falls back
to. Only folders holding a manifest and exactly the files it lists are ever replaced, and only
leftovers named as above whose process is gone are ever removed. What the files hold is
``formats``'s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import secrets
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_zero_offload.core.checkpoint import stream
from lightning_zero_offload.core.checkpoint.agreement import capture
from lightning_zero_offload.core.checkpoint.crc import CHECKSUM_KEY, checksum
from lightning_zero_offload.core.checkpoint.formats import (
    DIR_FORMAT,
    FULL_FORMAT,
    SHARD_FORMATS,
    CheckpointError,
)

MANIFEST = "zero_offload.json"  # marks (and completes) a checkpoint folder of this library
_SAVE_ERROR = "cannot save the checkpoint to"


# -- checksums ------------------------------------------------------------------------------------
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


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OS error of a save names the user's ``path`` and the reason, not the temporary name
    it happened on (that stays in the chained cause); the error's type is kept."""
    try:
        yield
    except OSError as e:
        if _SAVE_ERROR in str(e) and isinstance(e.__cause__, OSError):
            e = e.__cause__  # an inner save's (a shard in the temporary folder): name ``path``
        message = f"{_SAVE_ERROR} {str(path)!r}: {e.strerror or e}"
        raise (OSError(e.errno, message) if e.errno is not None else OSError(message)) from e


def atomic_save(obj: Mapping, path: str | os.PathLike, *, parents: bool = True) -> None:
    """``obj`` plus its checksum in ``torch.save``'s format (``stream.write``: a tensor at a
    time, ``stream.Later`` stand-ins made as they are written) to a per-process temporary name
    in the same folder (``parents``: created with its parents if missing), fsync, then renamed
    over ``path``: a crash leaves the old file or the new one."""
    path = check_name(path)
    publish_file(write_temp(obj, path, parents=parents), path)


def write_temp(obj: Mapping, path: Path, *, parents: bool = True) -> Path:
    """``obj`` written beside ``path`` under a temporary name (removed if the write fails)."""
    check_file_target(path)
    tmp = temp_path(path, "tmp", new_token())
    with writing(path):
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            stream.write(obj, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp


def publish_file(tmp: Path, path: Path) -> None:
    """What :func:`write_temp` wrote, renamed over ``path``."""
    with writing(path):
        try:
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
        # memory-mapped: a load holds file pages, which the kernel can drop, not a second copy
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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


def read_shards(path: Path, rank: int, world_size: int,
                keep: Callable[[dict], bool] | None = None) -> list[dict]:
    """This rank's shard if the folder was written at ``world_size``, else every shard (those
    ``keep`` accepts: the others are dropped as they are read)."""
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
    shards = (safe_load(path / n) for n in names)
    return [s for s in shards if keep is None or keep(s)]


def read_shard_dir(path: Path) -> list[dict]:
    """Every shard of a checkpoint folder (for consolidation)."""
    return read_shards(resolve(path), -1, 0)
