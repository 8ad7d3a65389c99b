"""Delayed parameter update hides the CPU step: the issue's CPU proof, in one run.

Device work is emulated by ``time.sleep`` between backward and ``step()`` (it releases the Python
lock, as an asynchronous GPU does while the host waits for gradients) and made as long as the CPU
step measured first. Without delayed update a step costs fwd/bwd + device + CPU step; with it the
CPU step of step i runs on the engine's worker thread during step i+1's fwd/bwd and device wait,
so a step should cost about fwd/bwd + max(device, CPU step). Reported:
``hidden = (plain step - delayed step) / CPU step`` (target >= 0.8), the profile means of both
runs, JSON under ``--out`` and a timeline PNG of a few steps of each.

The model is an MLP at batch 1, so its parameters dominate its compute (the CPU step is tens of
ms), in fp32 (CPUs without bf16 matmul units make bf16 forward passes slow, and precision does
not change the overlap), with one torch thread on the main thread and ``--threads`` kernel
threads: on a 2-core machine the main thread and the worker each have a core. The two engines run
in interleaved blocks, medians reported. Run it alone: a shared machine adds noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import lightning_zero_offload as zo
from lightning_zero_offload.core.device.profile import summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timeline  # noqa: E402


def make_engine(width: int, depth: int, delayed: bool, args: argparse.Namespace) -> zo.ZeroOffload:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return zo.ZeroOffload(model, opt, precision=args.precision, cpu_threads=args.threads,
                          delayed_update=delayed, delayed_update_warmup=args.warmup)


def train(engine: zo.ZeroOffload, x: torch.Tensor, steps: int, device_s: float) -> list[float]:
    """Per-step wall times; the pending update is flushed after the last step (not timed)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = engine.module(x).float().square().mean()
        engine.backward(loss)
        time.sleep(device_s)  # the device finishing backward while the host waits
        engine.step()
        engine.zero_grad()
        times.append(time.perf_counter() - t)
    engine.synchronize()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4, help="Linear layers (width^2 params each)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4, help="plain/delayed blocks, interleaved")
    p.add_argument("--block", type=int, default=6, help="steps per block (the first not timed)")
    p.add_argument("--warmup", type=int, default=2, help="delayed_update_warmup")
    p.add_argument("--threads", type=int, default=1, help="CPU step threads")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--tiny", action="store_true", help="a seconds-long check (tests)")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.rounds, args.block = 256, 2, 1, 4
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    x = torch.randn(args.batch, args.width)
    engines = {m: make_engine(args.width, args.depth, m == "delayed", args)
               for m in ("plain", "delayed")}
    # The CPU step's length from the plain engine's profile; the delayed engine past its warm-up.
    train(engines["plain"], x, 8, 0.0)
    cpu_step = statistics.median(r.cpu_step for r in engines["plain"].profile[-6:])
    train(engines["delayed"], x, args.warmup + 2, cpu_step)
    # Interleaved blocks (a shared machine drifts); each block's first step is not timed: it
    # has no previous delayed step to wait for.
    # Each block's last step is flushed by synchronize(), a full stall: not in the profile means.
    times: dict[str, list[float]] = {"plain": [], "delayed": []}
    recs: dict[str, list] = {"plain": [], "delayed": []}
    for _ in range(args.rounds):
        for mode, eng in engines.items():
            times[mode] += train(eng, x, args.block, cpu_step)[1:]
            recs[mode] += eng.profile[-args.block:-1]
    res: dict = {"args": vars(args), "device_s": cpu_step,
                 "n_params": sum(p.numel() for p in engines["plain"].module.parameters())}
    for mode, eng in engines.items():
        res[mode] = {"step_s": statistics.median(times[mode]), "steps_timed": len(times[mode]),
                     "profile_mean_s": summarize(recs[mode])}
        (out / f"dpu_{mode}_profile.json").write_text(
            json.dumps({"records": [r.to_dict() for r in eng.profile[-args.block:]]}))
        eng.teardown()
    res["cpu_step_s"] = res["plain"]["profile_mean_s"]["cpu_step"]
    res["hidden_fraction"] = (res["plain"]["step_s"] - res["delayed"]["step_s"]) / res["cpu_step_s"]
    res["speedup"] = res["plain"]["step_s"] / res["delayed"]["step_s"]
    # The profile's view, free of fwd/bwd noise: the part of the CPU step the main thread waited for
    res["hidden_fraction_profile"] = 1.0 - (res["delayed"]["profile_mean_s"]["stall"]
                                            / res["delayed"]["profile_mean_s"]["cpu_step"])
    (out / "dpu_overlap_cpu.json").write_text(json.dumps(res, indent=1))
    timeline.draw([(f"{m} (median step {res[m]['step_s'] * 1e3:.1f} ms)",
                    timeline.load(out / f"dpu_{m}_profile.json", 4)) for m in engines],
                  out / "dpu_timeline.png")
    fb = {m: res[m]["profile_mean_s"]["fwd_bwd"] * 1e3 for m in engines}
    print(f"params {res['n_params'] / 1e6:.1f}M  CPU step {res['cpu_step_s'] * 1e3:.1f} ms  "
          f"device (sleep) {cpu_step * 1e3:.1f} ms  fwd/bwd plain {fb['plain']:.1f} ms, "
          f"delayed {fb['delayed']:.1f} ms")
    print(f"plain step {res['plain']['step_s'] * 1e3:.1f} ms  delayed step "
          f"{res['delayed']['step_s'] * 1e3:.1f} ms  speedup {res['speedup']:.2f}x  "
          f"hidden {res['hidden_fraction']:.0%} of the CPU step (target >= 80%; by the "
          f"profile's stall: {res['hidden_fraction_profile']:.0%})")
    print(f"wrote {out / 'dpu_overlap_cpu.json'} and {out / 'dpu_timeline.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
