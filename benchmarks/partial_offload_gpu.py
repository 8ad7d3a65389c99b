"""Partial offload on the GPU: tokens/s at ``offload_fraction`` 1.0, 0.5, 0.0 and "auto", each
beside the GPU-resident baseline, with the resolved fraction and the peak device memory.

One child process (its own device memory; an OOM or hang cannot take the caller down) trains the
GPT of ``benchmarks/_gpt.py`` (bf16) with each peer in turn, as ``gpu_e2e.py``'s throughput job
does and through its ``run_peer``: ``torch_bf16_master`` (bf16 weights, fp32 master weights and
fused ``torch.optim.AdamW`` on the device: same numerics as the engine's ``bf16-mixed``), then
``ZeroOffload`` (``gpu_e2e.engine_settings``) at each fraction. Per peer: tokens/s and its ratio
to the baseline's, ``engine.offload_fraction`` (the host's share of the state, "auto" resolved
after its first step), the peak device memory (``torch.cuda.max_memory_reserved``, what the
caching allocator held) and the mean ``cpu_step`` / ``device_step`` of the last steps.

``--rehearse`` runs the same job on the CPU with a tiny model, each engine on the emulated
asynchronous device given a capacity (``testing.emulated_async_device(memory_bytes=)``, default
1 GiB), so "auto" moves state as on a GPU; the peak device memory is then the emulated device's
(the engine's buffers only: activations live in host memory there), and the baseline has none.

Writes ``partial_offload_gpu.json`` (also when stopped early: after the child) and
``partial_offload_gpu.md`` to ``--out``; exits 1 naming each peer that failed or came back
without its figures (an out-of-memory is a figure: that fraction does not fit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import gpt_config  # noqa: E402
from gpu_e2e import (  # noqa: E402
    GIB,
    _error,
    _free,
    check_engine_settings,
    engine_settings,
    environment,
    run_peer,
    spawn,
)

BASELINE = "torch_bf16_master"
FRACTIONS: tuple[float | str, ...] = (1.0, 0.5, 0.0, "auto")
FIGURES = ("tokens_per_s", "offload_fraction", "peak_device_gib", "profile_mean_s")


def peer_name(fraction: float | str) -> str:
    return f"offload_{fraction}"


@contextlib.contextmanager
def emulated(memory_bytes: int | None):  # noqa: ANN201
    """The rehearsal's device with a capacity (yields its list of devices); nothing on CUDA."""
    if memory_bytes is None:
        yield []
        return
    from lightning_zero_offload import testing

    seed = int(os.environ.get("LZO_EMULATED_DEVICE_SEED", "1"))
    with testing.emulated_async_device(seed=seed, memory_bytes=memory_bytes) as made:
        yield made


def one_peer(job: dict, cfg, device: torch.device, fraction: float | str | None) -> dict:  # noqa: ANN001
    """``fraction`` None: the baseline."""
    if fraction is None:
        r = run_peer(BASELINE, cfg, device, job["batch"], job["warmup"], job["steps"], {})
    else:
        with emulated(job.get("emulated_memory_bytes")) as made:
            r = run_peer("zero_offload", cfg, device, job["batch"], job["warmup"], job["steps"],
                         {**job["engine"], "offload_fraction": fraction})
        if made:
            r["peak_device_gib"] = made[0].peak_bytes / GIB
            r["device_capacity_gib"] = made[0].memory_bytes / GIB
    if device.type == "cuda":
        r["peak_device_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return r


def child(job: dict) -> dict:
    device = torch.device(job["device"])
    cfg = gpt_config(job["size"], **job["cfg"])
    if job.get("torch_threads"):
        torch.set_num_threads(job["torch_threads"])
    res: dict = {"job": job, "n_params": cfg.n_params, "peers": {}}
    for fraction in [None, *job["fractions"]]:
        name = BASELINE if fraction is None else peer_name(fraction)
        if time.time() > job["deadline"]:
            res["peers"][name] = {"error": "skipped: time budget spent"}
            continue
        try:
            res["peers"][name] = one_peer(job, cfg, device, fraction)
        except Exception as e:  # noqa: BLE001 - an OOM at one fraction must not hide the others
            res["peers"][name] = _error(e)
        _free(device)
    return res


def with_ratios(res: dict) -> dict:
    base = res.get("peers", {}).get(BASELINE, {}).get("tokens_per_s")
    for m in res.get("peers", {}).values():
        if base and "tokens_per_s" in m:
            m["ratio"] = m["tokens_per_s"] / base
    return res


def failures(res: dict) -> list[str]:
    """One line per peer that failed or came back without its figures; an out-of-memory is a
    figure (that fraction does not fit), not a failure."""
    if "peers" not in res:
        return [f"all peers: {res.get('error', 'no result')}"]
    out = []
    for name in [BASELINE, *map(peer_name, res["job"]["fractions"])]:
        m = res["peers"].get(name, {"error": "missing from the result"})
        need = ("tokens_per_s",) if name == BASELINE else FIGURES
        if name == BASELINE and res["job"]["device"].startswith("cuda"):
            need = ("tokens_per_s", "peak_device_gib")
        if "error" in m and not m.get("does_not_fit"):
            out.append(f"{name}: {m['error']}")
        elif "error" not in m and [k for k in need if k not in m]:
            out.append(f"{name}: came back without {[k for k in need if k not in m]}")
    return out


def _num(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "" if v is None else format(scale * v, fmt)


def markdown(res: dict, env: dict) -> str:
    job = res["job"]
    n = res.get("n_params", gpt_config(job["size"]).n_params)
    lines = [f"### Partial offload ({env['date']}, {env.get('gpu', env['device'])}, "
             f"{env['cpu_cores']} cores, torch {env['torch']}): GPT {job['size']} "
             f"({n / 1e9:.3f}B), batch {job['batch']} x {job['cfg'].get('seq_len')}, bf16", "",
             f"Ratios vs `{BASELINE}` (all optimizer state on the device); device GiB: "
             + ("`torch.cuda.max_memory_reserved`" if job["device"].startswith("cuda") else
                "the emulated device's peak (engine buffers only; capacity "
                f"{job.get('emulated_memory_bytes', 0) / GIB:g} GiB)"), "",
             "| peer | resolved fraction | tokens/s | ratio | device GiB | host GiB (engine) | "
             "cpu_step ms | device_step ms |", "|---|---|---|---|---|---|---|---|"]
    if "peers" not in res:
        lines.append(f"| all | {res.get('error', 'no result')[:80]} | | | | | | |")
    for name, m in res.get("peers", {}).items():
        if "error" in m:
            lines.append(f"| {name} | {m['error'][:80]} | | | | | | |")
            continue
        prof = m.get("profile_mean_s", {})
        cells = [name, _num(m.get("offload_fraction"), ".3f"), _num(m["tokens_per_s"], ".0f"),
                 _num(m.get("ratio"), ".2f"), _num(m.get("peak_device_gib"), ".4g"),
                 _num(m.get("host_gib"), ".4g"), _num(prof.get("cpu_step"), ".1f", 1e3),
                 _num(prof.get("device_step"), ".1f", 1e3)]
        lines.append("| " + " | ".join(cells) + " |")
    auto = res.get("peers", {}).get(peer_name("auto"), {}).get("offload_fraction")
    if auto is not None:
        lines.append(f"\n\"auto\" resolved to offload_fraction={auto:.4f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rehearse", action="store_true", help="the CPU, a tiny model, the "
                   "emulated device with a capacity")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    p.add_argument("--budget-s", type=float, default=90.0)
    p.add_argument("--size", help="GPT size (default 350m; tiny with --rehearse)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    # "auto" moves after the first step; the profile means are of the last 5 steps
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--emulated-memory-gib", type=float, default=1.0,
                   help="--rehearse: the emulated device's capacity")
    p.add_argument("--cpu-threads", type=int)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    if not a.rehearse and not torch.cuda.is_available():
        raise SystemExit("partial_offload_gpu.py needs a CUDA device; use --rehearse on the CPU")
    engine = engine_settings(a.cpu_threads)
    if a.rehearse:  # the tiny model in several buckets, so 0.5 is a fraction of its own
        engine["bucket_size_mb"] = 0.05
    check_engine_settings(engine)
    job: dict = {"device": "cpu" if a.rehearse else "cuda", "size": a.size or (
        "tiny" if a.rehearse else "350m"), "fractions": list(FRACTIONS), "engine": engine,
        "warmup": a.warmup, "steps": a.steps,
        "batch": 2 if a.rehearse else a.batch,
        "cfg": {"vocab_size": 512, "seq_len": 64} if a.rehearse else {"seq_len": a.seq},
        "torch_threads": 1 if a.rehearse else None,
        "emulated_memory_bytes": int(a.emulated_memory_gib * GIB) if a.rehearse else None,
        "deadline": time.time() + a.budget_s - 10}
    env = environment(torch.device(job["device"]))
    t = time.time()
    res = with_ratios(spawn(job, a.budget_s, script=__file__))
    res["wall_s"] = time.time() - t
    res["failures"] = failed = failures(res)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "partial_offload_gpu.json").write_text(json.dumps({"environment": env, **res},
                                                             indent=1))
    md = markdown(res, env)
    (out / "partial_offload_gpu.md").write_text(md)
    print(md)
    for line in failed:
        print(f"partial_offload_gpu: FAILED {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
