"""Asynchronous saves: the caller waits only for a copy of the state in host memory, a thread
writes it, and the checkpoint is published once every rank's write succeeded.

The copy is checked first against the host's available memory; where it does not fit, one
warning names the bytes short and the save is blocking. A save in flight is settled (published,
or its failure raised on every rank, naming the file, the previous checkpoint intact) by
:meth:`PendingSave.wait` or by the engine's next ``step`` once every rank's write has ended; with
one rank the thread publishes it itself. A second save, a load and ``teardown`` wait for it. A
save still unsettled when the interpreter exits is written (the interpreter waits for its
thread) and settled at exit: published where every rank can still agree, else one warning
naming the path and why, nothing of it left; the process exits with the script's own status.
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist

from lightning_zero_offload._units import format_bytes
from lightning_zero_offload.core.checkpoint import agreement, files, stream
from lightning_zero_offload.core.checkpoint.crc import tensors
from lightning_zero_offload.core.checkpoint.formats import CheckpointError

if TYPE_CHECKING:
    from lightning_zero_offload.core.checkpoint.engine_state import EngineState


_WHAT = "agreement on an asynchronous save"
_UNSETTLED: dict[PendingSave, None] = {}  # in start order: what the exit settles


class PendingSave:
    """A save in flight (``save_checkpoint(..., blocking=False)``): ``done()``, ``wait()``."""

    def __init__(self, state: EngineState, path: Path, write: Callable[[], None],
                 publish: Callable[[], None], discard: Callable[[], object]) -> None:
        self.path, self._state = path, state
        self._write, self._publish, self._discard = write, publish, discard
        self._error: BaseException | None = None
        self._settled = False
        self.owner: object = None  # kept alive until settled (the engine: its process group)
        # registered anew: exit hooks run last-registered first, so this one runs before any
        # registered since (one that destroys the process groups)
        atexit.unregister(_settle_at_exit)
        atexit.register(_settle_at_exit)
        _UNSETTLED[self] = None
        # not a daemon: an interpreter that exits first waits for the write (and, alone, publish)
        self._thread = threading.Thread(target=self._run, name="zero-offload-save")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
            if self._state.files_rank[1] == 1:  # alone: nobody to agree with
                self._publish()
        except BaseException as e:  # raised in the caller's thread when it settles
            self._error = e

    def done(self) -> bool:
        """Local: whether this rank's write has ended (written, or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Collective: the checkpoint is written and published, or this raises on every rank."""
        self._thread.join()
        self._settle()

    def poll(self) -> bool:
        """Collective (the engine's ``step``): settle once every rank's write has ended; whether
        it has."""
        if not self._settled:
            ended = self.done()
            if self._state.files_rank[1] > 1:
                ended = self._state.max_over_ranks(float(not ended), _WHAT) == 0
            if ended:
                self._settle()
        return self._settled

    def abandon(self) -> None:
        """Local (a run that failed: no collective): wait for this rank's write and drop what
        was not published."""
        self._thread.join()
        if not self._settled and self._state.files_rank[0] == 0 and (
                self._state.files_rank[1] > 1 or self._error is not None):
            self._discard()
        self._ended()

    def _ended(self) -> None:
        self._settled, self.owner = True, None
        _UNSETTLED.pop(self, None)

    def settle_at_exit(self) -> None:
        """The interpreter exits with this save unsettled: published where every rank can
        still agree, else one warning naming the path and why, nothing of it left. Never
        raises (the process exits with the script's own status)."""
        world = self._state.files_rank[1]
        why = None
        if world > 1 and getattr(sys, "last_value", None) is not None:
            why = "the script ended with an uncaught error, so the ranks cannot agree on it"
        elif world > 1 and not dist.is_initialized():
            why = "the process group was destroyed before the ranks agreed on it"
        if why is None:
            try:
                self.wait()
                return
            except BaseException as e:
                why = f"{type(e).__name__}: {e}"
        else:
            self.abandon()
        warnings.warn(
            f"the asynchronous save of {str(self.path)!r} was not published at exit ({why}); "
            "the previous checkpoint is intact. Wait for a save before the script ends or "
            "destroys its process group: engine.wait_for_save() (Lightning and Fabric: "
            "strategy.wait_for_save())", RuntimeWarning, stacklevel=1)

    def _settle(self) -> None:
        if self._settled:
            return
        self._settled = True  # the owner (its process group) is kept until the agreement ends
        rank, world, group = self._state.files_rank
        try:
            if world == 1:
                if self._error is not None:
                    raise self._error
                return
            agreement.agree(self._error, world, group, self._state.coll())
            error = agreement.capture(self._publish) if rank == 0 else None
            agreement.agree(error, world, group, self._state.coll())
        except BaseException as e:
            if rank == 0:
                self._discard()
            if isinstance(e, CheckpointError) and self._error is None:
                raise CheckpointError(
                    f"the asynchronous save of {str(self.path)!r} failed on another rank ({e}); "
                    "it was not published, the previous checkpoint is intact") from e
            raise
        finally:
            self._ended()


class InFlight:
    """The engine's save in flight, if any."""

    def __init__(self) -> None:
        self.save: PendingSave | None = None
        self.staging: list[torch.Tensor] = []  # the last snapshot's memory, for the next one

    @property
    def held(self) -> int:
        return sum(t.nbytes for t in self.staging)

    def budget(self) -> dict[str, int]:
        """The kept snapshot as a host budget entry (``save_snapshot``), once one exists."""
        return {"save_snapshot": self.held} if self.staging else {}

    def hold(self, save: PendingSave, owner: object = None) -> PendingSave:
        self.save, save.owner = save, owner
        return save

    def settle(self) -> None:
        """Collective while a save is in flight: it ends (published, or raising)."""
        if self.save is not None:
            save, self.save = self.save, None
            save.wait()

    def poll(self) -> None:
        """Collective while a save is in flight (every step): settled once every rank wrote."""
        if self.save is not None:
            save, self.save = self.save, None
            if not save.poll():
                self.save = save

    def abandon(self) -> None:
        """Local (a failed run): a save in flight is dropped unpublished once written; the
        snapshot's memory goes."""
        if self.save is not None:
            save, self.save = self.save, None
            save.abandon()
        self.staging = []

    def close(self) -> None:
        """Collective (``teardown``): the save in flight ends; the snapshot's memory goes."""
        self.settle()
        self.staging = []


def _settle_at_exit() -> None:
    for save in list(_UNSETTLED):
        try:
            save.settle_at_exit()
        except BaseException as e:  # e.g. warnings as errors: the next save is still settled
            print(f"lightning_zero_offload: the asynchronous save of {str(save.path)!r} was not "
                  f"settled at exit: {type(e).__name__}: {e}", file=sys.stderr)


def _nbytes(obj: Any) -> int:
    """Host bytes of ``obj``'s copy: its stand-ins made and its tensors cloned."""
    return sum(x.numel() * x.element_size() for x in [*stream.laters(obj), *tensors(obj)])


def _room(state: EngineState, needed: int, path: Path) -> bool:
    """Collective: whether every rank has ``needed`` bytes for its copy; else one warning."""
    short = state.max_over_ranks(float(max(0, needed - psutil.virtual_memory().available)),
                                 _WHAT)
    if short > 0 and state.files_rank[0] == 0:
        warnings.warn(
            f"not enough host memory for an asynchronous save of {str(path)!r}: its copy of the "
            f"state is {format_bytes(int(short), exact=True)} short of what is available (on "
            "the rank shortest of it); saving it blocking instead", stacklevel=4)
    return short == 0


def _copied(state: EngineState, obj: Any) -> Any:
    """``obj`` with its stand-ins made and every tensor copied: the snapshot a thread writes,
    into the previous snapshot's memory where it fits (kept for the next save)."""
    return stream.materialize(obj, clone_tensors=True, into=state.saves.staging)


def start_file(state: EngineState, obj: dict, path: Path) -> PendingSave | None:
    """Collective. A single file (``obj`` may hold stand-ins) that rank 0 writes, or None where
    the copy does not fit (then the caller saves blocking)."""
    on_zero = state.files_rank[0] == 0
    state.agree(agreement.capture(lambda: files.check_file_target(path)) if on_zero else None)
    if not _room(state, _nbytes(obj) - state.saves.held if on_zero else 0, path):
        return None
    if not on_zero:
        stream.make_all(obj)  # this rank's part of the gathers, nothing kept
        return PendingSave(state, path, lambda: None, lambda: None, lambda: None)
    snapshot, temp = _copied(state, obj), []
    write = lambda: temp.append(files.write_temp(snapshot, path))  # noqa: E731
    return PendingSave(state, path, write, lambda: files.publish_file(temp[0], path),
                       lambda: [files.discard(t) for t in temp])


def start_dir(state: EngineState, path: Path, shard: dict,
              extra: dict[str, dict]) -> PendingSave | None:
    """Collective. A sharded folder: every rank writes its shard, rank 0 also ``extra``."""
    rank, world, group = state.files_rank
    if not _room(state, _nbytes(shard) - state.saves.held, path):
        return None
    on_zero = rank == 0
    token, error = files.begin_dir(path) if on_zero else ("", None)
    token = agreement.share_token(token, world, group, state.coll())
    if error is not None or not token:
        raise error or CheckpointError(
            f"rank 0 could not start the checkpoint at {str(path)!r} (see its error)")
    tmp = files.temp_path(path, "tmp", token)
    snapshot = _copied(state, shard)
    extras = stream.materialize(extra, clone_tensors=True) if on_zero else {}

    def write() -> None:  # into rank 0's folder: never made again once it was discarded
        with files.writing(path):
            files.atomic_save(snapshot, tmp / files.shard_name(rank, world), parents=False)
            for name, obj in extras.items():
                files.atomic_save(obj, tmp / name, parents=False)

    def publish() -> None:
        if on_zero:
            with files.writing(path):
                files.publish_dir(tmp, path, world, token)

    return PendingSave(state, path, write, publish, lambda: files.discard(tmp))
