"""FSDP2 (``fully_shard``) on the GPU: the engine under FSDP2 in ``bf16-mixed`` against FSDP2 +
``torch.optim.AdamW(fused=True)``, tokens/s and device memory beside ``lzo-plan --fsdp``'s count.

Run by ``benchmarks/device_check.sh`` as ``torchrun --nproc_per_node N`` (NCCL, one process per
GPU; N = 1 on a one-GPU machine). Every rank builds the GPT of ``benchmarks/_gpt.py`` (default
``350m``) on the meta device, ``fully_shard``-ed per block and at the root, its shards materialised
on its GPU (``fsdp2_cpu.sharded_gpt``), and trains each peer in turn on the same batch:

- ``torch_fused``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, fp32 shards,
  ``torch.optim.AdamW(fused=True)`` and its state on the GPU, ``clip_grad_norm_`` 1.0;
- ``zero_offload``: ``ZeroOffload(precision="bf16-mixed", offload_fraction=1.0,
  max_grad_norm=1.0)``: bf16 shards on the GPU, the master and moments on the host (the host's
  cores shared among the ranks: ``cpu_threads`` = cores / N);
- ``host_weights`` (issue 47): the weights on the host, ``fully_shard(...,
  offload_policy=CPUOffloadPolicy())`` (pinned; the rehearsal does not pin) with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, built by
  ``fsdp2_offload_cpu.offloaded_gpt``: ``ZeroOffload(offload_weights=True)`` steps FSDP2's fp32
  host shards in place, the host step under the next forward; ``host_weights_unoverlapped``: the
  same with ``overlap_host_step=False``. The GPU holds the units in flight, no weights.

Per peer: tokens/s (all ranks; the overlapped update waited for inside the timed span) and its
ratio to ``torch_fused``; ``torch.cuda.memory_allocated`` after setup and
``torch.cuda.max_memory_allocated`` over the run (the largest rank's). Beside them the planner's
FSDP2 count (``plan(..., fsdp=True, fsdp_unit_params=one block)``): the sharded bf16 weights,
FSDP2's two units in flight, the engine's own buffers (activations not counted), and the same
with ``offload_weights=True`` (no weights on the device).

``--rehearse`` (CI, ``device_check.sh --rehearse``): the same on the CPU with gloo, a tiny GPT,
the engine on the emulated asynchronous device; its "device" bytes are then the emulated device's
peak (the engine's own allocations only), beside the planner's count of them.

Rank 0 writes ``fsdp2_gpu.json`` and ``fsdp2_gpu.md`` to ``--out``; exits 1 naming each peer that
failed or came back without its figures.
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpt import gpt_config, random_batch  # noqa: E402
from fsdp2_cpu import _groups, sharded_gpt  # noqa: E402
from fsdp2_offload_cpu import offloaded_gpt  # noqa: E402

PEERS = ("torch_fused", "zero_offload", "host_weights", "host_weights_unoverlapped")
FIGURES = ("tokens_per_s", "setup_mib", "peak_mib")
MIB = 2**20


@contextlib.contextmanager
def _emulated(on: bool):  # noqa: ANN202
    """The rehearsal's device (yields its list of devices); nothing on CUDA."""
    if not on:
        yield []
        return
    from lightning_zero_offload import testing

    seed = int(os.environ.get("LZO_EMULATED_DEVICE_SEED", "1"))
    with testing.emulated_async_device(seed=seed + dist.get_rank()) as made:
        yield made


def _max(device: torch.device, *values: float) -> list[float]:
    """The largest of each value over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_peer(peer: str, cfg, device: torch.device, args: argparse.Namespace) -> dict:  # noqa: ANN001
    from lightning_zero_offload import ZeroOffload

    cuda, world = device.type == "cuda", dist.get_world_size()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    x, y = random_batch(cfg, args.batch, device=device, seed=dist.get_rank())
    engine = None
    with _emulated(not cuda and peer != "torch_fused") as made:
        if peer != "torch_fused":
            host = peer.startswith("host_weights")
            model = (offloaded_gpt(cfg, world, torch.bfloat16, mesh_device=device.type,
                                   pin_memory=cuda) if host
                     else sharded_gpt(cfg, world, device=str(device)))
            kw = ({"offload_weights": True, "overlap_host_step": peer == "host_weights"}
                  if host else {"offload_fraction": 1.0})
            engine = ZeroOffload(model, torch.optim.AdamW(_groups(model), lr=1e-4),
                                 device=device, precision="bf16-mixed", max_grad_norm=1.0,
                                 cpu_threads=max(1, len(os.sched_getaffinity(0)) // world), **kw)

            def step() -> None:
                engine.backward(model(x, y))
                engine.step()
                engine.zero_grad()
        else:
            model = sharded_gpt(cfg, world, torch.bfloat16, device=str(device))
            opt = torch.optim.AdamW(_groups(model), lr=1e-4, fused=True)

            def step() -> None:
                model(x, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        setup = torch.cuda.memory_allocated(device) if cuda else (
            made[0].live_bytes if made else 0)
        for _ in range(args.warmup):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        if engine is not None:
            engine.synchronize()  # the overlapped host step's last update counts too
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        dt = (time.perf_counter() - t0) / args.steps
        peak = torch.cuda.max_memory_allocated(device) if cuda else (
            made[0].peak_bytes if made else 0)
        if engine is not None:
            host = engine.host_bytes
            engine.teardown(copy_weights_to_module=False)
        else:
            host = 0
    setup, peak, dt, host = _max(device, setup, peak, dt, host)
    return {"step_s": dt, "tokens_per_s": world * args.batch * cfg.seq_len / dt,
            "setup_mib": setup / MIB, "peak_mib": peak / MIB, "engine_host_mib": host / MIB}


def planned(cfg, world: int) -> dict:  # noqa: ANN001
    from lightning_zero_offload.planner import plan

    d = cfg.d_model
    kw = dict(world_size=world, fsdp=True, precision="bf16-mixed", offload_fraction=1.0,
              fsdp_unit_params=12 * d * d + 13 * d, measure=False)
    p = plan(cfg.n_params, **kw)
    h = plan(cfg.n_params, **kw, offload_weights=True)
    return {"weights_mib": p.device_weight_bytes / MIB,
            "all_gather_mib": p.fsdp_all_gather_bytes / MIB,
            "engine_mib": p.device_engine_bytes / MIB, "device_mib": p.device_bytes / MIB,
            "host_mib_per_rank": p.host_bytes_per_rank / MIB,
            "host_weights_device_mib": h.device_bytes / MIB,
            "host_weights_host_mib_per_rank": h.host_bytes_per_rank / MIB}


def failures(res: dict) -> list[str]:
    out = []
    for peer in PEERS:
        r = res["peers"].get(peer, {"error": "did not run"})
        if "error" in r:
            out.append(f"{peer}: {r['error']}")
        elif missing := [f for f in FIGURES if f not in r]:
            out.append(f"{peer}: came back without {missing}")
    return out


def markdown(res: dict) -> str:
    c, pl = res["config"], res["planner"]
    lines = [f"FSDP2 on {res['device']}, {res['world']} rank(s), GPT {c['size']} "
             f"({res['params'] / 1e6:.0f}M parameters), batch {c['batch']} x {c['seq']}, "
             f"bf16: planner per rank {pl['weights_mib']:.0f} MiB shards + "
             f"{pl['all_gather_mib']:.0f} MiB all-gather + {pl['engine_mib']:.0f} MiB engine = "
             f"{pl['device_mib']:.0f} MiB (activations not counted); with host weights "
             f"{pl['host_weights_device_mib']:.0f} MiB on the device, "
             f"{pl['host_weights_host_mib_per_rank']:.0f} MiB on the host per rank", "",
             "| peer | tokens/s | x torch_fused | device MiB after setup | max allocated MiB | "
             "engine host MiB |", "|---|---|---|---|---|---|"]
    base = res["peers"].get("torch_fused", {}).get("tokens_per_s")
    for peer in PEERS:
        r = res["peers"].get(peer, {})
        if "error" in r:
            lines.append(f"| {peer} | {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.3f}" if base else "-"
        lines.append(f"| {peer} | {r['tokens_per_s']:.0f} | {ratio} | {r['setup_mib']:.0f} | "
                     f"{r['peak_mib']:.0f} | {r['engine_host_mib']:.0f} |")
    tps = {p: res["peers"].get(p, {}).get("tokens_per_s") for p in PEERS}
    if tps["host_weights"] and tps["host_weights_unoverlapped"] and tps["zero_offload"]:
        lines += ["", f"host weights: overlapped / unoverlapped "
                  f"{tps['host_weights'] / tps['host_weights_unoverlapped']:.3f}, "
                  f"host / GPU-resident weights {tps['host_weights'] / tps['zero_offload']:.3f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rehearse", action="store_true", help="the CPU, gloo, a tiny GPT")
    ap.add_argument("--size", default=None, help="GPT size (350m; rehearsal: tiny)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=80.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args(argv)
    cuda = not args.rehearse
    args.size = args.size or ("350m" if cuda else "tiny")
    args.batch, args.seq = args.batch or (8 if cuda else 2), args.seq or (1024 if cuda else 32)
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    deadline = time.monotonic() + args.budget_s
    cfg = gpt_config(args.size, seq_len=args.seq)
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (rehearsal)",
           "world": dist.get_world_size(), "params": cfg.n_params,
           "config": {"size": args.size, "batch": args.batch, "seq": args.seq},
           "planner": planned(cfg, dist.get_world_size()), "peers": {}}
    for peer in PEERS:
        if _max(device, time.monotonic() > deadline)[0]:  # every rank decides alike
            res["peers"][peer] = {"error": "skipped: time budget spent"}
            continue
        try:
            res["peers"][peer] = run_peer(peer, cfg, device, args)
        except Exception as e:  # noqa: BLE001 - an OOM of one peer must not hide the other
            res["peers"][peer] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if cuda:
            torch.cuda.empty_cache()
    res["failures"] = failures(res)
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fsdp2_gpu.json").write_text(json.dumps(res, indent=2))
        (args.out / "fsdp2_gpu.md").write_text(markdown(res) + "\n")
        print(markdown(res))
        for f in res["failures"]:
            print(f"FAILED fsdp2 {f}")
    dist.destroy_process_group()
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
