"""End-to-end GPU benchmark: ZeRO-Offload vs GPU-resident AdamW on GPT-style models, bf16.

Two measurements, each job in its own child process (clean device memory, its own memory cap,
exact peak host memory, an OOM or hang cannot take the rest down), under one time budget:

1. Throughput per model size, peers side by side in one child: tokens/s, model TFLOP/s, peak
   device and host memory, for
   - ``torch_bf16_master``: bf16 weights on the device + fp32 master weights and fused
     ``torch.optim.AdamW(fused=True)`` on the device. Same device compute and numerics as the
     engine's ``bf16-mixed`` (bf16 matmuls on bf16 weights, fp32 update): the fairer peer, and the
     one the ratios are taken against.
   - ``torch_autocast``: fp32 weights + ``torch.autocast(bf16)`` + fused AdamW (Lightning's
     ``bf16-mixed``); it re-casts every weight in each forward, so it is usually slower.
   - ``zero_offload`` and ``zero_offload_dpu`` (delayed parameter update, warm-up 2 steps).
   Model FLOPs per token = 6 * N_matmul + 12 * L * d * T (see ``_gpt.GPTConfig.flops_per_token``).
   Above 2B parameters every peer uses activation checkpointing (recompute not counted in FLOPs).
2. Largest model that trains (two steps, batch 1 x seq, activation checkpointing) with the device
   capped by ``torch.cuda.set_per_process_memory_fraction`` (default 24 GiB), with and without
   offload (the no-offload peer is ``torch_autocast``: 16 bytes per parameter, the usual setup).
   Sizes are tried from the largest down; the first that trains is the answer; sizes that cannot
   fit on arithmetic alone (16 B/param over the cap, or over host memory for offload) are skipped.

Writes ``gpu_e2e.json`` (after every job, so a timeout keeps what finished) and ``gpu_e2e.md`` (a
snippet for ``benchmarks/RESULTS.md``) to ``--out``. ``--cpu-smoke`` runs every code path on the CPU
with tiny models in seconds (what the tests run; there, cap jobs run in the parent process).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import build_gpt, gpt_config, random_batch  # noqa: E402

GIB = 2**30
PEERS = ("torch_bf16_master", "torch_autocast", "zero_offload", "zero_offload_dpu")
DPU_WARMUP = 2
CHECKPOINT_ABOVE = 2e9  # activation checkpointing for every peer above this many parameters
CAP_SIZES = ("13b", "6.7b", "4b", "2.7b", "1.3b", "760m", "350m")


class PeakRSS:
    """Samples this process's resident memory (pinned host buffers included) every 10 ms."""

    def __init__(self) -> None:
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self.peak = self.proc.memory_info().rss
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_peer(peer: str, cfg, device: torch.device, cpu_threads: int | None = None):  # noqa: ANN001, ANN201
    """Build model + optimizer for ``peer``; returns (train_step() -> None, cleanup() -> dict)."""
    gen = device if device.type == "cuda" else "cpu"
    hp = dict(lr=1e-4, weight_decay=0.1)
    if peer == "torch_autocast":
        model = build_gpt(cfg, device=device, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, lambda: {}
    if peer == "torch_bf16_master":
        model = build_gpt(cfg, device=device, dtype=torch.bfloat16)
        params = [p for p in model.parameters()]
        master = [p.detach().float() for p in params]
        for m in master:
            m.grad = torch.zeros_like(m)
        opt = torch.optim.AdamW(master, fused=True, **hp)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            model(x, y).backward()
            with torch.no_grad():
                torch._foreach_copy_([m.grad for m in master], [p.grad for p in params])
                opt.step()
                torch._foreach_copy_(params, master)
            model.zero_grad(set_to_none=True)

        return step, lambda: {}
    if peer in ("zero_offload", "zero_offload_dpu"):
        from lightning_zero_offload import ZeroOffload
        from lightning_zero_offload.core.profile import summarize

        model = build_gpt(cfg, device="cpu", dtype=torch.bfloat16, gen_device=gen)
        opt = torch.optim.AdamW(model.parameters(), **hp)
        dpu = peer == "zero_offload_dpu"
        engine = ZeroOffload(model, opt, device=device, precision="bf16-mixed",
                             delayed_update=dpu, delayed_update_warmup=DPU_WARMUP,
                             cpu_threads=cpu_threads)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            engine.backward(engine.module(x, y))
            engine.step()
            engine.zero_grad()

        def cleanup() -> dict:
            engine.synchronize()
            prof = summarize(list(engine.profile)[-5:])
            engine.teardown(copy_weights_to_module=False)
            return {"profile_mean_s": prof}

        return step, cleanup
    raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")


def run_peer(peer: str, cfg, device: torch.device, batch: int, warmup: int, steps: int,  # noqa: ANN001
             cpu_threads: int | None = None) -> dict:
    """Train ``warmup`` + ``steps`` steps; time the last ``steps`` (device work included)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    x, y = random_batch(cfg, batch, device=device)
    with PeakRSS() as rss:
        t_setup = time.perf_counter()
        step, cleanup = make_peer(peer, cfg, device, cpu_threads)
        setup_s = time.perf_counter() - t_setup
        for _ in range(warmup):
            step(x, y)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        _sync(device)
        dt = (time.perf_counter() - t0) / steps
        extra = cleanup()
    tokens = batch * cfg.seq_len
    out = {
        "peer": peer, "step_s": dt, "setup_s": setup_s, "tokens_per_step": tokens,
        "tokens_per_s": tokens / dt, "tflops": cfg.flops_per_token() * tokens / dt / 1e12,
        "peak_host_gib": rss.peak / GIB, **extra,
    }
    if device.type == "cuda":
        out["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def child(job: dict) -> dict:
    """One job in this process: ``throughput`` (all peers) or ``cap`` (one mode, one size)."""
    device = torch.device(job["device"])
    cfg = gpt_config(job["size"], **job.get("cfg", {}))
    threads = job.get("cpu_threads")
    if threads:
        torch.set_num_threads(threads)
    res: dict = {"job": job, "n_params": cfg.n_params}
    if job["kind"] == "throughput":
        res["peers"] = {}
        for peer in job["peers"]:
            if time.time() > job["deadline"]:
                res["peers"][peer] = {"error": "skipped: time budget spent"}
                continue
            try:
                res["peers"][peer] = run_peer(peer, cfg, device, job["batch"], job["warmup"],
                                              job["steps"], threads)
            except Exception as e:  # noqa: BLE001 - an OOM of one peer must not hide the others
                res["peers"][peer] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            _free(device)
        return res
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job["cap_gib"] * GIB / total), device)
    peer = "zero_offload" if job["mode"] == "offload" else "torch_autocast"
    try:
        r = run_peer(peer, cfg, device, job["batch"], warmup=1, steps=1, cpu_threads=threads)
        res.update(ok=True, **{k: r[k] for k in r if k.startswith("peak") or k == "step_s"})
    except Exception as e:  # noqa: BLE001 - OOM or host preflight: this size does not train
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return res


def spawn(job: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(job)]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, timeout=max(timeout, 1.0), text=True)
    except subprocess.TimeoutExpired:
        return {"job": job, "ok": False, "error": f"timeout after {timeout:.0f}s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"job": job, "ok": False, "error": f"child exit code {p.returncode}"}
    return json.loads(lines[-1][len("RESULT "):])


def environment(device: torch.device) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "cpu_cores": len(os.sched_getaffinity(0)),
           "host_mem_gib": psutil.virtual_memory().total / GIB, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_mem_gib=props.total_memory / GIB)
    return env


def ratios(peers: dict) -> dict:
    base = {k: peers.get(k, {}).get("tokens_per_s") for k in PEERS[:2]}
    out = {}
    for p in ("zero_offload", "zero_offload_dpu"):
        tps = peers.get(p, {}).get("tokens_per_s")
        for b, v in base.items():
            if tps and v:
                out[f"{p}/{b}"] = tps / v
    return out


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"### GPU end to end ({env['date']}, {env.get('gpu', env['device'])}, "
             f"{env['cpu_cores']} cores, {env['host_mem_gib']:.0f} GiB host, torch {env['torch']})",
             "", "Model FLOPs/token = 6*N_matmul + 12*L*d*T; ratios vs `torch_bf16_master`.", "",
             "| model | params | tokens/step | peer | tokens/s | TFLOP/s | ratio | device GiB "
             "| host GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["throughput"]:
        base = r.get("peers", {}).get("torch_bf16_master", {}).get("tokens_per_s")
        for peer, m in r.get("peers", {}).items():
            size, n = r["job"]["size"], f"{r['n_params'] / 1e9:.2f}B"
            if "error" in m:
                lines.append(f"| {size} | {n} | | {peer} | {m['error'][:60]} | | | | |")
                continue
            ratio = f"{m['tokens_per_s'] / base:.2f}" if base else ""
            lines.append(f"| {size} | {n} | {m['tokens_per_step']} | {peer} | "
                         f"{m['tokens_per_s']:.0f} | {m['tflops']:.1f} | {ratio} | "
                         f"{m.get('peak_device_gib', 0):.1f} | {m['peak_host_gib']:.1f} |")
    cap = results.get("cap", {})
    lines += ["", f"Largest model that trains under a {results['args']['cap_gib']} GiB device cap:"]
    for mode in ("gpu", "offload"):
        best = cap.get(mode, {}).get("largest")
        lines.append(f"- {mode}: " + (f"{best['size']} ({best['n_params'] / 1e9:.2f}B)"
                                      if best else "none"))
    if cap.get("ratio"):
        lines.append(f"- offload / gpu model size: {cap['ratio']:.1f}x")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU, seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    p.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget, all jobs")
    p.add_argument("--sizes", default="350m,1.3b,2.7b,6.7b", help="throughput sizes, in order")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=DPU_WARMUP + 2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    start = time.time()
    deadline = start + args.budget_s
    if args.cpu_smoke:  # one torch thread: a shared 2-core machine is not oversubscribed
        device, sizes, cap_sizes, threads = torch.device("cpu"), ["tiny"], ("small", "tiny"), 1
        cfg_kw, args.batch, args.steps = {"vocab_size": 512, "seq_len": 64}, 2, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_e2e.py needs a CUDA device; use --cpu-smoke to test on the CPU")
        device, cap_sizes, threads = torch.device("cuda"), CAP_SIZES, 0
        sizes = args.sizes.split(",")
        cfg_kw = {"seq_len": args.seq}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment(device), "args": vars(args), "throughput": [],
                     "cap": {}}

    def save() -> None:
        (out_dir / "gpu_e2e.json").write_text(json.dumps(results, indent=1))
        (out_dir / "gpu_e2e.md").write_text(markdown(results))

    def run(job: dict, share: float, checkpoint: bool) -> dict:
        """Give the job ``share`` of the time left."""
        left = deadline - time.time()
        job.update(device=str(device), cfg={**cfg_kw, "checkpoint": checkpoint},
                   cpu_threads=threads, deadline=time.time() + left * share)
        t = time.time()
        # the CPU smoke has no memory cap to isolate: its cap jobs run here (imports are slow)
        r = child(job) if args.cpu_smoke and job["kind"] == "cap" else spawn(job, left * share + 15)
        r["wall_s"] = time.time() - t
        print(f"[{time.time() - start:5.0f}s] {json.dumps(r)[:400]}", flush=True)
        return r

    def throughput(size: str, share: float) -> None:
        if deadline - time.time() < 20:
            return
        r = run({"kind": "throughput", "size": size, "peers": list(PEERS), "batch": args.batch,
                 "warmup": args.warmup, "steps": args.steps}, share,
                checkpoint=gpt_config(size).n_params > CHECKPOINT_ABOVE)
        r["ratios"] = ratios(r.get("peers", {}))
        results["throughput"].append(r)
        save()

    def cap_search(mode: str) -> None:
        host = psutil.virtual_memory().total
        tried = results["cap"].setdefault(mode, {"tried": [], "largest": None})
        for size in cap_sizes:
            n = gpt_config(size, **cfg_kw).n_params
            if device.type == "cuda":
                if mode == "gpu" and 16 * n > args.cap_gib * GIB:
                    tried["tried"].append({"size": size, "skipped": "16 B/param exceed the cap"})
                    continue
                if mode == "offload" and 16 * n > host:
                    tried["tried"].append({"size": size, "skipped": "16 B/param exceed host RAM"})
                    continue
            if deadline - time.time() < 20:
                break
            r = run({"kind": "cap", "mode": mode, "size": size, "batch": 1,
                     "cap_gib": args.cap_gib}, 0.25, checkpoint=True)
            r["size"] = size
            tried["tried"].append(r)
            if r.get("ok"):
                tried["largest"] = {"size": size, "n_params": r["n_params"]}
                break
        save()

    throughput(sizes[0], 0.3)
    cap_search("gpu")
    cap_search("offload")
    for size in sizes[1:]:
        throughput(size, 0.6)
    gpu, off = (results["cap"].get(m, {}).get("largest") for m in ("gpu", "offload"))
    if gpu and off:
        results["cap"]["ratio"] = off["n_params"] / gpu["n_params"]
    results["wall_s"] = time.time() - start
    save()
    print(markdown(results))
    for r in results["throughput"]:
        print(r["job"]["size"], {k: round(v, 3) for k, v in r["ratios"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
