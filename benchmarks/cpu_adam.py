"""CPU side of a ZeRO-Offload step: the fused kernel against its peers, side by side, one run.

  (a) fp32 gradient, AdamW update in place: ours vs ``torch._fused_adamw_`` (what
      ``torch.optim.AdamW(fused=True)`` runs, without the optimizer's Python loop) vs
      DeepSpeedCPUAdam when installed.
  (b) the full CPU side: bf16 gradient in, gradient scale, AdamW, bf16 weights out. Ours (one pass)
      vs the fastest torch composition (cast into a preallocated fp32 buffer,
      ``torch._fused_adamw_`` with its ``grad_scale``, cast back) vs DeepSpeed's path (fp32
      gradient, ``mul_``, DeepSpeedCPUAdam, ``copy_`` to bf16) when installed.
  (c) a streaming probe with the access pattern of (b): the machine's ceiling for it.
  (d) (b) with compact moments: ``moment_dtype`` fp32 / bf16 / int8 side by side (ratios to fp32
      moments), plus torchao's and bitsandbytes' ``AdamW8bit`` on the CPU when installed (their
      full ``step()`` with an fp32 gradient, no bf16 weights out).
  (e) the kernel right after torch ops: a loop that runs a few intra-op-parallel torch ops, then
      one step; only the step is timed. Ours on torch's intra-op pool (what ``ops.fused_adamw_``
      does on the main thread) and on our own pool (what a worker thread gets), against a bare
      fp32 ``torch._fused_adamw_`` pass in the same loop.

Byte model (what "effective GB/s" counts, per parameter): 28 B for every row. (a) reads the fp32
gradient 4 and master, exp_avg, exp_avg_sq 12, writes those 12. (b) reads the bf16 gradient 2 and
12, writes 12 and the bf16 weights 2; the torch composition physically moves ~40 B for the same
work (cast 2+4, update 28, cast back 4+2), which is why it is slower. (c) moves (b)'s 28 B.
(d) counts what each format moves: fp32 moments 28 B, bf16 20 B (moments 2+2 read, 2+2 written),
int8 16.06 B (1+1 read and written, plus the fp32 scales: 2 x 4 B per 256 elements, each way).

    python benchmarks/cpu_adam.py                       # 10M, 50M, 200M params; 1 and 2 threads
    python benchmarks/cpu_adam.py --sizes 2M --repeats 3  # quick
    python benchmarks/cpu_adam.py --sizes 50M --parts de    # the compact-moment figures
Writes benchmarks/out/cpu_adam.json. Timings are medians over interleaved repeats (peers take
turns, so background load hits them alike).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_zero_offload import ops
from lightning_zero_offload.ops import _build

BYTES_PER_PARAM = 28
MOMENT_BYTES = {"fp32": 28.0, "bf16": 20.0, "int8": 16.0 + 4 * 4 / ops.BLOCK}
LR, BETAS, EPS, WD, SCALE = 1e-4, (0.9, 0.999), 1e-8, 0.01, 0.5


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def deepspeed_adam() -> type | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None
    return DeepSpeedCPUAdam


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_peers(peers: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict:
    for fn in peers.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(repeats):
        for name, fn in peers.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts)}
            for name, ts in times.items()}


def call_overhead_us(threads: int) -> dict[str, float]:
    """Cost of one call on a 1-element tensor: the fixed price of calling chunk by chunk."""
    p, g, m, v = torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1)
    out = torch.empty(1, dtype=torch.bfloat16)
    ext = _build.load()
    calls = {"ops.fused_adamw_": lambda: ops.fused_adamw_(p, g, m, v, step=1, lr=LR, out=out,
                                                           num_threads=threads)}
    if ext is not None:
        calls["ext.fused_adamw (no checks)"] = lambda: ext.fused_adamw(
            p, g, m, v, out, 1, LR, 0.9, 0.999, EPS, WD, True, 1.0, threads, None, None, 0, 0,
            True)
    result = {}
    for name, fn in calls.items():
        for _ in range(200):
            fn()
        t0 = time.perf_counter()
        for _ in range(5000):
            fn()
        result[name] = (time.perf_counter() - t0) / 5000 * 1e6
    return result


def _arrays(n: int) -> tuple:
    """Seeded step inputs: (generator, master, exp_avg, exp_avg_sq, fp32 grad, bf16 grad)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen).mul_(1e-3)
    v = torch.rand(n, generator=gen).mul_(1e-6)
    g32 = torch.randn(n, generator=gen).mul_(1e-2)
    return gen, p, m, v, g32, g32.to(torch.bfloat16)


def bench_size(n: int, threads: int, repeats: int, warmup: int, ds_cls: type | None) -> list[dict]:
    torch.set_num_threads(threads)
    gen, p, m, v, g32, g16 = _arrays(n)
    tmp32 = torch.empty(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    step_t = torch.tensor(100.0)
    inv_scale = torch.tensor(1.0 / SCALE)  # torch's fused op divides by its grad_scale
    ext = _build.load()
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False,
              maximize=False)

    def ours_a() -> None:
        ops.fused_adamw_(p, g32, m, v, step=100, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         num_threads=threads)

    def torch_a() -> None:
        torch._fused_adamw_([p], [g32], [m], [v], [], [step_t], **kw)

    def ours_b() -> None:
        ops.fused_adamw_(p, g16, m, v, step=100, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         grad_scale=SCALE, out=out, num_threads=threads)

    def torch_b() -> None:
        tmp32.copy_(g16)
        torch._fused_adamw_([p], [tmp32], [m], [v], [], [step_t], grad_scale=inv_scale, **kw)
        out.copy_(p)

    peers_a = {"ours": ours_a, "torch_fused": torch_a}
    peers_b = {"ours": ours_b, "torch_composition": torch_b}
    if ds_cls is not None:
        param = torch.nn.Parameter(p)  # shares storage; DeepSpeed keeps its own moments
        ds = ds_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)

        def ds_a() -> None:
            param.grad = g32
            ds.step()

        def ds_b() -> None:
            tmp32.copy_(g16).mul_(SCALE)
            param.grad = tmp32
            ds.step()
            out.copy_(p)

        peers_a["deepspeed"], peers_b["deepspeed_path"] = ds_a, ds_b
    rows = []
    probe = None
    if ext is not None:
        res = time_peers({"probe": lambda: ext.stream_probe(p, m, v, g16, out, 0.0, threads,
                                                            True)},
                         repeats, warmup)
        probe = res["probe"]["median_s"]
        rows.append(_row("c", "probe", n, threads, res["probe"], None, probe))
    for part, peers, base in (("a", peers_a, "torch_fused"), ("b", peers_b, "torch_composition")):
        res = time_peers(peers, repeats, warmup)
        for name, r in res.items():
            rows.append(_row(part, name, n, threads, r, res[base]["median_s"], probe))
    return rows

def torchao_adamw8bit() -> type | None:
    try:
        from torchao.optim import AdamW8bit  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None
    return AdamW8bit


def bnb_adamw8bit() -> type | None:
    try:
        import bitsandbytes as bnb  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None
    return bnb.optim.AdamW8bit



def _torch_optimizer_step(cls: type, p: torch.Tensor, grad: torch.Tensor):
    """One step of a peer's torch.optim-style optimizer over a copy of ``p``."""
    param = torch.nn.Parameter(p.clone())
    opt = cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def step() -> None:
        param.grad = grad
        opt.step()
    return step


def bench_moments(n: int, threads: int, repeats: int, warmup: int, ao_cls: type | None,
                  bnb_cls: type | None = None) -> list[dict]:
    """(d): bf16 gradient in, bf16 weights out, one step per moment format."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m32 = torch.randn(n, generator=gen).mul_(1e-3)
    v32 = torch.rand(n, generator=gen).mul_(1e-6)
    g16 = torch.randn(n, generator=gen).mul_(1e-2).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    moms = {md: ops.Moments.from_fp32(m32, v32, md, names=ops.ADAM) for md in ops.MOMENT_DTYPES}
    del m32, v32
    peers: dict[str, Callable[[], None]] = {}
    for md, mom in moms.items():
        kw = mom.kernel_args()
        peers[md] = (lambda kw=kw: ops.fused_adamw_(
            p, g16, step=100, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_scale=SCALE,
            out=out, num_threads=threads, **kw))
    ext = _build.load()
    if ext is not None:
        a, b, c = p.clone(), p.clone(), p.clone()
        peers["probe"] = lambda: ext.stream_probe(a, b, c, g16, out, 0.0, threads, True)
    for name, cls in (("torchao_AdamW8bit", ao_cls), ("bnb_AdamW8bit", bnb_cls)):
        if cls is not None:
            peers[name] = _torch_optimizer_step(cls, p, g16.float())
    res = time_peers(peers, repeats, warmup)
    base = res["fp32"]["median_s"]
    rows = []
    for name, r in res.items():
        t = r["median_s"]
        bpp = MOMENT_BYTES.get(name, BYTES_PER_PARAM)
        rows.append({"part": "d", "peer": name, "params": n, "threads": threads,
                     "median_ms": t * 1e3, "min_ms": r["min_s"] * 1e3, "params_per_s": n / t,
                     "bytes_per_param": bpp if name in MOMENT_BYTES or name == "probe" else None,
                     "eff_GBps": bpp * n / t / 1e9 if name in MOMENT_BYTES or name == "probe"
                     else None,
                     "x_fp32_time": t / base})
    return rows


def compute_ns_per_param(threads: int = 1, n: int = 16384, calls: int = 2000) -> dict:
    """Each format's arithmetic alone: the step on an L2-resident array (raw extension call,
    best of 5 rounds), ns per parameter per thread, as wall time and as the calling thread's CPU
    time (with one thread the kernel runs on the caller, so the latter ignores other processes
    on a shared machine). Against (d)'s time per parameter this says whether a format is bound
    by memory or by arithmetic on this CPU."""
    ext = _build.load()
    if ext is None:
        return {}
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    res = {}
    for md in ops.MOMENT_DTYPES:
        mom = ops.Moments.from_fp32(torch.randn(n) * 1e-3, torch.rand(n) * 1e-6, md,
                                    names=ops.ADAM)
        args = (p, g16, mom.exp_avg, mom.exp_avg_sq, out, 100, LR, BETAS[0], BETAS[1], EPS, WD,
                True, SCALE, threads, mom.exp_avg_scales, mom.exp_avg_sq_scales, 0, 0, False)
        wall = cpu = float("inf")
        for _ in range(5):
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                ext.fused_adamw(*args)
            c1, t1 = time.thread_time(), time.perf_counter()
            wall = min(wall, (t1 - t0) / calls / n * 1e9)
            cpu = min(cpu, (c1 - c0) / calls / n * 1e9)
        res[md] = wall
        res[md + "_thread"] = cpu
    return res


def bench_interleaved(n: int, threads: int, repeats: int) -> list[dict]:
    """(e): each iteration runs torch ops (which leave torch's OpenMP workers spinning), then one
    step; only the step is timed. Peers take turns within every iteration."""
    torch.set_num_threads(threads)
    ext = _build.load()
    if ext is None:
        return []
    gen, p, m, v, g32, g16 = _arrays(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    x = torch.randn(512, 512, generator=gen)
    step_t = torch.tensor(100.0)
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False,
              maximize=False)

    def torch_ops() -> None:
        y = x @ x
        (y.relu_() * 0.5).sum()

    def ours(pool: bool) -> Callable[[], None]:
        return lambda: ext.fused_adamw(p, g16, m, v, out, 100, LR, BETAS[0], BETAS[1], EPS, WD,
                                       True, SCALE, threads, None, None, 0, 0, pool)

    peers = {"torch_fused_fp32": lambda: torch._fused_adamw_([p], [g32], [m], [v], [], [step_t],
                                                             **kw),
             "ours_torch_pool": ours(True), "ours_own_pool": ours(False)}
    times: dict[str, list[float]] = {k: [] for k in peers}
    for it in range(repeats + 2):
        for name, fn in peers.items():
            torch_ops()
            t0 = time.perf_counter()
            fn()
            if it >= 2:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch_fused_fp32"])
    return [{"part": "e", "peer": name, "params": n, "threads": threads,
             "median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3,
             "x_torch_fused": statistics.median(ts) / base} for name, ts in times.items()]


def _row(part: str, peer: str, n: int, threads: int, r: dict, base_s: float | None,
         probe_s: float | None) -> dict:
    t = r["median_s"]
    return {
        "part": part, "peer": peer, "params": n, "threads": threads,
        "median_ms": t * 1e3, "min_ms": r["min_s"] * 1e3,
        "params_per_s": n / t, "eff_GBps": BYTES_PER_PARAM * n / t / 1e9,
        "speedup_vs_torch": (base_s / t) if base_s else None,
        "fraction_of_probe": (probe_s / t) if probe_s else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,50M,200M", help="comma list, e.g. 1M,50M")
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts")
    parser.add_argument("--parts", default="abcde", help="which parts to run, e.g. de")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "out" / "cpu_adam.json")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    ds_cls = deepspeed_adam()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(), "cores": torch.get_num_threads(), "torch": torch.__version__,
        "backend": ops.backend(), "isa": ops.get_isa(), "bytes_per_param": BYTES_PER_PARAM,
    }
    print(f"# {info['date']}  {info['cpu']}  torch {info['torch']}  kernel={info['backend']}"
          f"/{info['isa']}")
    if ds_cls is None:
        print("# DeepSpeedCPUAdam: not installed, its rows are skipped")
    overhead = {t: call_overhead_us(t) for t in thread_counts}
    for t, o in overhead.items():
        print(f"# per-call overhead, {t} thread(s): "
              + ", ".join(f"{k} {v:.1f} us" for k, v in o.items()))
    header = (f"{'part':4} {'peer':18} {'params':>8} {'thr':>3} {'ms':>9} {'Mparam/s':>9} "
              f"{'GB/s@28B':>9} {'x torch':>8} {'of probe':>8}")
    print(header)
    rows: list[dict] = []
    for n in sizes if set(args.parts) & set("abc") else []:
        for t in thread_counts:
            for r in bench_size(n, t, args.repeats, args.warmup, ds_cls):
                rows.append(r)
                ratio = f"{r['speedup_vs_torch']:.2f}x" if r["speedup_vs_torch"] else "-"
                frac = f"{r['fraction_of_probe']:.0%}" if r["fraction_of_probe"] else "-"
                print(f"{r['part']:4} {r['peer']:18} {n / 1e6:>7.0f}M {t:>3} "
                      f"{r['median_ms']:>9.2f} {r['params_per_s'] / 1e6:>9.0f} "
                      f"{r['eff_GBps']:>9.1f} {ratio:>8} {frac:>8}", flush=True)
    if "d" in args.parts:
        comp = compute_ns_per_param()
        rows.append({"part": "d", "peer": "compute_ns_per_param_in_L2", **comp})
        print("# arithmetic alone (L2-resident, 1 thread), ns/param, wall (thread CPU time): "
              + ", ".join(f"{md} {comp[md]:.3f} ({comp[md + '_thread']:.3f})"
                          for md in ops.MOMENT_DTYPES if md in comp))
        ao_cls = torchao_adamw8bit()
        if ao_cls is None:
            print("# torchao AdamW8bit: not installed, its rows are skipped")
        bnb_cls = bnb_adamw8bit()
        if bnb_cls is None:
            print("# bitsandbytes AdamW8bit: not installed, its rows are skipped")
        print(f"{'part':4} {'moments':18} {'params':>8} {'thr':>3} {'ms':>9} {'B/param':>8} "
              f"{'GB/s':>7} {'x fp32':>7}")
        for n in sizes:
            for t in thread_counts:
                for r in bench_moments(n, t, args.repeats, args.warmup, ao_cls, bnb_cls):
                    rows.append(r)
                    bpp = f"{r['bytes_per_param']:.2f}" if r["bytes_per_param"] else "-"
                    gbs = f"{r['eff_GBps']:.1f}" if r["eff_GBps"] else "-"
                    print(f"d    {r['peer']:18} {n / 1e6:>7.0f}M {t:>3} {r['median_ms']:>9.2f} "
                          f"{bpp:>8} {gbs:>7} {r['x_fp32_time']:>6.2f}x", flush=True)
    if "e" in args.parts:
        print(f"{'part':4} {'after torch ops':18} {'params':>8} {'thr':>3} {'ms':>9} "
              f"{'x torch_fused':>13}")
        for n in sizes:
            for t in thread_counts:
                for r in bench_interleaved(n, t, max(args.repeats, 15)):
                    rows.append(r)
                    print(f"e    {r['peer']:18} {n / 1e6:>7.0f}M {t:>3} {r['median_ms']:>9.2f} "
                          f"{r['x_torch_fused']:>12.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"info": info, "call_overhead_us": overhead, "rows": rows},
                                   indent=1))
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
