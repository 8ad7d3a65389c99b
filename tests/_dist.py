"""Run a function on N spawned CPU processes joined by a gloo process group; return the results.

Usable by any test: ``run_ranks(fn, 2, arg)`` calls ``fn(rank, world_size, arg)`` in each
process (``fn`` must be a module-level function) and returns the per-rank results in rank order.
A failure in any rank raises with that rank's traceback; a hang raises TimeoutError after
``timeout`` seconds and the processes are killed. ``torchrun(script, *args)`` runs a script as
``torchrun --nproc_per_node 2`` does, on the CPU (processes that exit as scripts do, unlike the
spawned ones, which skip the interpreter's exit).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: os.PathLike | str, *args: str, timeout: float = 600,
             **env: str) -> subprocess.CompletedProcess:
    """``script args`` on 2 CPU processes under torch.distributed.run, without the caller's
    ``ZERO_OFFLOAD*`` variables and with ``env`` added; output captured as text."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_OFFLOAD")}
    base.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(script), *args]
    return subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=timeout)


def _worker(fn: Callable, rank: int, world: int, port: int, args: tuple, timeout: float,
            results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        out = fn(rank, world, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int = 2, *args: Any, timeout: float = 180.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, timeout, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"run_ranks: {fn.__name__} did not finish on all {world_size} ranks within "
                    f"{timeout} s (ranks done: {sorted(out)})"
                ) from None
            if not ok:
                raise RuntimeError(f"run_ranks: rank {rank} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        stop(procs)
    return [out[r] for r in range(world_size)]


def stop(procs: list) -> None:
    """Join spawned processes, killing any still alive after 10 s."""
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
