"""Checkpoint speed, side by side in one process, against the disk's own speed.

One engine (``--params`` fp32 parameters, default 1e8, in wide ``Linear`` layers; ``32-true``,
fp32 moments, one rank, one step taken) is saved and loaded several ways, each ``--repeats``
times, medians reported with ratios:

- ``raw write``: the same bytes (master and both moments) written with one ``write`` and an
  ``fsync``: the disk's ceiling for these bytes;
- ``torch.save``: of ``engine.full_state_dict()`` (what the consolidated save did before: the
  state copied, then pickled) with ``fsync``;
- ``DCP``: ``torch.distributed.checkpoint.save`` of ``engine.full_state_dict()`` (one process);
- ``ours sharded`` / ``ours consolidated``: ``engine.save_checkpoint(sharded=True/False)``;
- ``ours asynchronous (stall)``: what ``save_checkpoint(sharded=True, blocking=False)`` costs the
  caller (the copy into host memory; from the second save on, into the first one's memory), the
  thread's write waited for outside the timing;
- loads: ``torch.load`` of our consolidated file (whole, not mapped) against
  ``engine.load_checkpoint`` of the consolidated file and of the sharded folder.

The page cache is not
dropped between repeats (that needs root and a quiet machine): reads are from memory after the
first, so the loads compare the CPU work of each way.

Run: ``PYTHONPATH=src python benchmarks/checkpoint_speed.py [--params 1e8] [--repeats 3]
[--dir DIR]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_zero_offload import ZeroOffload


def _engine(params: float, width: int = 4096) -> ZeroOffload:
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()), precision="32-true",
                         offload_fraction=1.0)
    engine.backward(model(torch.randn(2, width)).square().mean())
    engine.step()
    engine.zero_grad()
    return engine


def _interleaved(ways: dict[str, Callable[[], object]], repeats: int,
                 cleanup: Callable[[], object]) -> dict[str, float]:
    """Median seconds of each way, the ways taking turns round by round (the disk's drift
    over the run falls on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            cleanup()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _fsynced_save(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _raw_write(data: list[torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        for t in data:
            f.write(memoryview(t.view(torch.uint8).numpy()))  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())


def _dcp(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    engine = _engine(args.params)
    host = engine._host  # noqa: SLF001  (the bytes a raw write of the state writes)
    data = [*host.master, *(t for n in host.rule.STATE for t in host.state_fp32(n))]
    nbytes = sum(t.nbytes for t in data)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    paths = {k: root / k for k in ("raw", "torch.pt", "dcp", "sharded", "full.pt")}

    def clean() -> None:
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    ways = {
        "raw write + fsync": lambda: _raw_write(data, paths["raw"]),
        "torch.save(full_state_dict())": lambda: _fsynced_save(engine.full_state_dict(),
                                                               paths["torch.pt"]),
        "DCP save": lambda: _dcp(engine.full_state_dict(), paths["dcp"]),
        "ours sharded": lambda: engine.save_checkpoint(paths["sharded"]),
        "ours consolidated": lambda: engine.save_checkpoint(paths["full.pt"], sharded=False),
    }
    rows = _interleaved(ways, args.repeats, clean)
    stalls = []
    for _ in range(args.repeats):
        clean()
        start = time.perf_counter()
        handle = engine.save_checkpoint(paths["sharded"], blocking=False)
        stalls.append(time.perf_counter() - start)
        assert handle is not None, "no room for the asynchronous save's copy"
        handle.wait()
    rows["ours asynchronous (stall)"] = statistics.median(stalls)
    first_stall = stalls[0]  # the first copy also faults its memory in; later ones reuse it
    clean()
    engine.save_checkpoint(paths["sharded"])
    engine.save_checkpoint(paths["full.pt"], sharded=False)
    loads = _interleaved({
        "torch.load (whole file)": lambda: torch.load(paths["full.pt"], weights_only=True),
        "ours load consolidated": lambda: engine.load_checkpoint(paths["full.pt"]),
        "ours load sharded": lambda: engine.load_checkpoint(paths["sharded"]),
    }, args.repeats, lambda: None)
    shutil.rmtree(root, ignore_errors=True)
    raw, base = rows["raw write + fsync"], loads["torch.load (whole file)"]
    print(f"{args.params:.0e} parameters, {nbytes / 1e9:.2f} GB of state, medians of "
          f"{args.repeats}\n")
    print("| way | seconds | GB/s | x raw write |\n|---|---|---|---|")
    for name, t in rows.items():
        print(f"| {name} | {t:.2f} | {nbytes / t / 1e9:.2f} | {t / raw:.2f} |")
    print(f"\nasynchronous stall / blocking sharded save: "
          f"{rows['ours asynchronous (stall)'] / rows['ours sharded']:.2f} (median; the first "
          f"save's stall, whose copy faults its memory in: {first_stall:.2f} s, "
          f"{first_stall / rows['ours sharded']:.2f})")
    print("\n| load | seconds | x torch.load |\n|---|---|---|")
    for name, t in loads.items():
        print(f"| {name} | {t:.2f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
