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
   Sizes are tried from the largest down; the first that trains is the answer. A size is built
   only if it can fit: for offload, ``lightning_zero_offload.planner.plan`` (the engine's own
   sizing) plus an activation estimate must fit the cap and the host's free memory; without
   offload, 16 B/param plus activations must fit the cap. Each size tried gets a fixed share of
   the budget (``--cap-share``), so one slow candidate cannot starve the search.

Writes ``gpu_e2e.json`` (after every job, so a timeout keeps what finished) and ``gpu_e2e.md`` (a
snippet for ``benchmarks/RESULTS.md``) to ``--out``. Exits 1, naming each job, when a job fails or
comes back without its figures (an out-of-memory, or a host-memory preflight refusal, is a
figure: that size does not fit). ``--rehearse`` (alias ``--cpu-smoke``) runs every job through
the same settings, child processes and checks on the CPU, with tiny models and the one-thread
torch of a shared machine: only the device, the sizes and the budget differ (see ``settings``).
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
OFFLOAD_PEERS = ("zero_offload", "zero_offload_dpu")
DPU_WARMUP = 2
CHECKPOINT_ABOVE = 2e9  # activation checkpointing for every peer above this many parameters
CAP_SIZES = ("13b", "6.7b", "4b", "2.7b", "1.3b", "760m", "350m")
# The rehearsal's candidates: 13b must be refused by the arithmetic and the planner unbuilt.
REHEARSE_CAP_SIZES = ("13b", "small", "tiny")
# What a throughput peer must bring back (plus the device peak on CUDA, the profile for ours).
FIGURES = ("step_s", "tokens_per_s", "tflops", "peak_host_gib")


def engine_settings(cpu_threads: int | None) -> dict:
    """The ``ZeroOffload`` keyword arguments of every offload job, on CUDA and in the rehearsal
    alike (``delayed_update`` is added per peer): one place, so a value the config rejects fails
    the rehearsal too. ``cpu_threads=None`` is the engine's own choice (the cores this process
    may use, one fewer with delayed update). ``offload_fraction=1.0``: these jobs measure full
    offload (the default ``"auto"`` would move the state of a model that fits onto the GPU after
    the first step); ``partial_offload_gpu.py`` measures the fractions and ``"auto"``."""
    return {"precision": "bf16-mixed", "delayed_update_warmup": DPU_WARMUP,
            "cpu_threads": cpu_threads, "offload_fraction": 1.0}


def check_engine_settings(engine: dict) -> None:
    """Fail before any job when ``ZeroOffloadConfig`` rejects the settings (a wasted GPU run
    otherwise: every offload job would fail the same way)."""
    from lightning_zero_offload import ZeroOffloadConfig

    for delayed in (False, True):
        ZeroOffloadConfig().replace(delayed_update=delayed, **engine)


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


def make_peer(peer: str, cfg, device: torch.device, engine: dict):  # noqa: ANN001, ANN201
    """Build model + optimizer for ``peer``; returns (train_step() -> None, cleanup() -> dict).
    ``engine``: :func:`engine_settings` (offload peers only)."""
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
    if peer in OFFLOAD_PEERS:
        from lightning_zero_offload import ZeroOffload
        from lightning_zero_offload.core.device.profile import summarize

        model = build_gpt(cfg, device="cpu", dtype=torch.bfloat16, gen_device=gen)
        opt = torch.optim.AdamW(model.parameters(), **hp)
        zo = ZeroOffload(model, opt, device=device, delayed_update=peer == "zero_offload_dpu",
                         **engine)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            zo.backward(zo.module(x, y))
            zo.step()
            zo.zero_grad()

        def cleanup() -> dict:
            zo.synchronize()
            prof = summarize(list(zo.profile)[-5:])
            out = {"profile_mean_s": prof, "offload_fraction": zo.offload_fraction,
                   "host_gib": zo.host_bytes / GIB}
            zo.teardown(copy_weights_to_module=False)
            return out

        return step, cleanup
    raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")


def run_peer(peer: str, cfg, device: torch.device, batch: int, warmup: int, steps: int,  # noqa: ANN001
             engine: dict) -> dict:
    """Train ``warmup`` + ``steps`` steps; time the last ``steps`` (device work included)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    x, y = random_batch(cfg, batch, device=device)
    with PeakRSS() as rss:
        t_setup = time.perf_counter()
        step, cleanup = make_peer(peer, cfg, device, engine)
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


def _error(e: BaseException) -> dict:
    """An exception as a result; ``does_not_fit`` marks the out-of-memory kinds (device OOM, the
    engine's host-memory preflight), which are figures, not failures."""
    oom = isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())  # e.g. cudaHostAlloc
    return {"error": f"{type(e).__name__}: {str(e)[:300]}", "does_not_fit": oom}


def child(job: dict) -> dict:
    """One job in this process: ``throughput`` (all peers) or ``cap`` (one mode, one size)."""
    device = torch.device(job["device"])
    cfg = gpt_config(job["size"], **job.get("cfg", {}))
    if job.get("torch_threads"):
        torch.set_num_threads(job["torch_threads"])
    res: dict = {"job": job, "n_params": cfg.n_params}
    if job["kind"] == "throughput":
        res["peers"] = {}
        for peer in job["peers"]:
            if time.time() > job["deadline"]:
                res["peers"][peer] = {"error": "skipped: time budget spent"}
                continue
            try:
                res["peers"][peer] = run_peer(peer, cfg, device, job["batch"], job["warmup"],
                                              job["steps"], job["engine"])
            except Exception as e:  # noqa: BLE001 - an OOM of one peer must not hide the others
                res["peers"][peer] = _error(e)
            _free(device)
        return res
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job["cap_gib"] * GIB / total), device)
    peer = "zero_offload" if job["mode"] == "offload" else "torch_autocast"
    try:
        r = run_peer(peer, cfg, device, job["batch"], 1, 1, job["engine"])
        res.update(ok=True, **{k: r[k] for k in r if k.startswith("peak") or k == "step_s"})
    except Exception as e:  # noqa: BLE001 - OOM or host preflight: this size does not train
        res.update(ok=False, **_error(e))
    return res


def spawn(job: dict, timeout: float, script: str = __file__) -> dict:
    """Run ``job`` in a child process of ``script`` (its own device memory, cap and peak RSS)."""
    cmd = [sys.executable, script, "--child", json.dumps(job)]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, timeout=max(timeout, 1.0), text=True)
    except subprocess.TimeoutExpired:
        return {"job": job, "ok": False, "error": f"timeout after {timeout:.0f}s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"job": job, "ok": False, "error": f"child exit code {p.returncode} (its "
                "traceback is above in this log)"}
    return json.loads(lines[-1][len("RESULT "):])


def activation_bytes(cfg, batch: int) -> int:  # noqa: ANN001
    """Activations of one training step under activation checkpointing, 16-bit: each block's
    input kept, one block recomputed in full (Korthikanti et al. 2022: ``s b H (34 + 5 a s / H)``)
    and the logits with their fp32 loss (``s b V (2 + 4)``)."""
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_head
    block = s * batch * h * (34 + 5 * a * s / h)
    return int(cfg.n_layer * 2 * s * batch * h + block + s * batch * cfg.vocab_size * 6)


def cannot_fit(mode: str, cfg, device: torch.device, cap_gib: float, engine: dict,  # noqa: ANN001
               host_free: int) -> str | None:
    """Why ``cfg`` cannot train in ``mode`` under the cap (None: it may, build it). Offload asks
    the planner (the engine's own sizing); the GPU-resident peer needs 16 B/param."""
    from lightning_zero_offload.planner import plan

    cap, acts, n = cap_gib * GIB, activation_bytes(cfg, 1), cfg.n_params
    if mode == "gpu":
        need = 16 * n + acts
        return (f"16 B/param + activations = {need / GIB:.1f} GiB exceed the {cap_gib:g} GiB cap"
                if need > cap else None)
    p = plan(n, precision=engine["precision"], device=device.type, host_memory=host_free,
             device_memory=int(cap) if device.type == "cuda" else None, measure=False,
             offload_fraction=engine["offload_fraction"])
    if device.type == "cuda" and p.device_bytes + acts > cap:
        return (f"planner: {p.device_bytes / GIB:.1f} GiB + activations {acts / GIB:.1f} GiB "
                f"exceed the {cap_gib:g} GiB cap")
    host = p.host_bytes_per_rank + 2 * n  # + the bf16 model built on the host first
    if host > host_free:
        return (f"planner: {host / GIB:.1f} GiB of host memory (model included) exceed the "
                f"{host_free / GIB:.1f} GiB free")
    return None


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
    for p in OFFLOAD_PEERS:
        tps = peers.get(p, {}).get("tokens_per_s")
        for b, v in base.items():
            if tps and v:
                out[f"{p}/{b}"] = tps / v
    return out


def failures(results: dict) -> list[str]:
    """One line per job that failed or came back without its figures, naming the job. An
    out-of-memory is a figure (that size does not fit), not a failure; so is a size the
    arithmetic or the planner ruled out."""
    cuda = results["environment"]["device"].startswith("cuda")
    out = []
    for r in results["throughput"]:
        name = f"throughput {r['job']['size']}"
        if "peers" not in r:
            out.append(f"{name}: {r.get('error', 'no result')}")
            continue
        for peer in r["job"]["peers"]:
            m = r["peers"].get(peer, {"error": "missing from the result"})
            need = (*FIGURES, *(("peak_device_gib",) if cuda else ()),
                    *(("profile_mean_s",) if peer in OFFLOAD_PEERS else ()))
            if "error" in m and not m.get("does_not_fit"):
                out.append(f"{name} {peer}: {m['error']}")
            elif "error" not in m and [k for k in need if k not in m]:
                out.append(f"{name} {peer}: came back without {[k for k in need if k not in m]}")
    for mode in ("gpu", "offload"):
        search = results["cap"].get(mode)
        if search is None:
            out.append(f"cap {mode}: not run")
            continue
        for r in search["tried"]:
            if "skipped" not in r and not r.get("ok") and not r.get("does_not_fit"):
                out.append(f"cap {mode} {r['size']}: {r.get('error', 'no result')}")
        if search["largest"] is None:
            out.append(f"cap {mode}: no size trained under the cap")
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
        size = r["job"]["size"]  # a job that timed out or crashed has only the parent's record
        n = f"{r.get('n_params', gpt_config(size).n_params) / 1e9:.2f}B"
        if "peers" not in r:
            lines.append(f"| {size} | {n} | | all | {r.get('error', '')[:60]} | | | | |")
        for peer, m in r.get("peers", {}).items():
            if "error" in m:
                lines.append(f"| {size} | {n} | | {peer} | {m['error'][:60]} | | | | |")
                continue
            ratio = f"{m['tokens_per_s'] / base:.2f}" if base else ""
            lines.append(f"| {size} | {n} | {m['tokens_per_step']} | {peer} | "
                         f"{m['tokens_per_s']:.0f} | {m['tflops']:.1f} | {ratio} | "
                         f"{m.get('peak_device_gib', 0):.1f} | {m['peak_host_gib']:.1f} |")
    if results.get("not_run"):
        lines.append(f"\nNot run (time budget spent): {', '.join(results['not_run'])}")
    cap = results.get("cap", {})
    lines += ["", f"Largest model that trains under a {results['args']['cap_gib']} GiB device cap:"]
    for mode in ("gpu", "offload"):
        best = cap.get(mode, {}).get("largest")
        lines.append(f"- {mode}: " + (f"{best['size']} ({best['n_params'] / 1e9:.2f}B)"
                                      if best else "none"))
    if cap.get("ratio"):
        lines.append(f"- offload / gpu model size: {cap['ratio']:.1f}x")
    return "\n".join(lines) + "\n"


def settings(args: argparse.Namespace) -> dict:
    """Everything the CUDA run and the rehearsal do differently: the device, the sizes, torch's
    thread count on a shared machine. The jobs, the engine settings and the checks are shared."""
    if args.rehearse:  # one torch thread: a shared 2-core machine is not oversubscribed
        return {"device": torch.device("cpu"), "sizes": (args.sizes or "tiny").split(","),
                "cap_sizes": REHEARSE_CAP_SIZES, "torch_threads": 1,
                "cfg": {"vocab_size": 512, "seq_len": 64}, "batch": 2, "steps": 2}
    if not torch.cuda.is_available():
        raise SystemExit("gpu_e2e.py needs a CUDA device; use --rehearse to rehearse on the CPU")
    return {"device": torch.device("cuda"), "sizes": (args.sizes or "350m,1.3b,2.7b,6.7b")
            .split(","), "cap_sizes": CAP_SIZES, "torch_threads": None,
            "cfg": {"seq_len": args.seq}, "batch": args.batch, "steps": args.steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rehearse", "--cpu-smoke", action="store_true",
                   help="every job on the CPU with tiny models (seconds per job)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    p.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget, all jobs")
    p.add_argument("--sizes", help="throughput sizes, in order (default 350m,1.3b,2.7b,6.7b; "
                   "tiny with --rehearse)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=DPU_WARMUP + 2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--cap-share", type=float, default=0.15,
                   help="share of --budget-s each size of the largest-model search may take")
    p.add_argument("--cpu-threads", type=int, help="ZeroOffload(cpu_threads=); default: the "
                   "engine's own choice")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    start = time.time()
    deadline = start + args.budget_s
    s = settings(args)
    device, cfg_kw, engine = s["device"], s["cfg"], engine_settings(args.cpu_threads)
    try:
        check_engine_settings(engine)
    except (TypeError, ValueError) as e:
        print(f"gpu_e2e: FAILED before any job: the offload jobs' settings {engine} are "
              f"rejected: {e}", flush=True)
        return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment(device), "args": vars(args), "throughput": [],
                     "cap": {}, "not_run": []}

    def save() -> None:
        (out_dir / "gpu_e2e.json").write_text(json.dumps(results, indent=1))
        (out_dir / "gpu_e2e.md").write_text(markdown(results))

    def run(job: dict, seconds: float, checkpoint: bool) -> dict:
        """Run ``job`` in a child within ``seconds`` (never past the deadline)."""
        seconds = min(seconds, deadline - time.time())
        job.update(device=str(device), cfg={**cfg_kw, "checkpoint": checkpoint}, engine=engine,
                   torch_threads=s["torch_threads"], deadline=time.time() + seconds)
        t = time.time()
        r = spawn(job, seconds + 15)
        r["wall_s"] = time.time() - t
        print(f"[{time.time() - start:5.0f}s] {json.dumps(r)[:400]}", flush=True)
        return r

    def throughput(size: str, seconds: float) -> None:
        if deadline - time.time() < 20:
            results["not_run"].append(f"throughput {size}")
            return
        r = run({"kind": "throughput", "size": size, "peers": list(PEERS), "batch": s["batch"],
                 "warmup": args.warmup, "steps": s["steps"]}, seconds,
                checkpoint=gpt_config(size).n_params > CHECKPOINT_ABOVE)
        r["ratios"] = ratios(r.get("peers", {}))
        results["throughput"].append(r)
        save()

    def cap_search(mode: str) -> None:
        tried = results["cap"].setdefault(mode, {"tried": [], "largest": None})
        for size in s["cap_sizes"]:
            cfg = gpt_config(size, **cfg_kw, checkpoint=True)
            why = cannot_fit(mode, cfg, device, args.cap_gib, engine,
                             psutil.virtual_memory().available)
            if why:
                tried["tried"].append({"size": size, "skipped": why})
                continue
            if deadline - time.time() < 20:
                results["not_run"].append(f"cap {mode} {size}")
                break
            r = run({"kind": "cap", "mode": mode, "size": size, "batch": 1,
                     "cap_gib": args.cap_gib}, args.cap_share * args.budget_s, checkpoint=True)
            r["size"] = size
            tried["tried"].append(r)
            if r.get("ok"):
                tried["largest"] = {"size": size, "n_params": r["n_params"]}
                break
        save()

    sizes = s["sizes"]
    throughput(sizes[0], 0.25 * args.budget_s)
    cap_search("gpu")
    cap_search("offload")
    for i, size in enumerate(sizes[1:]):  # the rest of the budget, shared equally
        throughput(size, (deadline - time.time()) / (len(sizes) - 1 - i))
    gpu, off = (results["cap"].get(m, {}).get("largest") for m in ("gpu", "offload"))
    if gpu and off:
        results["cap"]["ratio"] = off["n_params"] / gpu["n_params"]
    results["wall_s"] = time.time() - start
    results["failures"] = failed = failures(results)
    save()
    print(markdown(results))
    for r in results["throughput"]:
        print(r["job"]["size"], {k: round(v, 3) for k, v in r["ratios"].items()})
    for line in failed:
        print(f"gpu_e2e: FAILED {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
