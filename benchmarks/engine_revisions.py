"""The CPU engine at two revisions of this repository, side by side.

Runs ``benchmarks/engine_cpu.py --speed-only`` (this checkout's script, which uses only the public
API) alternately against the package of a git revision and against the working tree, each run in
its own process; each run reports the engine's step time over plain fused ``torch.optim.AdamW``
measured in that same process, so machine noise cancels within a run. Prints the median of those
ratios per revision and their quotient (after / before). For refactors that must not slow the
step, e.g. ``python benchmarks/engine_revisions.py 076530c --rounds 5``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ratio(src: Path, extra: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_cpu.py"),
                          "--speed-only", *extra], env=env, check=True, capture_output=True,
                         text=True).stdout
    speed = json.loads(out)["speed"]
    return speed["step_time_ratio"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="git revision to compare against (e.g. main~3)")
    ap.add_argument("--rounds", type=int, default=5)
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old),
                        args.before], check=True, capture_output=True)
        try:
            runs: dict[str, list[float]] = {"before": [], "after": []}
            for i in range(args.rounds):
                order = [("before", old / "src"), ("after", ROOT / "src")][:: 1 if i % 2 else -1]
                for name, src in order:
                    runs[name].append(_ratio(src, extra))
                    print(f"round {i + 1} {name}: engine/plain {runs[name][-1]:.3f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           check=False)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"revision_before": args.before, "median_engine_over_plain": med,
                      "after_over_before": med["after"] / med["before"], "runs": runs},
                     indent=2))


if __name__ == "__main__":
    main()
