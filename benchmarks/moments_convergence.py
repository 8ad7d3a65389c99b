"""Convergence per ``moment_dtype``: the README's GPT example trained with fp32, bf16 and int8
moments for the same steps and data, beside peers without the engine (plain Lightning with
``torch.optim.AdamW``, the exact reference, and with torchao's ``AdamW8bit`` on the CPU): final
losses and step times with ratios against the engine's fp32 run, and one plot of the curves.

Run: ``PYTHONPATH=src python benchmarks/moments_convergence.py --steps 400`` (each run is
``examples/lightning_gpt.py --steps N --loss-csv DIR/RUN.csv`` plus ``--moment-dtype MD`` for
the engine's runs, ``--no-zero-offload --optimizer OPT`` for the peers; ``--runs`` picks some;
``--reuse`` reads CSVs already in ``--csv-dir`` instead of training). The "final loss" is the
mean of the last ``--window`` steps' training losses (one step's loss on one batch of 8 is
noisy), and the last step's loss is printed beside it. The step time is the median wall time of
a training step (forward, backward, optimizer, next batch) after the first ``--skip`` steps
(torchao compiles its step with ``torch.compile`` on the first calls). Writes
``benchmarks/figures/moments_convergence.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
# run name -> (the example's flags, what the table says about it)
RUNS = {
    "fp32": (["--moment-dtype", "fp32"], "engine, fp32 moments"),
    "bf16": (["--moment-dtype", "bf16"], "engine, bf16 moments"),
    "int8": (["--moment-dtype", "int8"], "engine, int8 moments"),
    "torch-adamw": (["--no-zero-offload", "--optimizer", "adamw"],
                    "no engine, torch.optim.AdamW"),
    "torchao-adamw8bit": (["--no-zero-offload", "--optimizer", "torchao-adamw8bit"],
                          "no engine, torchao AdamW8bit"),
}


def train(run: str, steps: int, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env = {k: v for k, v in env.items() if not k.startswith("ZERO_OFFLOAD")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_gpt.py"),
                           "--steps", str(steps), *RUNS[run][0], "--loss-csv", str(out)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {run} failed:\n{proc.stderr[-3000:]}")


def read(path: Path) -> tuple[list[float], list[float]]:
    """Each step's training loss and wall time (seconds)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [float(r["loss"]) for r in rows], [float(r["step_s"]) for r in rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the step time")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--csv-dir", default="moments_convergence")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--figure", default=str(ROOT / "benchmarks" / "figures" /
                                           "moments_convergence.png"))
    a = p.parse_args(argv)
    out = Path(a.csv_dir)
    out.mkdir(parents=True, exist_ok=True)
    if "fp32" not in a.runs:
        p.error("argument --runs: include fp32 (the reference of the ratios)")
    curves, times = {}, {}
    for run in a.runs:
        if not a.reuse:
            train(run, a.steps, out / f"{run}.csv")
            print(f"# {run} done", flush=True)
        curves[run], times[run] = read(out / f"{run}.csv")
        if len(curves[run]) < max(a.window, a.skip + 1):
            raise SystemExit(f"{run}: {len(curves[run])} steps, fewer than --window {a.window} "
                             f"or --skip {a.skip} + 1")
    finals = {run: sum(c[-a.window:]) / a.window for run, c in curves.items()}
    steps_s = {run: median(t[a.skip:]) for run, t in times.items()}
    print(f"examples/lightning_gpt.py (tiny, 32-true on the CPU), {len(curves['fp32'])} steps; "
          f"final loss = mean of the last {a.window} steps; step time = median after the first "
          f"{a.skip} steps\n")
    print("| run | optimizer | final loss | ratio vs fp32 | last step's loss | step ms | "
          "step time vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for run, c in curves.items():
        print(f"| {run} | {RUNS[run][1]} | {finals[run]:.4f} | "
              f"{finals[run] / finals['fp32']:.4f} | {c[-1]:.4f} | {1e3 * steps_s[run]:.1f} | "
              f"{steps_s[run] / steps_s['fp32']:.3f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
    k = 10  # a 10-step running mean, so the curves can be told apart

    def smooth(c: list[float]) -> list[float]:
        return [sum(c[max(0, i - k + 1): i + 1]) / len(c[max(0, i - k + 1): i + 1])
                for i in range(len(c))]

    base = smooth(curves["fp32"])
    for run, c in curves.items():
        style = "--" if run in ("torch-adamw", "torchao-adamw8bit") else "-"
        sc = smooth(c)
        ax.plot(range(1, len(c) + 1), sc, label=RUNS[run][1], linewidth=1.2, linestyle=style)
        # the curves nearly coincide: the lower panel shows how far each is from fp32
        dx.plot(range(1, len(c) + 1), [100 * (a / b - 1) for a, b in zip(sc, base, strict=True)],
                linewidth=1.0, linestyle=style)
    ax.set_ylabel(f"training loss ({k}-step running mean)")
    ax.set_title("lightning_gpt.py tiny: Adam moments per format, engine and peers")
    ax.legend()
    ax.grid(alpha=0.3)
    dx.set_xlabel("step")
    dx.set_ylabel("vs engine fp32 (%)")
    dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.figure, dpi=120)
    print(f"\nfigure: {a.figure}")


if __name__ == "__main__":
    main()
