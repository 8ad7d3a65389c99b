"""The walk of one step through the engine's modules, counted (no timing).

Traces the second ``step`` of a small engine (3 and 6 buckets, one rank, the CPU) with
``sys.setprofile`` and counts, within ``lightning_zero_offload.core``:

- crossings: calls whose caller is in another core module than the callee;
- re-entries: calls into a module that is already on the stack below another module (control
  handed back to a module the walk had left: a callback);
- after finish: calls into ``core.transfer.streaming`` from another module after
``GradStreamer.finish``
  returned, within ``ZeroOffload.step`` (the step owns the gradients from there: it must not
  call the streamer back).

``tests/test_step_walk.py`` keeps the counts bounded (at most 4 crossings per extra bucket, none
back into the streamer after ``finish``). Run it against any checkout to compare revisions
(``PYTHONPATH=<checkout>/src``)::

    PYTHONPATH=src python benchmarks/step_walk.py
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import torch
from torch import nn

PKG = "lightning_zero_offload.core."
STREAMING, ENGINE = PKG + "streaming", PKG + "engine"


def _walk(delayed: bool, layers: int) -> dict:
    from lightning_zero_offload import ZeroOffload, ZeroOffloadConfig

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = ZeroOffloadConfig(precision="bf16-mixed", bucket_size_mb=64 * 65 * 2 / 2**20,
                            delayed_update=delayed, delayed_update_warmup=0)
    engine = ZeroOffload(model, opt, cfg, device="cpu")
    x = torch.randn(8, 64)
    for _ in range(2):  # the second step is the steady state (delayed: one pending)
        engine.backward(engine.module(x).float().square().mean())
        counts = {"crossings": 0, "re_entries": 0, "after_finish": 0}
        phase = {"finished": False, "in_step": False}
        stacks: dict[int, list[str]] = {}  # per thread: the delayed kernel runs on a worker

        def prof(frame, event, arg, stacks=stacks, counts=counts,  # noqa: ANN001, ANN202
                 phase=phase):
            stack = stacks.setdefault(threading.get_ident(), [])
            mod = frame.f_globals.get("__name__", "")
            name = frame.f_code.co_name
            if event == "call":
                here = mod if mod.startswith(PKG) else ""
                if here and stack and stack[-1] and stack[-1] != here:
                    counts["crossings"] += 1
                    if here in stack:
                        counts["re_entries"] += 1
                    if phase["finished"] and phase["in_step"] and here == STREAMING:
                        counts["after_finish"] += 1
                if here == ENGINE and name == "step":
                    phase["in_step"] = True
                stack.append(here)
            elif event == "return" and stack:
                stack.pop()
                if mod == STREAMING and name == "finish":
                    phase["finished"] = True
                if mod == ENGINE and name == "step":
                    phase["in_step"] = False

        threading.setprofile(prof)
        sys.setprofile(prof)
        try:
            engine.step()
            engine.synchronize()  # the delayed kernel's walk ends on its worker
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        engine.zero_grad()
    buckets = len(engine.layout.buckets)
    engine.teardown()
    return {"delayed": delayed, "buckets": buckets, **counts}


def walk(delayed: bool) -> dict:
    """The walk of the 3-bucket engine, and ``per_extra_bucket``: what each bucket more adds
    (from the 6-bucket one). ``tests/test_step_walk.py`` holds the counts to their bounds."""
    walks = [_walk(delayed, n) for n in (3, 6)]
    per_bucket = {k: (walks[1][k] - walks[0][k]) / (walks[1]["buckets"] - walks[0]["buckets"])
                  for k in ("crossings", "re_entries", "after_finish")}
    return {**walks[0], "per_extra_bucket": per_bucket}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for delayed in (False, True):
        print(json.dumps(walk(delayed)))


if __name__ == "__main__":
    main()
