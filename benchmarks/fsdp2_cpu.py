"""FSDP2 (``fully_shard``) on the CPU: the engine stepping each rank's local shards against FSDP2
with torch's AdamW, side by side in one run, on 2 and 4 gloo processes.

Every rank builds the GPT of ``benchmarks/_gpt.py`` (default 4 layers x 1024, vocabulary 8192,
sequence 64: 58.8M parameters, the token embedding tied to the head) once per peer,
``fully_shard``-ed per block and at the root over a 1-D mesh of every rank, and trains them on the
same batches (two parameter groups: weight decay 0.1 on matrices, 0 on the rest; clip 1.0):

- ``fused``: FSDP2 + ``torch.optim.AdamW(fused=True)`` + ``clip_grad_norm_`` on the DTensors;
- ``foreach``: the same with ``foreach=True``;
- ``engine``: ``ZeroOffload`` over the sharded model (``max_grad_norm=1.0``): FSDP2 gathers and
  reduces, the engine steps this rank's shards with its host kernel.

``--precision bf16-mixed``: the engine casts the shards to bf16; the peers keep fp32 shards and
compute and reduce in bf16 through ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``
(the same bytes gathered and reduced). Each round every peer runs ``--steps`` steps, the ranks
meeting at a barrier before and after (the order turns round by round, so background load hits
each alike); ms/step is that wall time / steps on rank 0, ``opt`` the part of it after the
backward (clip, step, zero_grad). Each round also runs the kernel's streaming probe on every rank
at once over as many elements as the rank steps (the host step's access pattern, 28 B per
element): the memory bandwidth the ranks' steps share then (GB/s, all ranks together).
Reported: medians over rounds, the ratio of medians engine / fused (goal <= 1.10) and engine /
foreach, and the median of the per-round ratios. DeepSpeed ZeRO-3 with ``offload_optimizer`` is
a peer only where ``deepspeed`` imports (it needs its C++ CPU Adam built); the result says why not.

``--memory``: per rank, at 1, 2 and 4 ranks, ``bf16-mixed``, moments fp32 / bf16 / int8, no
accumulation, the engine on the emulated asynchronous device (so its host budget is what a GPU
machine's host holds; the model built on the meta device and materialised sharded, so no rank
ever holds the whole model): host bytes per local parameter from ``engine.host_budget`` (less the
CPU-as-device terms, ``host_memory.CPU_ONLY``; floor 14 / 10 / 8.03), the RSS growth of building
the engine and running 3 steps against ``engine.host_bytes``, the local shards' dtypes and bytes,
and the engine's own device bytes (the emulated device's peak) beside ``lzo-plan --fsdp``'s count.

    python benchmarks/fsdp2_cpu.py [--worlds 2,4] [--precision bf16-mixed] [--memory] [--quick]

Writes ``benchmarks/out/fsdp2_cpu.json`` (``fsdp2_cpu_memory.json``) and prints Markdown tables.
Run alone where possible: a shared machine adds noise (the ratios are what to read).
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
from _gpt import GPT, gpt_config, random_batch  # noqa: E402
from host_memory import CPU_ONLY  # noqa: E402

PEERS = ("fused", "foreach", "engine")
BYTES_PER_ELEMENT = 28  # the probe's (and the fp32-gradient AdamW step's) traffic
MOMENTS = ("fp32", "bf16", "int8")


def deepspeed_status() -> str:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no peer
        return f"not importable here ({type(e).__name__}: {e}); no ZeRO-3 peer"
    return "importable, but not a peer yet: ZeRO-3 offload_optimizer needs its CPU Adam build"


def _config(args: argparse.Namespace):  # noqa: ANN202
    return gpt_config((args.layers, args.hidden), vocab_size=args.vocab, seq_len=args.seq)


def sharded_gpt(cfg, world: int, half: torch.dtype | None = None, seed: int = 0,  # noqa: ANN001
                device: str = "cpu") -> GPT:
    """The GPT built on the meta device, ``fully_shard``-ed per block and at the root over the
    ``world`` ranks, then materialised on ``device``: each rank allocates and fills only its
    shards (seeded per parameter, so every peer starts from the same weights; not GPT-2's
    initialisation, which needs the whole tensor). ``half``: FSDP2 computes and reduces in it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = GPT(cfg)
    mesh = init_device_mesh(torch.device(device).type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(seed * 1000 + i)
            full = (torch.ones(p.shape) if ".ln" in name or name.startswith("ln_") else
                    torch.zeros(p.shape) if name.endswith("bias") else
                    torch.randn(p.shape, generator=g).mul_(0.02)).to(device)
            cut = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(cut.to_local())  # FSDP2's own cut: no communication
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def _peer(name: str, cfg, world: int, precision: str):  # noqa: ANN001, ANN202
    """(model, one training step(x, y) -> seconds of its optimizer part)."""
    import lightning_zero_offload as zo

    half = torch.bfloat16 if precision == "bf16-mixed" and name != "engine" else None
    model = sharded_gpt(cfg, world, half)
    if name == "engine":
        engine = zo.ZeroOffload(model, torch.optim.AdamW(_groups(model), lr=3e-4),
                                precision=precision, max_grad_norm=1.0,
                                cpu_threads=torch.get_num_threads())

        def engine_step(x: torch.Tensor, y: torch.Tensor) -> float:
            engine.backward(model(x, y))
            t = time.perf_counter()
            engine.step()
            engine.zero_grad()
            return time.perf_counter() - t
        return engine, engine_step
    opt = torch.optim.AdamW(_groups(model), lr=3e-4, **{name: True})

    def torch_step(x: torch.Tensor, y: torch.Tensor) -> float:
        model(x, y).backward()
        t = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t
    return model, torch_step


def _probe(n: int):  # noqa: ANN202
    """The kernel's streaming probe over ``n`` elements (None without the C++ kernel)."""
    from lightning_zero_offload.ops import _build

    ext = _build.load()
    if ext is None:
        return None
    p, m, v = torch.rand(n), torch.rand(n), torch.rand(n)
    g16, out = torch.rand(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    return lambda: ext.stream_probe(p, m, v, g16, out, 0.0, 1, True)


def speed_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    cfg = _config(args)
    batches = [random_batch(cfg, args.batch, seed=1000 * s + rank) for s in range(args.steps)]
    peers = {name: _peer(name, cfg, world, args.precision) for name in PEERS}
    local = sum(p.to_local().numel() for p in peers["fused"][0].parameters())
    probe = _probe(local)
    times: dict[str, list[float]] = {n: [] for n in [*PEERS, "probe"]}
    opt: dict[str, list[float]] = {n: [] for n in PEERS}
    for r in range(args.warmup + args.rounds):
        order = PEERS[r % len(PEERS):] + PEERS[:r % len(PEERS)]
        for name in order:
            dist.barrier()
            t0, spent = time.perf_counter(), 0.0
            for x, y in batches:
                spent += peers[name][1](x, y)
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
    peers["engine"][0].teardown()
    return {"local_params": local, "times": times, "opt": opt}


def speed(world: int, args: argparse.Namespace) -> dict:
    ranks = run_ranks(speed_rank, world, args, timeout=args.timeout)
    times, opt = ranks[0]["times"], ranks[0]["opt"]
    med = {n: statistics.median(times[n]) * 1e3 for n in PEERS}
    out = {"world": world, "ms_per_step": med,
           "min_ms_per_step": {n: min(times[n]) * 1e3 for n in PEERS},
           "opt_ms_per_step": {n: statistics.median(opt[n]) * 1e3 for n in PEERS},
           "rounds_ms": {n: [t * 1e3 for t in times[n]] for n in PEERS},
           "engine_vs_fused": med["engine"] / med["fused"],
           "engine_vs_foreach": med["engine"] / med["foreach"],
           "engine_vs_fused_per_round": statistics.median(
               e / f for e, f in zip(times["engine"], times["fused"], strict=True)),
           "local_params": [r["local_params"] for r in ranks]}
    if times["probe"]:
        elems = sum(out["local_params"])  # every rank streams its own arrays at once
        out["probe_GBps_all_ranks"] = BYTES_PER_ELEMENT * elems / statistics.median(
            times["probe"]) / 1e9
    return out


def speed_table(res: dict) -> str:
    a = res["args"]
    lines = [f"GPT {a['layers']} x {a['hidden']}, vocabulary {a['vocab']}, batch {a['batch']} x "
             f"{a['seq']}: {res['params'] / 1e6:.1f}M parameters, {a['precision']}, "
             f"{a['rounds']} rounds x {a['steps']} steps, 1 thread per rank, "
             f"{os.cpu_count()} cores; DeepSpeed: {res['deepspeed']}", "",
             "| ranks | fused ms/step | foreach ms/step | engine ms/step | opt part ms "
             "(fused / foreach / engine) | engine / fused | engine / foreach | per-round "
             "engine / fused | probe GB/s (all ranks) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["worlds"]:
        ms, op = r["ms_per_step"], r["opt_ms_per_step"]
        probe = r.get("probe_GBps_all_ranks")
        lines.append(
            f"| {r['world']} | {ms['fused']:.0f} | {ms['foreach']:.0f} | {ms['engine']:.0f} | "
            f"{op['fused']:.0f} / {op['foreach']:.0f} / {op['engine']:.0f} | "
            f"**{r['engine_vs_fused']:.3f}** | {r['engine_vs_foreach']:.3f} | "
            f"{r['engine_vs_fused_per_round']:.3f} | "
            f"{'-' if probe is None else f'{probe:.1f}'} |")
    return "\n".join(lines)


def memory_rank(rank: int, world: int, args: argparse.Namespace, moment_dtype: str) -> dict:
    import resource

    import psutil

    import lightning_zero_offload as zo
    from lightning_zero_offload.testing import emulated_async_device

    proc = psutil.Process()
    cfg = _config(args)
    base = proc.memory_info().rss
    model = sharded_gpt(cfg, world)
    sharded = proc.memory_info().rss
    with emulated_async_device(seed=rank, max_delay_ms=0.5) as made:
        engine = zo.ZeroOffload(model, torch.optim.AdamW(_groups(model), lr=3e-4),
                                precision="bf16-mixed", moment_dtype=moment_dtype,
                                accumulate=False, cpu_threads=1)
        x, y = random_batch(cfg, 1, seed=rank)
        for _ in range(3):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        after = proc.memory_info().rss
        shards = [p.to_local() for p in model.parameters()]
        out = {"local_params": sum(t.numel() for t in shards),
               "shard_dtypes": sorted({str(t.dtype) for t in shards}),
               "shard_bytes": sum(t.numel() * t.element_size() for t in shards),
               "host_budget": dict(engine.host_budget), "host_bytes": engine.host_bytes,
               "engine_device_bytes": made[0].peak_bytes,
               "rss_sharded_model": sharded - base, "rss_engine_growth": after - sharded,
               "peak_rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
               - base}
        engine.teardown()
    return out


def memory(args: argparse.Namespace) -> list[dict]:
    from lightning_zero_offload.planner import plan

    rows = []
    total = sum(p.numel() for p in _meta_params(args))
    for moment_dtype in MOMENTS:
        for world in args.memory_worlds:
            ranks = run_ranks(memory_rank, world, args, moment_dtype, timeout=args.timeout)
            planned = plan(total, world_size=world, fsdp=True, precision="bf16-mixed",
                           moment_dtype=moment_dtype, offload_fraction=1.0, measure=False)
            for r in ranks:
                n, b = r["local_params"], r["host_budget"]
                r["floor_bytes_per_local_param"] = sum(
                    v for k, v in b.items() if k not in CPU_ONLY) / n
            rows.append({"moment_dtype": moment_dtype, "world": world, "params": total,
                         "ranks": ranks,
                         "planner": {"host_bytes_per_rank": planned.host_bytes_per_rank,
                                     "device_weight_bytes": planned.device_weight_bytes,
                                     "device_engine_bytes": planned.device_engine_bytes,
                                     "fsdp_all_gather_bytes": planned.fsdp_all_gather_bytes}})
    return rows


def _meta_params(args: argparse.Namespace) -> list[torch.nn.Parameter]:
    with torch.device("meta"):
        return list(GPT(_config(args)).parameters())


def memory_table(rows: list[dict]) -> str:
    """Per configuration, the largest rank's figures (MB = 10^6 bytes)."""
    one = {r["moment_dtype"]: r["ranks"][0] for r in rows if r["world"] == 1}
    lines = [f"GPT of {rows[0]['params'] / 1e6:.1f}M parameters, bf16-mixed, no accumulation, "
             "emulated asynchronous device; per rank, the largest rank's figures", "",
             "| moments | ranks | local params | host floor B / local param | host_bytes MB "
             "(1 rank's / ranks) | RSS growth MB (1 rank's / ranks) | shards | engine device MB "
             "(planner) |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = max(row["ranks"], key=lambda x: x["host_bytes"])
        base = one.get(row["moment_dtype"])
        share, rss = ("-", "-") if base is None else (
            f"{base['host_bytes'] / row['world'] / 1e6:.1f}",
            f"{base['rss_engine_growth'] / row['world'] / 1e6:.1f}")
        planned = row["planner"]["device_engine_bytes"] / 1e6
        lines.append(
            f"| {row['moment_dtype']} | {row['world']} | {r['local_params'] / 1e6:.2f}M | "
            f"**{r['floor_bytes_per_local_param']:.3f}** | {r['host_bytes'] / 1e6:.1f} "
            f"({share}) | {r['rss_engine_growth'] / 1e6:.1f} ({rss}) | "
            f"{'/'.join(r['shard_dtypes'])}, "
            f"{r['shard_bytes'] / r['local_params']:.2f} B/param | "
            f"{r['engine_device_bytes'] / 1e6:.1f} ({planned:.1f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    ap.add_argument("--worlds", help="process counts, comma-separated (2,4; --quick: 2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps per peer per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted")
    ap.add_argument("--memory", action="store_true", help="the host-memory probes instead")
    ap.add_argument("--memory-worlds", default="1,2,4")
    ap.add_argument("--quick", action="store_true", help="a tiny GPT, one round: a smoke run")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "fsdp2_cpu.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.seq, args.batch = 1, 64, 256, 16, 1
        args.steps, args.rounds, args.warmup = 1, 1, 0
    args.worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    args.memory_worlds = [int(w) for w in str(args.memory_worlds).split(",")]
    # glibc keeps freed large blocks in its heap once its mmap threshold has adapted upwards,
    # which hides frees from RSS; a fixed one (inherited by the ranks) makes RSS track live memory
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.memory:
        rows = memory(args)
        args.out.with_name(args.out.stem + "_memory.json").write_text(json.dumps(rows, indent=2))
        print(memory_table(rows))
        return
    res = {"args": {k: v for k, v in vars(args).items() if k != "out"},
           "params": sum(p.numel() for p in _meta_params(args)),
           "deepspeed": deepspeed_status(), "worlds": [speed(w, args) for w in args.worlds]}
    args.out.write_text(json.dumps(res, indent=2, default=str))
    print(speed_table(res))


if __name__ == "__main__":
    main()
