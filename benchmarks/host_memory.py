"""Peak host memory of setup: an fp32 model built on the CPU, wrapped, trained 3 steps.

A fresh child process imports torch and the package (its baseline RSS), builds an MLP of wide
``Linear`` layers without bias (about ``--params`` fp32 parameters) on the CPU, wraps it in
``ZeroOffload`` on the emulated asynchronous device (``bf16-mixed``, one rank) and trains 3 steps.
It reports, from the kernel's high-water mark (``ru_maxrss``, exact, not sampled):

- ``peak - baseline`` against ``engine.host_bytes``: the issue's bound is at most
  ``host_bytes`` + 10%; a setup that kept the model's fp32 copy beside the master would sit
  4 bytes per parameter above what the engine keeps;
- the peak of setup alone (model built, engine constructed, no step yet);
- ``transient``: the peak less the RSS once the 3 steps are done (what setup held only for a
  while, the double copy among it);
- the RSS growth of building the engine and running the 3 steps (the model's own fp32 storage
  counted as already there) against ``engine.host_bytes``.

Run: ``PYTHONPATH=src python benchmarks/host_memory.py [--params 5e8] [--width 4096]``. Prints a
Markdown table and writes ``benchmarks/out/host_memory.json``.

``--optimizer lion`` wraps ``lion_pytorch.Lion`` instead of ``torch.optim.AdamW`` (one moment);
``sgd`` / ``sgd-momentum`` ``torch.optim.SGD`` with ``momentum`` 0 (no state) / 0.9 (one buffer).

``--configs`` (default ``--params 1e8`` then) does the same once per configuration (moments fp32 /
bf16 / int8 x delayed update off / on x accumulation off / on: two micro-batches a step) and
prints the host bytes per trained parameter the engine budgets for master, moments, gradients and
staging (``engine.host_budget`` without the terms that exist only because the CPU is the compute
device), with the RSS growth of building the engine and running the 3 steps against
``engine.host_bytes``; writes ``benchmarks/out/host_memory_configs.json``.

``--fractions`` (default ``--params 1e8``) builds, in one child process, an engine per
configuration at ``offload_fraction`` 1.0, 0.5 and 0.0, trains one step each and prints the host
bytes per trained parameter side by side: what a GPU machine's host holds (``engine.host_bytes``
less the terms that exist only because the CPU is the compute device: on the emulated device the
device-resident optimizer state lives in host memory too) and ``engine.host_bytes`` itself;
writes ``benchmarks/out/host_memory_fractions.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, resource, sys
import psutil, torch
from torch import nn
import lightning_zero_offload as zo
from lightning_zero_offload.ops import _build
from lightning_zero_offload.testing import emulated_async_device
_build.load()
n, d = int(float(sys.argv[1])), int(sys.argv[2])
moment_dtype, delayed, accumulate = sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1"
optimizer = sys.argv[6]
proc = psutil.Process()
rss = lambda: proc.memory_info().rss
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
baseline = rss()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(max(1, round(n / d**2)))])
params = sum(p.numel() for p in model.parameters())
with_model = rss()
if optimizer == "lion":
    from lion_pytorch import Lion
    opt = Lion(model.parameters(), lr=1e-4)
elif optimizer.startswith("sgd"):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4,
                          momentum=0.9 if optimizer == "sgd-momentum" else 0.0)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
with emulated_async_device(seed=0, max_delay_ms=0.5):
    engine = zo.ZeroOffload(model, opt, precision="bf16-mixed", device="cpu",
                            moment_dtype=moment_dtype, delayed_update=delayed,
                            delayed_update_warmup=0, accumulate=accumulate)
    after_setup, setup_peak = rss(), peak()
    x = torch.randn(8, d)
    for _ in range(3):
        for _ in range(2 if accumulate else 1):
            engine.backward(engine.module(x).float().pow(2).mean())
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    after_steps = rss()
    top = peak()
    print(json.dumps({"params": params, "baseline": baseline, "with_model": with_model,
                      "after_setup": after_setup, "setup_peak": setup_peak,
                      "after_steps": after_steps, "peak": top,
                      "host_bytes": engine.host_bytes, "host_budget": engine.host_budget}))
    engine.teardown()
"""

GB = 1e9
# budget terms that exist only because the CPU is the compute device (the emulated device keeps
# its "device" buffers in host memory)
CPU_ONLY = ("device_weights", "device_untrained", "buckets_in_flight", "device_state")
FRACTIONS = (1.0, 0.5, 0.0)

FRACTIONS_CHILD = r"""
import gc, json, sys
import torch
from torch import nn
import lightning_zero_offload as zo
from lightning_zero_offload.ops import _build
from lightning_zero_offload.testing import emulated_async_device
_build.load()
n, d = int(float(sys.argv[1])), int(sys.argv[2])
configs, fractions = json.loads(sys.argv[3]), json.loads(sys.argv[4])
bucket_mb = float(sys.argv[5])
rows = []
for moment_dtype, delayed, accumulate in configs:
    for fraction in fractions:
        torch.manual_seed(0)
        layers = max(1, round(n / d**2))
        model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with emulated_async_device(seed=0, max_delay_ms=0.5):
            engine = zo.ZeroOffload(model, opt, precision="bf16-mixed", device="cpu",
                                    moment_dtype=moment_dtype, delayed_update=delayed,
                                    delayed_update_warmup=0, accumulate=accumulate,
                                    offload_fraction=fraction, bucket_size_mb=bucket_mb)
            x = torch.randn(8, d)
            for _ in range(2 if accumulate else 1):
                engine.backward(engine.module(x).float().pow(2).mean())
            engine.step()
            engine.synchronize()
            rows.append({"params": sum(p.numel() for p in model.parameters()),
                         "config": {"moment_dtype": moment_dtype, "delayed_update": delayed,
                                    "accumulate": accumulate},
                         "fraction": fraction, "resolved": engine.offload_fraction,
                         "host_bytes": engine.host_bytes, "host_budget": engine.host_budget})
            engine.teardown()
        del engine, model, opt
        gc.collect()
print(json.dumps(rows))
"""
CONFIGS = [(m, d, a) for m in ("fp32", "bf16", "int8") for d in (False, True)
           for a in (False, True)]


def measure(params: float, width: int, moment_dtype: str = "fp32", delayed: bool = False,
            accumulate: bool = False, optimizer: str = "adamw") -> dict:
    # A fixed mmap threshold: glibc would otherwise keep freed large blocks in its heap once its
    # threshold adapted upwards, which hides frees from RSS.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    argv = [str(params), str(width), moment_dtype, str(int(delayed)), str(int(accumulate)),
            optimizer]
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"host_memory child failed:\n{proc.stderr[-4000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    hb, base, n = r["host_bytes"], r["baseline"], r["params"]
    r["peak_growth"] = r["peak"] - base
    r["limit"] = base + 1.1 * hb  # the issue's bound: baseline + host_bytes + 10%
    r["within_limit"] = r["peak"] <= r["limit"]
    r["peak_growth_over_host_bytes"] = r["peak_growth"] / hb
    r["transient"] = r["peak"] - r["after_steps"]
    r["setup_peak_growth"] = r["setup_peak"] - base
    r["engine_growth"] = r["after_steps"] - r["with_model"]  # engine + 3 steps
    r["engine_growth_over_host_bytes"] = r["engine_growth"] / hb
    r["bytes_per_param"] = {k: v / n for k, v in (("host_bytes", hb),
                                                  ("peak_growth", r["peak_growth"]),
                                                  ("setup_peak_growth", r["setup_peak_growth"]),
                                                  ("transient", r["transient"]),
                                                  ("engine_growth", r["engine_growth"]))}
    r["floor_bytes_per_param"] = sum(
        v for k, v in r["host_budget"].items() if k not in CPU_ONLY) / n
    r["config"] = {"moment_dtype": moment_dtype, "delayed_update": delayed,
                   "accumulate": accumulate, "optimizer": optimizer}
    return r


def measure_fractions(params: float, width: int, configs: list = CONFIGS,
                      fractions: tuple = FRACTIONS, bucket_mb: float = 25.0) -> list[dict]:
    """Host bytes per trained parameter of each configuration at each ``offload_fraction``, from
    the engines' own accounting (one child process; no RSS: the emulated device's memory is the
    host's). ``bucket_mb``: the engines' ``bucket_size_mb`` (fractions fall on bucket edges)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               MALLOC_MMAP_THRESHOLD_=str(1 << 20))  # freed engines' buffers go back to the OS
    argv = [str(params), str(width), json.dumps(configs), json.dumps(fractions), str(bucket_mb)]
    proc = subprocess.run([sys.executable, "-c", FRACTIONS_CHILD, *argv], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"host_memory fractions child failed:\n{proc.stderr[-4000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in rows:
        n = r["params"]
        r["host_bytes_per_param"] = r["host_bytes"] / n
        r["gpu_host_bytes_per_param"] = sum(
            v for k, v in r["host_budget"].items() if k not in CPU_ONLY) / n
    return rows


def fractions_table(rows: list[dict], fractions: tuple = FRACTIONS) -> str:
    head = " / ".join(f"{f:g}" for f in fractions)
    out = [f"{rows[0]['params'] / 1e6:.0f}M parameters, bf16-mixed, one rank, emulated "
           "asynchronous device; host bytes per trained parameter at `offload_fraction` "
           f"{' / '.join(f'{f:g}' for f in fractions)} (resolved: "
           f"{' / '.join(f'{r:g}' for r in sorted({r['resolved'] for r in rows}, reverse=True))})"
           ": on a GPU machine (`host_bytes` less the CPU-as-device terms), then `host_bytes` on "
           "the CPU (the device's memory is the host's there)", "",
           f"| moments | delayed update | accumulation | GPU host: {head} | "
           f"`host_bytes` (CPU): {head} |", "|---|---|---|---|---|"]
    by: dict[tuple, dict] = {}
    for r in rows:
        c = r["config"]
        by.setdefault((c["moment_dtype"], c["delayed_update"], c["accumulate"]), {})[
            r["fraction"]] = r
    for (m, d, a), at in by.items():
        gpu = " / ".join(f"{at[f]['gpu_host_bytes_per_param']:.2f}" for f in fractions)
        cpu = " / ".join(f"{at[f]['host_bytes_per_param']:.2f}" for f in fractions)
        out.append(f"| {m} | {'on' if d else 'off'} | {'on' if a else 'off'} | **{gpu}** | "
                   f"{cpu} |")
    return "\n".join(out)


def configs_table(rows: list[dict]) -> str:
    out = [f"{rows[0]['params'] / 1e6:.0f}M parameters, bf16-mixed, one rank, emulated "
           f"asynchronous device, {rows[0]['config']['optimizer']}; bytes per trained "
           "parameter", "",
           "| moments | delayed update | accumulation | master | moments | fp32 gradient | "
           "staging | **total** | RSS growth (engine + 3 steps) / `host_bytes` |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, n, b = r["config"], r["params"], r["host_budget"]
        out.append(f"| {c['moment_dtype']} | {'on' if c['delayed_update'] else 'off'} | "
                   f"{'on' if c['accumulate'] else 'off'} | {b['master'] / n:.3f} | "
                   f"{b['moments'] / n:.3f} | {b['grad_fp32'] / n:.3f} | {b['staging'] / n:.3f} "
                   f"| **{r['floor_bytes_per_param']:.3f}** | "
                   f"{r['engine_growth_over_host_bytes']:.3f} |")
    return "\n".join(out)


def table(r: dict) -> str:
    n = r["params"]
    rows = [("baseline RSS (torch + package imported)", r["baseline"]),
            ("fp32 model built on the CPU (RSS growth)", r["with_model"] - r["baseline"]),
            ("`engine.host_bytes`", r["host_bytes"]),
            ("peak RSS - baseline", r["peak_growth"]),
            ("peak RSS during setup - baseline", r["setup_peak_growth"]),
            ("bound: 1.1 x `host_bytes`", r["limit"] - r["baseline"]),
            ("transient: peak - RSS after 3 steps", r["transient"]),
            ("RSS growth, engine built + 3 steps", r["engine_growth"])]
    out = [f"{n / 1e6:.0f}M parameters; peak within baseline + host_bytes + 10%: "
           f"**{'yes' if r['within_limit'] else 'NO'}** "
           f"(peak growth = {r['peak_growth_over_host_bytes']:.3f} x host_bytes; "
           f"engine growth = {r['engine_growth_over_host_bytes']:.3f} x host_bytes)", "",
           "| quantity | GB | bytes/param |", "|---|---|---|"]
    out += [f"| {name} | {v / GB:.2f} | {v / n:.2f} |" for name, v in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=None, help="5e8 (1e8 with --configs)")
    ap.add_argument("--configs", action="store_true", help="every moments x delayed x "
                    "accumulation configuration")
    ap.add_argument("--fractions", action="store_true", help="host bytes per parameter of every "
                    f"configuration at offload_fraction {' / '.join(map(str, FRACTIONS))}")
    ap.add_argument("--width", type=int, default=4096, help="width of the square layers")
    ap.add_argument("--optimizer", choices=("adamw", "lion", "sgd", "sgd-momentum"),
                    default="adamw", help="torch.optim.AdamW, lion_pytorch.Lion or "
                    "torch.optim.SGD without / with momentum (--configs and the default run)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "host_memory.json")
    args = ap.parse_args()
    if args.fractions:
        rows = measure_fractions(args.params or 1e8, args.width)
        out = args.out.with_name("host_memory_fractions.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2))
        print(fractions_table(rows))
        return
    if args.configs:
        rows = [measure(args.params or 1e8, args.width, *c, optimizer=args.optimizer)
                for c in CONFIGS]
        out = args.out.with_name("host_memory_configs.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2))
        print(configs_table(rows))
        return
    r = measure(args.params or 5e8, args.width, optimizer=args.optimizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2))
    print(table(r))


if __name__ == "__main__":
    main()
