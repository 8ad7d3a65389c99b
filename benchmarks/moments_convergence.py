"""Convergence per ``moment_dtype``: the README's GPT example trained with fp32, bf16 and int8
moments for the same steps and data; final-loss ratios against fp32 and one plot of the curves.

Run: ``PYTHONPATH=src python benchmarks/moments_convergence.py --steps 400`` (each run is
``examples/lightning_gpt.py --steps N --moment-dtype MD --loss-csv DIR/MD.csv``; ``--reuse``
reads CSVs already in ``--csv-dir`` instead of training). The "final loss" is the mean of the
last ``--window`` steps' training losses (one step's loss on one batch of 8 is noisy), and the
last step's loss is printed beside it. Writes ``benchmarks/figures/moments_convergence.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("fp32", "bf16", "int8")


def train(md: str, steps: int, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--steps",
                    str(steps), "--moment-dtype", md, "--loss-csv", str(out)], env=env,
                   check=True, capture_output=True)


def read(path: Path) -> list[float]:
    with path.open() as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--csv-dir", default="moments_convergence")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--figure", default=str(ROOT / "benchmarks" / "figures" /
                                           "moments_convergence.png"))
    a = p.parse_args(argv)
    out = Path(a.csv_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = {}
    for md in DTYPES:
        if not a.reuse:
            train(md, a.steps, out / f"{md}.csv")
        curves[md] = read(out / f"{md}.csv")
    base = sum(curves["fp32"][-a.window:]) / a.window
    print(f"examples/lightning_gpt.py (tiny, 32-true on the CPU), {len(curves['fp32'])} steps; "
          f"final loss = mean of the last {a.window} steps\n")
    print("| moment_dtype | final loss | ratio vs fp32 | last step's loss |")
    print("|---|---|---|---|")
    for md, c in curves.items():
        final = sum(c[-a.window:]) / a.window
        print(f"| {md} | {final:.4f} | {final / base:.4f} | {c[-1]:.4f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    k = 10  # a 10-step running mean, so the three curves can be told apart
    for md, c in curves.items():
        smooth = [sum(c[max(0, i - k + 1): i + 1]) / len(c[max(0, i - k + 1): i + 1])
                  for i in range(len(c))]
        ax.plot(range(1, len(c) + 1), smooth, label=f"{md} moments", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({k}-step running mean)")
    ax.set_title("lightning_gpt.py tiny: Adam moments kept in fp32, bf16, int8")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.figure, dpi=120)
    print(f"\nfigure: {a.figure}")


if __name__ == "__main__":
    main()
