"""Host bytes per trained parameter of the master weights and Adam moments, per ``moment_dtype``.

For each of fp32, bf16 and int8, a fresh process builds ``ZeroOffload`` (CPU, bf16-mixed) on a
model of about 50M parameters and reports, per trained parameter:

- ``buffers``: the bytes of the engine's own master and moment tensors (codes and scales
  included), summed from ``HostBuffers``;
- ``rss``: the process's RSS growth while the engine is built, less what the engine's budget
  says the other buffers allocated at that point hold (fp32 gradient, device weights on the
  CPU), so what is left is master + moments as the OS counts it;
- ``budget``: the preflight's count (``engine.host_budget["master"] + ["moments"]``).

Run: ``PYTHONPATH=src python benchmarks/moments_memory.py [--params 50e6]``. Prints a Markdown
table (ratios against fp32 in the last column).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, psutil, torch
from torch import nn
import lightning_zero_offload as zo
from lightning_zero_offload.ops import _build
_build.load()
n, md = int(float(sys.argv[1])), sys.argv[2]
d = 1024
model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(max(1, n // (d * d)))])
keep = [p.data for p in model.parameters()]  # the user's fp32 tensors stay; not counted
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
proc = psutil.Process()
before = proc.memory_info().rss
engine = zo.ZeroOffload(model, opt, precision="bf16-mixed", device="cpu", moment_dtype=md,
                        bucket_size_mb=8)
growth = proc.memory_info().rss - before
host, b = engine._host, engine.host_budget
tensors = list(host.master)
for m in host.moments:
    tensors += [t for t in (m.exp_avg, m.exp_avg_sq, m.exp_avg_scales, m.exp_avg_sq_scales)
                if t is not None]
buffers = sum(t.numel() * t.element_size() for t in tensors)
# allocated at construction besides master and moments (the bucket buffers come with backward)
others = sum(b.get(k, 0) for k in ("grad_fp32", "staging", "frozen_exact", "device_weights",
                                   "device_untrained"))
print(json.dumps({"params": sum(p.numel() for p in keep), "buffers": buffers,
                  "rss": growth - others, "budget": b["master"] + b["moments"],
                  "growth": growth}))
"""


def measure(params: float, md: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(params), md], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=50e6)
    a = p.parse_args(argv)
    rows = {md: measure(a.params, md) for md in ("fp32", "bf16", "int8")}
    n = rows["fp32"]["params"]
    print(f"{n / 1e6:.1f}M trained parameters, bf16-mixed on the CPU; bytes per parameter of "
          "master + moments (+ scales)\n")
    print("| moment_dtype | engine buffers | RSS growth less other buffers | budget "
          "| RSS vs fp32 |")
    print("|---|---|---|---|---|")
    for md, r in rows.items():
        k = r["params"]
        print(f"| {md} | {r['buffers'] / k:.3f} | {r['rss'] / k:.3f} | {r['budget'] / k:.3f} "
              f"| {r['rss'] / rows['fp32']['rss']:.3f} |")


if __name__ == "__main__":
    main()
