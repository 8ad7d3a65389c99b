"""Every collective the engine issues, on its own process group with a timeout, and errors that
say what happened.

The engine copies the caller's process group into one of its own whose timeout is
``ZeroOffloadConfig.collective_timeout_s`` (the process-group defaults are 10 to 30 minutes), so
a rank that failed, or stopped calling ``step()``, ends its peers within that time instead of
hanging them. A rank that fails inside the engine, or tears down during an exception, leaves a
note in the process group's store; a peer whose collective then fails names that rank in its
error. A subgroup passed by the caller keeps its own timeout.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_KEY = "lightning_zero_offload/failed"
T = TypeVar("T")
_exit_hook_registered = False


class CollectiveError(RuntimeError):
    """A collective of the engine failed or timed out (usually: another rank failed)."""


def engine_group(group: Any, timeout_s: float | None) -> Any:
    """The process group the engine's collectives use: a copy of the default group with the
    timeout (collective over every process). A subgroup the caller passes is used as it is,
    with its own timeout: copying it would need every process of the default group."""
    if timeout_s is None or not (dist.is_available() and dist.is_initialized()):
        return group
    if group not in (None, dist.group.WORLD) or dist.get_world_size() == 1:
        return group
    return dist.new_group(timeout=timedelta(seconds=timeout_s), backend=dist.get_backend())


def release_group(group: Any, given: Any) -> None:
    """Destroy ``group`` if :func:`engine_group` or :func:`side_group` made it (not ``given``),
    so a torn-down or dropped engine leaves no group behind."""
    if group is not None and group is not given and dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except Exception:  # already gone with the default group
            pass


def destroy_at_exit() -> None:
    """Destroy every process group when the interpreter exits, unless the script did first
    (``accelerator.end_training()``, ``dist.destroy_process_group()``). A gloo group left to
    the interpreter's own exit can abort the process ("terminate called without an active
    exception"; about a third of 2-process exits on torch 2.13). Not after an uncaught error:
    a destroy waits for the collectives in flight, up to the timeout, while exiting at once
    closes the connections and so fails the peers at once."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_destroy_all)


def _destroy_all() -> None:
    if getattr(sys, "last_value", None) is not None:  # set by an uncaught exception
        return
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway; the abort this avoids is no worse
            pass


def side_group(group: Any, timeout_s: float | None) -> Any:
    """One more group over the same ranks (an emulated stream's own), with the timeout.
    Collective over every process of the default group (groups of the same ranks built with
    local synchronization would share a store prefix and could hang)."""
    ranks = None if group in (None, dist.group.WORLD) else dist.get_process_group_ranks(group)
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    return dist.new_group(ranks, timeout=timeout)


def report_failure(rank: int, error: BaseException) -> None:
    """Leave a note for the peers: this rank failed with ``error`` (best effort)."""
    store = _store()
    if store is not None:
        try:
            store.set(_KEY, f"rank {rank}: {type(error).__name__}: {error}"[:2000])
        except Exception:  # the store may be gone with the peer that hosted it
            pass


def _store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    try:
        return get()
    except Exception:
        return None


def _failed_peer() -> str | None:
    store = _store()
    try:
        if store is not None and store.check([_KEY]):  # type: ignore[attr-defined]
            return store.get(_KEY).decode()  # type: ignore[attr-defined]
    except Exception:
        pass
    return None


def run(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, a collective called ``what``; a failure becomes a :class:`CollectiveError`
    naming this rank and, when one left a note, the rank that failed first."""
    try:
        return fn()
    except Exception as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        peer = _failed_peer()
        cause = (f"{peer.split(':')[0]} failed first ({peer})" if peer else
                 "another rank probably failed or stopped calling the engine (see its error)")
        raise CollectiveError(
            f"ZeroOffload: the {what} on rank {rank} failed or timed out ({type(e).__name__}: "
            f"{str(e)[:300]}): {cause}. Every rank must call backward/step/checkpoint methods "
            "the same number of times; collective_timeout_s sets how long a rank waits.") from e


def reduce_scatter(out: Tensor, inp: Tensor, group: Any) -> None:
    run("reduce-scatter of a gradient bucket",
        lambda: _reduce_scatter(out, inp, group=group))


def all_gather(out: Tensor, inp: Tensor, group: Any) -> None:
    run("all-gather of a weight bucket", lambda: _all_gather(out, inp, group=group))


def all_reduce(t: Tensor, op: object, group: Any, what: str) -> None:
    run(what, lambda: dist.all_reduce(t, op=op, group=group))  # type: ignore[arg-type]


def broadcast(t: Tensor, src: int, group: Any, what: str) -> None:
    run(what, lambda: dist.broadcast(t, src=src, group=group))


def barrier(group: Any) -> None:
    run("barrier", lambda: dist.barrier(group=group))


def capture(fn: Callable[[], object]) -> Exception | None:
    """The exception ``fn()`` raises, or None: lets a rank report it to :func:`agree` first."""
    try:
        fn()
    except Exception as e:
        return e
    return None


def agree(error: BaseException | None, world_size: int, group: Any,
          device: torch.device) -> None:
    """Collective: raise on every rank if ``error`` happened on any (this rank's own error as
    is), so that no rank goes on to change its state or waits for a failed peer."""
    from lightning_zero_offload.core.files import CheckpointError

    if world_size > 1:
        flags = torch.zeros(world_size, device=device)
        mine = torch.tensor([float(error is not None)], device=device)
        run("agreement on a checkpoint step", lambda: _all_gather(flags, mine, group=group))
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if failed and error is None:
            raise CheckpointError(f"checkpoint: rank(s) {failed} failed (see their error); "
                                  "nothing was changed on this rank")
    if error is not None:
        raise error


def share_token(token: str, world_size: int, group: Any, device: torch.device) -> str:
    """Collective: rank 0's ``token`` on every rank ("" when rank 0 could not start)."""
    if world_size == 1:
        return token
    data = list(token.encode())[:256]
    buf = torch.tensor(data + [0] * (256 - len(data)), dtype=torch.uint8).to(device)
    src = dist.get_global_rank(group, 0) if group is not None else 0  # type: ignore[arg-type]
    broadcast(buf, src, group, "broadcast of the checkpoint's temporary name")
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()
