"""The engine on the CPU against plain fused ``torch.optim.AdamW``, in one run.

Measured, for a small GPT (``benchmarks/_gpt.py``, plain torch modules) or (``--model mlp``) an
8-layer MLP of 2048-wide linear layers (33.6M parameters, batch 256, MSE loss):

- step time (forward + backward + clip + step + zero_grad) of ``ZeroOffload(precision=P)`` vs
  the same model with ``torch.optim.AdamW(fused=True)`` and ``clip_grad_norm_`` (for
  ``--precision bf16-mixed``: fp32 parameters under ``torch.autocast("cpu", torch.bfloat16)``,
  what Lightning's ``bf16-mixed`` runs), interleaved round by round so machine noise hits both;
  the ratio of medians (target <= 1.05);
- host bytes per parameter: the engine's own buffer accounting (fp32 master, moments, gradient:
  target 16 plus staging) and the growth of the process RSS, for 1 rank and per rank for 2 ranks
  (gloo, spawned processes; target about half of the optimizer state per rank).

Writes ``benchmarks/out/engine_cpu.json``. Run alone: a shared machine adds noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

import lightning_zero_offload as zo

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _dist import run_ranks  # noqa: E402
from _gpt import build_gpt, gpt_config, random_batch  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self, layers: int = 8, width: int = 2048) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return torch.nn.functional.mse_loss(self.layers[-1](x).float(), y)


def _model(args: argparse.Namespace):
    if args.model == "mlp":
        return None, MLP(width=args.width)
    cfg = gpt_config((args.layers, args.hidden), vocab_size=args.vocab, seq_len=args.seq)
    return cfg, build_gpt(cfg, seed=0)


def _batch(args: argparse.Namespace, cfg, batch: int, seed: int = 0):
    if args.model == "mlp":
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, args.width, generator=g),
                torch.randn(batch, args.width, generator=g))
    return random_batch(cfg, batch, seed=seed)


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def step_times(args: argparse.Namespace) -> dict:
    cfg, plain = _model(args)
    _, offl = _model(args)
    opt = torch.optim.AdamW(_groups(plain), lr=3e-4, fused=True)
    engine = zo.ZeroOffload(offl, torch.optim.AdamW(_groups(offl), lr=3e-4),
                            precision=args.precision, max_grad_norm=1.0,
                            cpu_threads=torch.get_num_threads())
    x, y = _batch(args, cfg, args.batch)
    bf16 = args.precision == "bf16-mixed"

    def plain_fwd_bwd() -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = plain(x, y)
        loss.backward()

    def plain_step(parts: dict) -> None:
        parts["fwd_bwd"] = _timed(plain_fwd_bwd)
        def opt_step() -> None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        parts["opt"] = _timed(opt_step)

    def engine_step(parts: dict) -> None:
        parts["fwd_bwd"] = _timed(lambda: engine.backward(engine.module(x, y)))
        parts["opt"] = _timed(lambda: (engine.step(), engine.zero_grad()))

    runs = {"plain": [], "engine": []}
    for i in range(args.warmup + args.steps):
        for name, fn in (("plain", plain_step), ("engine", engine_step))[:: 1 if i % 2 else -1]:
            parts: dict = {}
            total = _timed(lambda fn=fn, parts=parts: fn(parts))
            if i >= args.warmup:
                runs[name].append({"total": total, **parts})
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    low = {n: {k: min(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    return {
        "params": sum(p.numel() for p in plain.parameters()),
        "median_s": med,
        "min_s": low,  # on a busy machine the minimum is the better estimate of the cost
        "step_time_ratio": med["engine"]["total"] / med["plain"]["total"],
        "step_time_ratio_min": low["engine"]["total"] / low["plain"]["total"],
        "opt_step_ratio": med["engine"]["opt"] / med["plain"]["opt"],
        "opt_step_ratio_min": low["engine"]["opt"] / low["plain"]["opt"],
        "kernel_backend": zo.ops.backend(),
        "threads": torch.get_num_threads(),
    }


def memory_probe(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Host memory of one rank: the engine's buffer accounting and the RSS growth."""
    torch.set_num_threads(1)
    proc = psutil.Process()
    cfg, model = _model(args)
    params = sum(p.numel() for p in model.parameters())
    rss0 = proc.memory_info().rss
    engine = zo.ZeroOffload(model, torch.optim.AdamW(_groups(model), lr=3e-4),
                            precision=args.mem_precision, max_grad_norm=1.0, cpu_threads=1)
    x, y = _batch(args, cfg, 1, seed=rank)
    for _ in range(2):
        engine.backward(engine.module(x, y))
        engine.step()
        engine.zero_grad()
    rss1 = proc.memory_info().rss
    parts = engine.host_budget
    state = sum(parts[k] for k in ("master", "moments", "grad_fp32"))
    staging, device = parts["staging"], parts["device_weights"]
    return {
        "params": params,
        "host_state_bytes_per_param": state / params,  # master + m + v + grad of this shard
        "staging_bytes_per_param": staging / params,
        "cpu_device_buffer_bytes_per_param": device / params,  # "device" weights live on the CPU
        "preflight_bytes_per_param": engine.host_bytes / params,
        "rss_growth_bytes_per_param": (rss1 - rss0) / params,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    ap.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    ap.add_argument("--width", type=int, default=2048, help="mlp: width of its 8 layers")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, help="default: 8 (gpt), 256 (mlp)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mem-precision", default="bf16-mixed")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "engine_cpu.json")
    ap.add_argument("--speed-only", action="store_true", help="skip the memory probes")
    args = ap.parse_args()
    args.batch = args.batch or (256 if args.model == "mlp" else 8)

    # glibc keeps freed large blocks in its heap once its mmap threshold has adapted upwards,
    # which hides frees from RSS; a fixed threshold makes the probes' RSS track live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "speed": step_times(args)}
    if args.speed_only:
        print(json.dumps(result, indent=2))
        return
    result["memory_1_rank"] = run_ranks(memory_probe, 1, args, timeout=900)[0]
    result["memory_2_ranks"] = run_ranks(memory_probe, 2, args, timeout=900)
    one = result["memory_1_rank"]["host_state_bytes_per_param"]
    two = max(r["host_state_bytes_per_param"] for r in result["memory_2_ranks"])
    result["per_rank_state_ratio_2_vs_1"] = two / one
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
