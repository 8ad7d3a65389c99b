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
import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_KEY = "lightning_zero_offload/failed"
T = TypeVar("T")
logger = logging.getLogger(__name__)
_exit_hook_registered = False


class CollectiveError(RuntimeError):
    """A collective of the engine failed or timed out (usually: another rank failed)."""


def engine_group(group: Any, timeout_s: float | None) -> Any:
    """The process group the engine's collectives use: a copy of the default group with the
    timeout (collective over every process). A subgroup the caller passes is used as it is,
    with its own timeout: copying it would need every process of the default group. With
    several processes, the groups are destroyed at exit (:func:`destroy_at_exit`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return group
    if dist.get_world_size() > 1:
        destroy_at_exit()  # a script that leaves its gloo groups to the exit may abort there
    if timeout_s is None or group not in (None, dist.group.WORLD) or dist.get_world_size() == 1:
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


def releaser(owner: object, group: Any, given: Any) -> weakref.finalize:
    """:func:`release_group` of ``group`` once called, or once ``owner`` is dropped, but not at
    exit (a destroy there would wait for collectives)."""
    release = weakref.finalize(owner, release_group, group, given)
    release.atexit = False
    return release


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
    local synchronization would share a store prefix and could hang). ``new_group`` needs every
    process to ask for the same ranks, so with subgroups that differ by process (a mesh's
    data-parallel groups) every process builds every one of them, in the same order."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    if group in (None, dist.group.WORLD):
        return dist.new_group(None, timeout=timeout)
    every = gather_objects("setup of an emulated stream's group",
                           dist.get_process_group_ranks(group))
    mine = None
    for ranks in sorted({tuple(r) for r in every}):
        made = dist.new_group(list(ranks), timeout=timeout)
        mine = made if dist.get_rank() in ranks else mine
    return mine


def report_failure(error: BaseException) -> None:
    """Leave a note for the peers, unless one is there: this process (its global rank) failed
    with ``error`` (best effort; alone, there are none)."""
    store = _store() if dist.is_initialized() and dist.get_world_size() > 1 else None
    if store is None:
        return
    note = f"rank {dist.get_rank()}: {type(error).__name__}: {error}"[:2000]
    try:
        # Set only if absent, in one store operation: the first failure is the news, also when
        # two ranks fail at once (a check, then a set, lets the second overwrite the first).
        store.compare_set(_KEY, "", note)
    except Exception:  # the store may be gone with the peer that hosted it
        pass


def raise_unless_failing(broken: Exception | None, failure: BaseException | None) -> None:
    """A teardown's own error ``broken`` is raised, unless ``failure`` (the caller's error) is
    propagating: then it is logged, and the failure surfaces as itself."""
    if broken is not None and failure is None:
        raise broken
    if broken is not None:
        logger.warning("ZeroOffload: teardown after %s: %r failed too", type(failure).__name__,
                       broken, exc_info=broken)


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


def run(what: str, fn: Callable[[], T], group: Any = None) -> T:
    """``fn()``, a collective called ``what`` over ``group``; a failure becomes a
    :class:`CollectiveError` naming this rank and the rank that failed first when one left a
    note, else the peers that may be lost."""
    logger.debug("%s: start", what)
    try:
        out = fn()
    except Exception as e:
        raise _failed(what, e, group) from e
    logger.debug("%s: end", what)
    return out


@contextlib.contextmanager
def reported(what: str, group: Any) -> Iterator[None]:
    """Around work that issues collectives the engine does not call itself (under tensor
    parallelism DTensor's, in forward and backward): a failure inside leaves a note for the
    peers, and an error of torch.distributed becomes a :class:`CollectiveError` like
    :func:`run`'s (a peer lost mid-forward is named, not left to gloo's words)."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, CollectiveError) or not _from_distributed(e):
            report_failure(e)
            raise
        error = _failed(what, e, group)  # read any peer's note before leaving ours
        report_failure(error)
        raise error from e


# What a lost peer looks like from gloo or NCCL when it is not raised as a DistError.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "timed out", "timeout", "socket", "nccl error", "remote process exited")


def _from_distributed(e: BaseException) -> bool:
    """Whether ``e`` is a failure of communication (a lost or stuck peer), not a local error
    that merely passed through torch.distributed's code (a shape error inside a DTensor op, an
    out-of-memory error in a parallelized layer keep their own type): a ``DistError``, or a
    RuntimeError with a lost peer's words raised from a torch.distributed frame."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    if type(e) is not RuntimeError or not any(w in str(e).lower() for w in _LOST_PEER):
        return False
    tb = e.__traceback__
    while tb is not None:
        if "torch/distributed/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def _failed(what: str, e: BaseException, group: Any) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    peer = _failed_peer()
    cause = (f"{peer.split(':')[0]} failed first ({peer})" if peer else
             f"{_peers(group)} probably failed, was lost or stopped calling the engine (see "
             "its error)")
    return CollectiveError(
        f"ZeroOffload: the {what} on rank {rank} failed or timed out ({type(e).__name__}: "
        f"{str(e)[:300]}): {cause}. Every rank must call backward/step/checkpoint methods "
        "the same number of times; collective_timeout_s sets how long a rank waits.")


def _peers(group: Any) -> str:
    """The other ranks of ``group``, by global rank: the one that failed is among them."""
    try:
        others = [r for r in dist.get_process_group_ranks(group or dist.group.WORLD)
                  if r != dist.get_rank()]
    except Exception:  # no group (one process), or one already destroyed
        others = []
    if len(others) == 1:
        return f"rank {others[0]}"
    return f"one of ranks {others}" if others else "another rank"


def gather_objects(what: str, obj: Any, group: Any = None) -> list:
    """Every rank's ``obj`` of ``group``, in rank order (:func:`run` names the collective)."""
    every: list = [None] * dist.get_world_size(group)
    run(what, lambda: dist.all_gather_object(every, obj, group=group), group)
    return every


def reduce_scatter(out: Tensor, inp: Tensor, group: Any) -> None:
    with _released_at_exit(out, inp):
        run("reduce-scatter of a gradient bucket",
            lambda: _reduce_scatter(out, inp, group=group), group)


def all_gather(out: Tensor, inp: Tensor, group: Any,
               what: str = "all-gather of a weight bucket") -> None:
    with _released_at_exit(out, inp):
        run(what, lambda: _all_gather(out, inp, group=group), group)


def all_reduce(t: Tensor, op: object, group: Any, what: str) -> None:
    with _released_at_exit(t):
        run(what, lambda: dist.all_reduce(t, op=op, group=group),  # type: ignore[arg-type]
            group)


def broadcast(t: Tensor, src: int, group: Any, what: str) -> None:
    with _released_at_exit(t):
        run(what, lambda: dist.broadcast(t, src=src, group=group), group)


def barrier(group: Any) -> None:
    run("barrier", lambda: dist.barrier(group=group), group)


@contextlib.contextmanager
def _released_at_exit(*tensors: Tensor) -> Iterator[None]:
    """At the interpreter's exit (the main thread has ended: exit hooks), return from a
    collective only once its backend has let go of its tensors (up to a second). A gloo worker
    thread drops its references just after the collective has returned; dropping the last C++
    reference beside a tensor's Python object takes the GIL, and once the interpreter is
    finalizing that ends the thread inside C++ and aborts the process ("terminate called without
    an active exception", seen in about 1 in 10 two-rank exits that settle a save). While C++
    holds a tensor, torch holds one more reference to its Python object, so the count says
    when the worker is done."""
    if threading.main_thread().is_alive():
        yield
        return
    before = [sys.getrefcount(t) for t in tensors]
    yield
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(
            sys.getrefcount(t) > n for t, n in zip(tensors, before, strict=True)):
        time.sleep(0.001)


def process_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def collective_device(group: Any, device: torch.device) -> torch.device:
    """Where a collective's tensors live: the compute device with NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    return device if "nccl" in backend and device.type == "cuda" else torch.device("cpu")
