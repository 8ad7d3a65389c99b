"""What to change when a run does not fit, and the planner's text report.

``lzo-plan`` answering "fits: NO" is only useful with the resource that is short and the changes
that would make it fit. Every change listed here was re-planned with the planner's own counting
(the ``evaluate`` callable ``plan`` passes in) and fits as a whole; its figures are that plan's.

Device and host bytes depend on different settings (the device on the weights, the batch and
activation checkpointing; the host on ``moment_dtype`` and the ranks; delayed update on both),
so when both are short a fitting change is one device-side change plus one host-side change
(pairs are tried only when no single change fits).
This module imports nothing from ``planner`` (``planner`` calls it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

GiB = 2**30

Evaluate = Callable[[dict[str, Any]], Any]  # settings overrides -> a Plan (no advice, no search)


def short_resources(p: Any) -> list[dict[str, Any]]:
    """``[{"resource", "needed", "available"}]`` for each memory that is too small (bytes; the
    host figure is per node, what is compared with ``host_memory``)."""
    out = []
    if p.device_fits is False:
        out.append({"resource": "device", "needed": p.device_bytes,
                    "available": p.device_memory})
    if p.host_fits is False:
        out.append({"resource": "host", "needed": p.host_bytes_per_node,
                    "available": p.host_memory})
    return out


def _entry(change: str, q: Any) -> dict[str, Any]:
    return {"change": change, "fits": bool(q.fits), "device_bytes": q.device_bytes,
            "host_bytes": q.host_bytes_per_node}


def _smallest_world_size(s: dict[str, Any], evaluate: Evaluate) -> dict[str, Any] | None:
    """The fewest ranks (as many per node as now: more machines) whose host share fits."""
    start, per_node = s["world_size"], s["ranks_per_node"] or s["world_size"]

    def ok(w: int) -> bool:
        return bool(evaluate({"world_size": w, "ranks_per_node": per_node}).host_fits)

    lo, hi = start, start + 1  # ok(lo) is False (the host is short now)
    while not ok(hi):
        if hi >= 4096:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return {"world_size": hi, "ranks_per_node": per_node}


def _largest_batch(s: dict[str, Any], evaluate: Evaluate) -> int | None:
    """The largest batch below the given one whose device bytes fit (activations grow with it)."""
    def ok(b: int) -> bool:
        return bool(evaluate({"batch_size": b}).device_fits)

    if not ok(1):
        return None
    lo, hi = 1, s["batch_size"]  # ok(hi) is False (the device is short now)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _flags(o: dict[str, Any]) -> str:
    parts = []
    for key, value in o.items():
        if key == "moment_dtype":
            parts.append(f"--moment-dtype {value}")
        elif key == "world_size":
            parts.append(f"--world-size {value} --ranks-per-node {o['ranks_per_node']}")
        elif key == "activation_checkpointing":
            parts.append("--activation-checkpointing")
        elif key == "delayed_update":
            parts.append("without --delayed-update")
        elif key == "batch_size":
            parts.append(f"--batch-size {value}")
        elif key == "device_memory":
            parts.append(f"--device-memory {value // GiB}GiB (a larger device)")
    return " + ".join(parts)


def suggest(p: Any, s: dict[str, Any], evaluate: Evaluate) -> list[dict[str, Any]]:
    """The changes that make plan ``p`` (settings ``s``) fit: ``{change, fits, device_bytes,
    host_bytes}`` each, ``host_bytes`` per node. Only changes that re-plan to a fit are listed."""
    cuda = s["device"] == "cuda"
    device_side: list[dict[str, Any]] = []
    host_side: list[dict[str, Any]] = []
    both: list[dict[str, Any]] = []
    if s["delayed_update"]:
        both.append({"delayed_update": False})
    host_side += [{"moment_dtype": m} for m in ("bf16", "int8") if m != s["moment_dtype"]]
    if p.host_fits is False and (ranks := _smallest_world_size(s, evaluate)):
        host_side.append(ranks)
    if cuda and p.activation_bytes and not s["activation_checkpointing"]:
        device_side.append({"activation_checkpointing": True})
    if cuda and p.device_fits is False and p.activation_bytes and s["batch_size"] > 1:
        if (b := _largest_batch(s, evaluate)) is not None:
            device_side.append({"batch_size": b})
    plans = {id(o): evaluate(o) for o in device_side + host_side + both}
    fixes_device = [o for o in device_side + both if plans[id(o)].device_fits]
    if cuda and p.device_fits is False and not fixes_device:  # the weights alone: a larger GPU
        o = {"device_memory": math.ceil(p.device_bytes / GiB) * GiB}
        plans[id(o)] = evaluate(o)
        device_side.append(o)
        fixes_device.append(o)
    out = [_entry(_flags(o), plans[id(o)]) for o in device_side + host_side + both
           if plans[id(o)].fits]
    if not out:  # both memories short (or delayed update and the host): one change of each
        for d in fixes_device:
            for h in host_side:
                if (q := evaluate({**d, **h})).fits:
                    out.append(_entry(_flags({**d, **h}), q))
    return out


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GiB:.2f} GiB"


def render(p: Any) -> str:
    """The planner's text report of plan ``p``."""
    yes = {True: "yes", False: "NO", None: "unknown (give the memory sizes)"}
    lines = [f"lzo-plan: {p.params / 1e9:.3f}B parameters "
             f"({p.trainable_params / 1e9:.3f}B trained), {p.precision}, "
             f"world size {p.world_size}, compute device {p.device}"]
    if p.device == "cuda":
        lines.append(f"device bytes: {_gib(p.device_bytes)} of {_gib(p.device_memory)}")
        lines += [f"  {k:<26} {_gib(v)}" for k, v in p.device_breakdown.items()]
        if p.activation_bytes:
            lines[-1] += (" (layer inputs kept: --activation-checkpointing)"
                          if p.activation_checkpointing else " (no recomputation)")
    if p.accumulate:
        run = "the run accumulates gradients: --accumulate"
    elif p.host_bytes_accumulating == p.host_bytes_per_rank:
        run = "the same with --accumulate"
    else:
        run = f"with --accumulate: {_gib(p.host_bytes_accumulating)}"
    lines.append(f"host bytes per rank: {_gib(p.host_bytes_per_rank)} ({run}); "
                 f"per node {_gib(p.host_bytes_per_node)} of {_gib(p.host_memory)}")
    lines += [f"  {k:<26} {_gib(v)}" for k, v in p.host_breakdown.items()]
    lines.append(f"fits: {yes[p.fits]}")
    lines += [f"  {s['resource']} memory is short: {_gib(s['needed'])} needed"
              f"{' per node' if s['resource'] == 'host' else ''}, {_gib(s['available'])} "
              "available" for s in p.short]
    if p.fits is False:
        lines.append("changes that fit:" if p.suggestions else
                     "changes that fit: none among moment dtype, ranks, activation "
                     "checkpointing, delayed update, batch size")
        lines += [f"  {e['change']}: device {_gib(e['device_bytes'])}, "
                  f"host {_gib(e['host_bytes'])} per node" for e in p.suggestions]
    if p.max_params_blocked_by == "activations":
        lines.append(f"largest model that fits: none at batch {p.batch_size} x {p.seq_len}: "
                     f"activations are the limit (estimate {_gib(p.activation_bytes)}, device "
                     f"{_gib(p.device_memory)})")
        lines.append("  use " + ("" if p.activation_checkpointing else
                                 "--activation-checkpointing or ") +
                     "a smaller --batch-size / --seq-len")
    elif p.max_params_that_fit is not None:
        lines.append(f"largest model that fits: {p.max_params_that_fit / 1e9:.2f}B parameters "
                     "(same settings" + (", activations held at this batch and model)"
                                         if p.activation_bytes else ")"))
    rate = p.kernel_params_per_second
    if p.cpu_step_seconds is not None and rate is not None:
        lines.append(f"predicted CPU step: {p.cpu_step_seconds:.3f} s per optimizer step "
                     f"({rate / 1e9:.2f} G params/s measured here with {p.cpu_threads} threads)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
