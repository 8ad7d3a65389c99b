"""The host kernel's time per step against ``offload_fraction``, on the CPU, in one run.

One model (an MLP of ``--layers`` ``Linear(width, width, bias=False)``, one bucket per layer,
so the fractions fall on bucket edges), one engine per ``offload_fraction`` (default 1.0, 0.75, 0.5,
0.25), all built from the same weights in the same process and stepped round by round in a
rotating order, so machine noise hits every fraction alike. From each step's profile
(``engine.last_profile``): ``cpu_step`` (the host kernel on the host's buckets) and
``device_step`` (the device part: torch's fused AdamW on the trailing buckets). Reported: the
median of each, ``cpu_step`` as a ratio to the all-host engine's beside the resolved fraction
(``engine.offload_fraction``: the host's share of the elements), which it should follow.

On the CPU the "device" is the CPU too: ``device_step`` is real work on the same cores, not a
GPU's, so the sum does not fall; only the host kernel's share is the figure the issue asks for.

Run: ``PYTHONPATH=src python benchmarks/partial_offload_cpu.py [--steps 10]``; writes
``benchmarks/out/partial_offload_cpu.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import lightning_zero_offload as zo

HERE = Path(__file__).resolve().parent
FRACTIONS = (1.0, 0.75, 0.5, 0.25)


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def engines(args: argparse.Namespace) -> dict[float, zo.ZeroOffload]:
    # one layer per bucket: a whole number of buckets is each fraction
    elem = 4 if args.precision == "32-true" else 2
    bucket_mb = args.width**2 * elem * 1.01 / 2**20
    out = {}
    for f in args.fractions:
        model = make_model(args.layers, args.width)
        out[f] = zo.ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                precision=args.precision, bucket_size_mb=bucket_mb,
                                offload_fraction=f, cpu_threads=torch.get_num_threads())
    return out


def run(args: argparse.Namespace) -> dict:
    built = engines(args)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    times: dict[float, list[tuple[float, float]]] = {f: [] for f in built}
    order = list(built)
    for i in range(args.warmup + args.steps):
        for f in order[i % len(order):] + order[: i % len(order)]:  # rotate who goes first
            e = built[f]
            e.backward(e.module(x).float().pow(2).mean())
            e.step()
            e.zero_grad()
            p = e.last_profile
            assert p is not None
            if i >= args.warmup:
                times[f].append((p.cpu_step, p.device_step))
    rows = []
    for f, e in built.items():
        cpu = statistics.median(t[0] for t in times[f])
        dev = statistics.median(t[1] for t in times[f])
        rows.append({"fraction": f, "resolved": e.offload_fraction, "cpu_step_s": cpu,
                     "device_step_s": dev, "cpu_step_min_s": min(t[0] for t in times[f]),
                     "buckets": len(e.layout.buckets), "on_device": len(e._buckets.device())})
        e.teardown()
    base = next(r for r in rows if r["fraction"] == 1.0)
    for r in rows:
        r["cpu_step_ratio"] = r["cpu_step_s"] / base["cpu_step_s"]
        r["device_step_ratio"] = r["device_step_s"] / base["cpu_step_s"]
    params = sum(p.numel() for p in make_model(args.layers, args.width).parameters())
    return {"params": params, "threads": torch.get_num_threads(),
            "kernel_backend": zo.ops.backend(), "rows": rows,
            "args": {k: str(v) for k, v in vars(args).items()}}


def table(res: dict) -> str:
    out = [f"{res['params'] / 1e6:.1f}M parameters, {res['rows'][0]['buckets']} buckets, "
           f"{res['threads']} torch threads; medians; ratios to `cpu_step` at 1.0", "",
           "| `offload_fraction` | resolved | buckets on the device | `cpu_step` ms | "
           "`cpu_step` / 1.0 | `device_step` ms | `device_step` / 1.0's `cpu_step` |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['fraction']:g} | {r['resolved']:.3f} | {r['on_device']} | "
                   f"{1e3 * r['cpu_step_s']:.1f} | **{r['cpu_step_ratio']:.3f}** | "
                   f"{1e3 * r['device_step_s']:.1f} | {r['device_step_ratio']:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "partial_offload_cpu.json")
    args = ap.parse_args(argv)
    if 1.0 not in args.fractions:
        ap.error("--fractions must include 1.0: the ratios are taken against it")
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(table(res))


if __name__ == "__main__":
    main()
