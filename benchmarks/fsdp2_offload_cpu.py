"""FSDP2 with host-resident weights (``CPUOffloadPolicy``) on the CPU: the engine stepping FSDP2's
host shards in place, overlapped and unoverlapped, against FSDP2's own offload with torch's AdamW,
side by side in one run, on 1 and 2 gloo processes (issue 47).

Every rank builds the GPT of ``benchmarks/_gpt.py`` (default 4 layers x 1024, vocabulary 8192,
sequence 64: 58.8M parameters) once per peer, ``fully_shard``-ed per block and at the root with
``offload_policy=CPUOffloadPolicy(pin_memory=False)`` (no CUDA here to pin for), and trains them
on the same batches (two parameter groups, clip 1.0; ``fsdp2_cpu._groups``):

- ``torch``: FSDP2 + ``torch.optim.AdamW()`` (torch's default implementation: foreach) +
  ``clip_grad_norm_`` on the DTensors, as FSDP2's users run offload;
- ``overlapped``: ``ZeroOffload(offload_weights=True, max_grad_norm=1.0)``: the engine's kernel
  steps FSDP2's host shards in place on a worker under the next forward;
- ``unoverlapped``: the same with ``overlap_host_step=False`` (the step ends inside ``step()``).

Each round every peer runs ``--steps`` steps (the order turns round by round), the ranks meeting
at a barrier before and after; the overlapped engine's last update is waited for
(``engine.synchronize()``) inside the timed span. ms/step is rank 0's wall time / steps, ``opt``
the part after the backward (clip, step, zero_grad). Each round also runs the kernel's streaming
probe on every rank at once (``fsdp2_cpu._probe``: the host step's access pattern over the
rank's elements): the memory bandwidth ceiling the ranks share (GB/s, all ranks together).
Reported: medians over rounds, the ratios of medians to ``torch`` and overlapped / unoverlapped.

    python benchmarks/fsdp2_offload_cpu.py [--worlds 1,2] [--precision bf16-mixed] [--quick]

Writes ``benchmarks/out/fsdp2_offload_cpu.json`` and prints a Markdown table. Run alone where
possible: a shared machine adds noise (the ratios are what to read).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _dist import run_ranks  # noqa: E402
from _gpt import GPT, GPTConfig, random_batch  # noqa: E402
from fsdp2_cpu import BYTES_PER_ELEMENT, _config, _groups, _meta_params, _probe  # noqa: E402

PEERS = ("torch", "overlapped", "unoverlapped")


def offloaded_gpt(cfg: GPTConfig, world: int, half: torch.dtype | None = None, *,
                  mesh_device: str = "cpu", pin_memory: bool = False, seed: int = 0) -> GPT:
    """The GPT built on the meta device, ``fully_shard``-ed per block and at the root over the
    ``world`` ranks of a ``mesh_device`` mesh with ``CPUOffloadPolicy(pin_memory)``, its shards
    materialised on the host (FSDP2 copies each unit to ``mesh_device`` when it gathers it),
    each rank filling only its own (seeded per rank and parameter: every peer starts alike).
    ``half``: FSDP2 computes and reduces in it; the shards stay fp32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(cfg)
    kw = dict(mesh=init_device_mesh(mesh_device, (world,)),
              mp_policy=MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half),
              offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu")
    rank = dist.get_rank()
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            shard = p.to_local()
            if p.dim() >= 2:
                g = torch.Generator().manual_seed((seed * 1000 + i) * 64 + rank)
                shard.normal_(0.0, 0.02, generator=g)
            else:
                shard.fill_(0.0 if name.endswith("bias") else 1.0)
    return model


def _peer(name: str, cfg: GPTConfig, world: int, precision: str):  # noqa: ANN202
    """(model, the engine or None, one training step(x, y) -> seconds of its optimizer part)."""
    import lightning_zero_offload as zo

    model = offloaded_gpt(cfg, world, torch.bfloat16 if precision == "bf16-mixed" else None)
    if name == "torch":
        opt = torch.optim.AdamW(_groups(model), lr=3e-4)  # torch's default: foreach

        def torch_step(x: torch.Tensor, y: torch.Tensor) -> float:
            model(x, y).backward()
            t = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t
        return model, None, torch_step
    engine = zo.ZeroOffload(model, torch.optim.AdamW(_groups(model), lr=3e-4), device="cpu",
                            precision=precision, max_grad_norm=1.0, offload_weights=True,
                            overlap_host_step=name == "overlapped",
                            cpu_threads=torch.get_num_threads())

    def engine_step(x: torch.Tensor, y: torch.Tensor) -> float:
        engine.backward(model(x, y))
        t = time.perf_counter()
        engine.step()
        engine.zero_grad()
        return time.perf_counter() - t
    return model, engine, engine_step


def speed_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    cfg = _config(args)
    batches = [random_batch(cfg, args.batch, seed=1000 * s + rank) for s in range(args.steps)]
    peers = {name: _peer(name, cfg, world, args.precision) for name in PEERS}
    local = sum(p.to_local().numel() for p in peers["torch"][0].parameters())
    probe = _probe(local)
    times: dict[str, list[float]] = {n: [] for n in [*PEERS, "probe"]}
    opt: dict[str, list[float]] = {n: [] for n in PEERS}
    for r in range(args.warmup + args.rounds):
        for name in PEERS[r % len(PEERS):] + PEERS[:r % len(PEERS)]:
            _, engine, step = peers[name]
            dist.barrier()
            t0, spent = time.perf_counter(), 0.0
            for x, y in batches:
                spent += step(x, y)
            if engine is not None:
                engine.synchronize()  # the overlapped peer's last update counts too
            dist.barrier()
            if r >= args.warmup:
                times[name].append((time.perf_counter() - t0) / len(batches))
                opt[name].append(spent / len(batches))
        if probe is not None:
            dist.barrier()
            t0 = time.perf_counter()
            probe()
            dist.barrier()
            if r >= args.warmup:
                times["probe"].append(time.perf_counter() - t0)
    for _, engine, _ in peers.values():
        if engine is not None:
            engine.teardown()
    return {"local_params": local, "times": times, "opt": opt}


def speed(world: int, args: argparse.Namespace) -> dict:
    ranks = run_ranks(speed_rank, world, args, timeout=args.timeout)
    times, opt = ranks[0]["times"], ranks[0]["opt"]
    med = {n: statistics.median(times[n]) * 1e3 for n in PEERS}
    out = {"world": world, "ms_per_step": med,
           "opt_ms_per_step": {n: statistics.median(opt[n]) * 1e3 for n in PEERS},
           "rounds_ms": {n: [t * 1e3 for t in times[n]] for n in PEERS},
           "overlapped_vs_torch": med["overlapped"] / med["torch"],
           "unoverlapped_vs_torch": med["unoverlapped"] / med["torch"],
           "overlapped_vs_unoverlapped": med["overlapped"] / med["unoverlapped"],
           "local_params": [r["local_params"] for r in ranks]}
    if times["probe"]:
        out["probe_GBps_all_ranks"] = BYTES_PER_ELEMENT * sum(out["local_params"]) / (
            statistics.median(times["probe"]) * 1e9)
    return out


def table(res: dict) -> str:
    a = res["args"]
    lines = [f"GPT {a['layers']} x {a['hidden']}, vocabulary {a['vocab']}, batch {a['batch']} x "
             f"{a['seq']}: {res['params'] / 1e6:.1f}M parameters, {a['precision']}, "
             "fully_shard + CPUOffloadPolicy(pin_memory=False), "
             f"{a['rounds']} rounds x {a['steps']} steps, 1 thread per rank, "
             f"{os.cpu_count()} cores", "",
             "| ranks | torch ms/step | overlapped ms/step | unoverlapped ms/step | opt part ms "
             "(torch / overlapped / unoverlapped) | overlapped / torch | unoverlapped / torch | "
             "overlapped / unoverlapped | probe GB/s (all ranks) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["worlds"]:
        ms, op = r["ms_per_step"], r["opt_ms_per_step"]
        probe = r.get("probe_GBps_all_ranks")
        lines.append(
            f"| {r['world']} | {ms['torch']:.0f} | {ms['overlapped']:.0f} | "
            f"{ms['unoverlapped']:.0f} | {op['torch']:.0f} / {op['overlapped']:.0f} / "
            f"{op['unoverlapped']:.0f} | **{r['overlapped_vs_torch']:.3f}** | "
            f"{r['unoverlapped_vs_torch']:.3f} | {r['overlapped_vs_unoverlapped']:.3f} | "
            f"{'-' if probe is None else f'{probe:.1f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    ap.add_argument("--worlds", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps per peer per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted")
    ap.add_argument("--quick", action="store_true", help="a tiny GPT, one round: a smoke run")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "fsdp2_offload_cpu.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.seq, args.batch = 1, 64, 256, 16, 1
        args.steps, args.rounds, args.warmup = 1, 1, 0
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res = {"args": {k: v for k, v in vars(args).items() if k != "out"},
           "params": sum(p.numel() for p in _meta_params(args)),
           "worlds": [speed(w, args) for w in args.worlds]}
    args.out.write_text(json.dumps(res, indent=2, default=str))
    print(table(res))


if __name__ == "__main__":
    main()
