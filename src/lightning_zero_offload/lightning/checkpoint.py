"""Checkpoint layouts of the Lightning and Fabric strategies.

Consolidated (default): an ordinary Lightning/Fabric file. The model entry holds the fp32 master
weights keyed like the module, the optimizer entry ``torch.optim.AdamW``'s format (plus the fp16
loss scaler under :data:`SCALER_KEY` for "16-mixed"), so plain PyTorch, ``load_from_checkpoint``
and the default strategies can read it.

Sharded (``sharded_checkpoint=True``), for models too large to gather on one rank: a directory
written by ``ZeroOffload.save_checkpoint(sharded=True)`` (one file per rank) plus ``meta.pt`` from
rank 0 with everything else (loops, callbacks, schedulers, hyperparameters). It resumes at any
world size; :func:`consolidate_checkpoint` turns it into a consolidated file offline. Every file
of it is read weights-only (whatever ``weights_only`` Lightning passes: it drops the argument
when ``restore_checkpoint_after_setup`` is set) with its checksum verified.

A consolidated file carries the engine's checksum (:func:`with_checksum`, one extra string entry
that ``torch.load`` and ``load_from_checkpoint`` pass over), which the strategies verify when
they load it (:func:`load_single`): a damaged, truncated or unreadable file raises
:class:`CheckpointError` naming it. A file without the entry (written by another strategy, or
before the entry existed) still loads, with a warning that it could not be checked.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import zipfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities import rank_zero_warn

from lightning_zero_offload.core.checkpoint import files, formats, stream

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

    from lightning_zero_offload.core import ZeroOffload

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


def load_weights(module: torch.nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    """Whole tensors (a consolidated checkpoint's ``state_dict``) into ``module`` outside a fit:
    a DTensor parameter (``parallelize_module``, ``fully_shard``) takes this rank's piece, cut
    as DTensor cuts it (torch's ``set_model_state_dict``, every rank holding the whole dict)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in module.parameters()):
        module.load_state_dict(state_dict, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state_dict,
                         options=StateDictOptions(full_state_dict=True, strict=strict))


def with_checksum(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` plus its checksum under ``files.CHECKSUM_KEY`` (the engine's CRC-32)."""
    return {**checkpoint, files.CHECKSUM_KEY: files.checksum(checkpoint)}


def _local_torch_file(checkpoint_io: Any, path: object, storage_options: Any = None) -> bool:
    """Whether Lightning's own ``TorchCheckpointIO`` would write or read ``path`` on this
    machine's file system: then the engine writes it a tensor at a time, and reads it mapped."""
    return (type(checkpoint_io) is TorchCheckpointIO and storage_options is None
            and isinstance(path, (str, os.PathLike)) and "://" not in str(path))


def save_single(engine: ZeroOffload, checkpoint: dict[str, Any], path: _PATH, strategy: Any,
                storage_options: Any) -> None:
    """Collective. ``checkpoint`` (with ``engine.consolidated()``'s stand-ins) as one checksummed
    file of ``strategy`` (Lightning's or Fabric's): written a tensor at a time by the engine where
    Lightning's ``TorchCheckpointIO`` would write a local file; for another ``CheckpointIO`` its
    tensors are made whole first (the copy of the state the engine's writer avoids), and the save
    is blocking."""
    if _local_torch_file(strategy.checkpoint_io, path, storage_options):
        engine.save_file(checkpoint, path,  # type: ignore[arg-type]
                         blocking=not strategy.async_checkpoint)
        return
    checkpoint = stream.materialize(checkpoint)
    if strategy.is_global_zero:
        strategy.checkpoint_io.save_checkpoint(with_checksum(checkpoint), path,
                                               storage_options=storage_options)


def single_loader(checkpoint_io: Any, path: _PATH, weights_only: bool | None,
                  load: Callable[[], Any]) -> Callable[[], Any]:
    """``load``, or for a local ``torch.save`` file that Lightning's ``TorchCheckpointIO`` would
    read whole, ``torch.load(mmap=True)``: the file's pages, not a second copy in memory."""
    if not _local_torch_file(checkpoint_io, path) or not zipfile.is_zipfile(path):
        return load
    return functools.partial(torch.load, path, map_location="cpu", weights_only=weights_only,
                             mmap=True)


@contextlib.contextmanager
def _reading(path: _PATH) -> Iterator[None]:
    """A file that cannot be loaded raises a CheckpointError naming it (torch's own message for a
    file that is not a pickle advises ``weights_only=False``: wrong for a damaged file)."""
    try:
        yield
    except (formats.CheckpointError, FileNotFoundError, PermissionError, IsADirectoryError,
            MemoryError, torch.OutOfMemoryError, ConnectionError, TimeoutError):
        raise  # not the file's fault: a good checkpoint must not be called damaged
    except OSError as e:
        if e.errno != errno.EINVAL:  # a truncated file reads as EINVAL through fsspec
            raise
        _damaged(path, e)
    except Exception as e:
        unsafe = files._unsafe_types(e)
        what = [line.strip() for line in str(e).splitlines() if "Unsupported global" in line]
        if unsafe and what:  # a readable pickle of other types (hyperparameters, say)
            raise formats.CheckpointError(
                f"checkpoint file {str(path)!r} holds objects other than tensors and plain Python "
                f"values; they are not loaded, since unpickling them could run code ({what[0]}). "
                "If you trust the file, allow their types with torch.serialization.add_safe_globals"
            ) from None
        _damaged(path, e.__context__ if unsafe and e.__context__ else e)  # the unpickler's words


def _damaged(path: _PATH, cause: BaseException) -> None:
    detail = (str(cause).splitlines() or [""])[0][:200]
    raise formats.CheckpointError(
        f"checkpoint file {str(path)!r} cannot be read: it is damaged, truncated or not a "
        f"checkpoint ({type(cause).__name__}: {detail}). Use another checkpoint."
    ) from None


def load_single(path: _PATH, load: Callable[[], Any], entries: Collection[str]) -> dict[str, Any]:
    """``load()``'s single-file checkpoint with its checksum verified and removed; ``entries``
    are the keys it must hold. A file without a checksum loads, with a warning if it is to fill
    the offloaded objects (``entries``): a file of the user's own other state needs none."""
    with _reading(path):
        checkpoint = load()
    name = str(path)
    if not isinstance(checkpoint, dict):
        raise formats.CheckpointError(f"{name!r} is not a checkpoint (it holds a "
                                      f"{type(checkpoint).__name__}); use another checkpoint")
    saved = checkpoint.pop(files.CHECKSUM_KEY, None)
    if saved is not None and saved != files.checksum(checkpoint):
        raise formats.CheckpointError(
            f"checkpoint file {name!r} is damaged: its content does not match the checksum "
            "written with it (a changed byte on disk or in transfer). Use another checkpoint."
        )
    missing = [key for key in entries if key not in checkpoint]
    if missing:
        raise formats.CheckpointError(
            f"{name!r} is not a checkpoint to load here: it has no {missing[0]!r} entry (it holds "
            f"{sorted(map(str, checkpoint))[:6]}). Use another checkpoint."
        )
    if saved is None and entries:
        rank_zero_warn(f"checkpoint {name!r} has no zero_offload checksum (it was not written by "
                       "the zero_offload strategy), so it cannot be checked for damage; loading "
                       "it as it is")
    return checkpoint


def _sharded_dir(path: object) -> Path | None:
    """The folder to read if ``path`` is a sharded checkpoint (or a save killed while replacing
    one left the previous folder; see ``files.resolve``)."""
    if not isinstance(path, (str, os.PathLike)) or str(path).startswith(("http:", "https:")):
        return None
    try:
        folder = files.resolve(path) if not Path(path).exists() else Path(path)
    except formats.CheckpointError:
        return None
    return folder if (folder / META).is_file() else None


def is_sharded(path: object) -> bool:
    return _sharded_dir(path) is not None


def save_sharded(engine: ZeroOffload, meta: dict[str, Any], path: _PATH, strategy: Any) -> None:
    """Collective: every rank writes its shard, rank 0 adds ``meta``, published as one folder
    (with ``strategy.async_checkpoint``: once every rank wrote it, see ``save_checkpoint``)."""
    trained = {id(s.param): s.name for s in engine.layout.slots}
    aliases = {
        key: trained[id(t)]
        for key, t in engine.module.state_dict(keep_vars=True).items()
        if id(t) in trained
    }
    extra = {META: {**meta, _ALIASES: aliases}} if strategy.is_global_zero else None
    engine.save_checkpoint(path, sharded=True, extra=extra, blocking=not strategy.async_checkpoint)


def _read_meta(folder: Path) -> dict[str, Any]:
    return files.load_file(folder / META)  # weights only, checksum verified


def load_sharded_meta(path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
    """Rank 0's metadata; ``SHARDED_KEY`` names the directory for ``engine.load_checkpoint``.
    ``weights_only`` is ignored: the metadata is always loaded weights-only."""
    folder = _sharded_dir(path)
    if folder is None:
        raise formats.CheckpointError(f"{path} is not a sharded zero_offload checkpoint "
                                           f"(no {META} in it)")
    meta = _read_meta(folder)
    meta.pop(_ALIASES, None)
    meta[SHARDED_KEY] = str(folder)
    return meta


def consolidate_checkpoint(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Turn a sharded Lightning checkpoint directory into one consolidated ``.ckpt`` file.

    The result loads with ``LightningModule.load_from_checkpoint`` and resumes with any
    strategy (``"state_dict"`` holds fp32 weights, ``"optimizer_states"`` AdamW's format).
    Needs host memory for the whole model's fp32 weights and moments.
    """
    import torch

    folder = _sharded_dir(path)
    if folder is None:
        raise ValueError(f"{path} is not a sharded zero_offload checkpoint (no {META} in it)")
    meta = _read_meta(folder)
    aliases = meta.pop(_ALIASES)
    path = folder
    shards = files.read_shard_dir(path)
    full = formats.consolidate(shards)
    extra = shards[0].get("module_extra", {})
    model = {
        key: full["model"][aliases[key]] if key in aliases else extra[key]
        for key in [*aliases, *extra]
    }
    meta["state_dict"] = model
    meta["optimizer_states"] = [optimizer_entry({**full, "scaler": shards[0].get("scaler")})]
    output = files.check_name(output)
    tmp = files.temp_path(output, "tmp", files.new_token())
    try:  # a plain Lightning file (plus the checksum), renamed into place when complete
        torch.save(with_checksum(meta), tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def _refusing_sharded(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def pl_load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        if is_sharded(path_or_url):
            raise formats.CheckpointError(
                f"{str(path_or_url)!r} is a sharded zero_offload checkpoint (a folder with one "
                "file per rank), which load_from_checkpoint cannot read. Consolidate it first: "
                "lightning_zero_offload.lightning.consolidate_checkpoint(folder, 'model.ckpt'), "
                "then load 'model.ckpt'; or resume training from it with "
                "Trainer(strategy='zero_offload').fit(model, ckpt_path=folder)"
            )
        return load(path_or_url, *args, **kwargs)

    pl_load.zero_offload_guard = True  # type: ignore[attr-defined]
    return pl_load


_LOADER = "pl_load"


def install_load_guard() -> None:
    """Make ``LightningModule.load_from_checkpoint(sharded_folder)`` raise a clear error instead
    of ``IsADirectoryError`` (wraps the loader Lightning calls; other paths are unchanged)."""
    from lightning.pytorch.core import saving

    loader = getattr(saving, _LOADER)  # the name Lightning calls at load time (not exported)
    if not getattr(loader, "zero_offload_guard", False):
        setattr(saving, _LOADER, _refusing_sharded(loader))


install_load_guard()
