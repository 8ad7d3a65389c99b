"""Cost of the emulated device's race detector: the same training loops with it on and off.

Each round runs a tiny GPT for ``--steps`` steps (two micro-batches a step, bf16-mixed, the
emulated asynchronous device at seed 1), once with ``race_detector=True`` and once with
``False``, in alternating order so machine load falls on both alike; prints the median wall
time of each and their ratio (issue 18's bound: the detector at most doubles the emulated
suite's time). Also the CPU device (no emulation) as the floor.

Run: ``PYTHONPATH=src python benchmarks/race_detector_overhead.py [--rounds 5] [--steps 6]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _helpers import tiny_engine, train  # noqa: E402
from _tiny_gpt import batches  # noqa: E402

from lightning_zero_offload.testing import emulated_async_device  # noqa: E402


def once(mode: str, steps: int) -> float:
    data = batches(steps)
    t0 = time.perf_counter()
    if mode == "cpu":
        engine = tiny_engine(precision="bf16-mixed")
        train(engine, data, micro=2)
    else:
        with emulated_async_device(seed=1, race_detector=mode == "detector on"):
            engine = tiny_engine(precision="bf16-mixed")
            train(engine, data, micro=2)
    engine.synchronize()
    engine.teardown()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    modes = ["detector on", "detector off", "cpu"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    once("detector on", 1)  # warm-up: the kernel load, first-touch allocations
    for r in range(args.rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            times[m].append(once(m, args.steps))
    med = {m: statistics.median(v) for m, v in times.items()}
    print("| run | median s | rounds |\n|---|---|---|")
    for m in modes:
        print(f"| {m} | {med[m]:.3f} | {', '.join(f'{t:.2f}' for t in times[m])} |")
    print(f"\ndetector on / off = {med['detector on'] / med['detector off']:.2f}")


if __name__ == "__main__":
    main()
