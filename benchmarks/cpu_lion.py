"""CPU side of a Lion step: the fused kernel against torch, side by side, one run.

The full CPU side of a ZeRO-Offload step with Lion: a bf16 gradient in, the gradient scale, the
decoupled decay, the sign update, the moment update and the bf16 weights out. Peers, in turns:

- ``fused``: ``ops.fused_lion_`` (one pass; fp32 moment, and bf16 / int8 moments);
- ``torch (lion_pytorch's ops)``: the gradient cast into a preallocated fp32 buffer and scaled,
  then lion_pytorch's ``update_fn`` (the ops ``lion_pytorch.Lion.step`` runs per parameter),
  the weights cast back;
- ``torch (lerp)``: the same update in the fewest torch passes we found (``lerp`` for both
  interpolations, ``sign_``, one ``add_`` with ``alpha``);
- ``bare pass``: the streaming probe over the fused step's bytes (read the bf16 gradient 2 and
  master and moment 8, write 8 and the bf16 weights 2: 20 B per parameter with an fp32
  moment), trivial arithmetic: the machine's ceiling for this access pattern.

    PYTHONPATH=src python benchmarks/cpu_lion.py [--sizes 10M,50M] [--threads 1,2] [--repeats 7]

Prints a Markdown table (median seconds per step, effective GB/s at 20 B per parameter, ratios)
and writes ``benchmarks/out/cpu_lion.json``. Medians over interleaved repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_zero_offload import ops
from lightning_zero_offload.core.rules.lion import Lion
from lightning_zero_offload.ops import _build

BYTES = 20  # per parameter, fp32 moment: read 2 + 4 + 4, write 4 + 4 + 2
LR, BETAS, WD, SCALE = 1e-4, (0.9, 0.99), 0.1, 0.5


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def time_peers(peers: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    for fn in peers.values():  # warm up: pages touched, pools started
        fn()
    runs: dict[str, list[float]] = {k: [] for k in peers}
    for _ in range(repeats):
        for name, fn in peers.items():
            t = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in runs.items()}


def peers_for(n: int, threads: int) -> dict[str, Callable[[], None]]:
    from lion_pytorch.lion_pytorch import update_fn

    g16 = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    hp = Lion().hyper({"lr": LR, "betas": BETAS, "weight_decay": WD})
    states = {md: (torch.randn(n), Lion().zeros(n, md)) for md in ops.MOMENT_DTYPES}
    p_t, m_t, g32 = torch.randn(n), torch.zeros(n), torch.empty(n)
    p_l, m_l, c = torch.randn(n), torch.zeros(n), torch.empty(n)
    a, b = torch.randn(n), torch.randn(n)
    ext = _build.load()
    b1, b2 = BETAS

    def fused(md: str) -> Callable[[], None]:
        p, st = states[md]
        return lambda: ops.fused_lion_(p, g16, step=1, grad_scale=SCALE, out=out,
                                       num_threads=threads, **st.kernel_args(),
                                       **hp.kernel_args())

    def torch_ops() -> None:
        g32.copy_(g16).mul_(SCALE)
        update_fn(p_t, g32, m_t, LR, WD, b1, b2)
        out.copy_(p_t)

    def torch_lerp() -> None:
        g32.copy_(g16).mul_(SCALE)
        p_l.mul_(hp.decay)
        torch.lerp(g32, m_l, b1, out=c)  # b1 * m + (1 - b1) * g
        p_l.add_(c.sign_(), alpha=-LR)
        m_l.lerp_(g32, 1 - b2)
        out.copy_(p_l)

    peers = {f"fused ({md} moment)": fused(md) for md in ops.MOMENT_DTYPES}
    peers["torch (lion_pytorch's ops)"] = torch_ops
    peers["torch (lerp)"] = torch_lerp
    if ext is not None:
        peers["bare pass"] = lambda: ext.stream_probe(a, b, None, g16, out, 0.0, threads, True)
    return peers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10M,50M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "cpu_lion.json")
    args = ap.parse_args()
    rows = []
    for n in map(parse_size, args.sizes.split(",")):
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            res = time_peers(peers_for(n, threads), args.repeats)
            rows.append({"params": n, "threads": threads, "seconds": res})
    info = {"date": datetime.date.today().isoformat(), "isa": ops.get_isa(),
            "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=2))
    print(f"kernel: {ops.backend()} ({ops.get_isa()}); bf16 gradient in, bf16 weights out; "
          f"GB/s at {BYTES} B per parameter (fp32 moment)\n")
    print("| params | threads | peer | s/step | GB/s | torch (best) / peer | peer / bare pass |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["seconds"]
        best_torch = min(s["torch (lion_pytorch's ops)"], s["torch (lerp)"])
        for name, t in s.items():
            bare = f"{t / s['bare pass']:.2f}" if "bare pass" in s else "-"
            print(f"| {r['params'] / 1e6:g}M | {r['threads']} | {name} | {t:.4f} | "
                  f"{BYTES * r['params'] / t / 1e9:.1f} | {best_torch / t:.2f} | {bare} |")


if __name__ == "__main__":
    main()
