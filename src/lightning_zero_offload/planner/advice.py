"""What to change when a run does not fit.

``lzo-plan`` answering "fits: NO" is only useful with the resource that is short and the changes
that would make it fit. Every change listed here was re-planned with the planner's own counting
(the ``evaluate`` callable ``plan`` passes in) and fits as a whole; its figures are that plan's.

The pool's own settings are searched first (the largest fixed offload fraction that fits, a
smaller ``device_memory_headroom`` under ``"auto"``, a smaller host reserve), then the moment
dtype, then other hardware (more ranks, a larger device). Device and host bytes depend on
different settings (the device on the weights and the activations; the host on
``moment_dtype`` and the ranks; delayed update and the offload fraction on both), so when both
are short a fitting change is one device-side change plus one host-side change (pairs are tried
only when no single change fits). When the weights fit the device and the activations do not,
the device-side changes are what reduce activations: activation checkpointing, memory-efficient
attention, a smaller batch (the largest that fits) and, only when batch 1 does not fit either,
a shorter sequence; a larger device is offered only when the weights alone do not fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

GiB = 2**30

Evaluate = Callable[[dict[str, Any]], Any]  # settings overrides -> a Plan (no advice, no search)


def short_resources(p: Any) -> list[dict[str, Any]]:
    """``[{"resource", "needed", "available"}]`` for each memory that is too small (bytes; the
    host figures are per node: what the run needs and ``host_memory`` less the reserve)."""
    out = []
    if p.device_fits is False:
        out.append({"resource": "device", "needed": p.device_bytes,
                    "available": p.device_memory})
    if p.host_fits is False:
        out.append({"resource": "host", "needed": p.host_bytes_per_node,
                    "available": p.host_usable})
    return out


def _entry(o: dict[str, Any], q: Any) -> dict[str, Any]:
    """A suggestion: ``change``, only ``lzo-plan`` flags (pasted after the command's own, they
    plan ``q``); ``reason``, what it does, in words; its plan's figures, and the device memory
    it leaves free (None without a device size)."""
    free = None if q.device_memory is None or q.device != "cuda" else (
        q.device_memory - q.device_bytes)
    return {"change": _flags(o), "reason": _reasons(o, q), "fits": bool(q.fits),
            "device_bytes": q.device_bytes, "host_bytes": q.host_bytes_per_node,
            "device_headroom_bytes": free}


def _smallest_world_size(s: dict[str, Any], evaluate: Evaluate) -> dict[str, Any] | None:
    """The fewest ranks (as many per node as now: more machines) whose host share fits: more
    data-parallel ranks, each as many tensor-parallel ones as now."""
    tp, per_node = s["tensor_parallel"], s["ranks_per_node"] or s["world_size"]

    def ok(dp: int) -> bool:
        return bool(evaluate({"world_size": dp * tp, "ranks_per_node": per_node}).host_fits)

    lo = s["world_size"] // tp
    hi = lo + 1  # ok(lo) is False (the host is short now)
    while not ok(hi):
        if hi * tp >= 4096:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return {"world_size": hi * tp, "ranks_per_node": per_node}


def _largest(key: str, base: dict[str, Any], s: dict[str, Any],
             evaluate: Evaluate) -> int | None:
    """The largest ``key`` (batch size or sequence length) below the given one whose device
    bytes fit with the changes ``base`` (activations grow with it); None if 1 does not."""
    def ok(v: int) -> bool:
        return bool(evaluate({**base, key: v}).device_fits)

    if s[key] <= 1 or not ok(1):
        return None
    lo, hi = 1, s[key]  # ok(hi) is False (the device is short with these changes)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _largest_step(hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest ``i`` in ``[0, hi]`` with ``ok(i)`` (``ok`` true below some point)."""
    if not ok(0):
        return None
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _fraction(s: dict[str, Any], evaluate: Evaluate) -> dict[str, Any] | None:
    """The largest fixed offload fraction (two, else three decimals) that fits both memories: a
    fixed fraction may use the whole device, where ``"auto"`` keeps the headroom free (the
    plan then notes what it leaves). Host bytes fall with the fraction, device bytes rise."""
    for scale in (100, 1000):
        top = _largest_step(scale, lambda i, scale=scale: evaluate(
            {"offload_fraction": i / scale}).host_fits is not False)
        if top is None:
            return None
        f = top / scale
        if f != s["offload_fraction"] and evaluate({"offload_fraction": f}).fits:
            return {"offload_fraction": f}
    return None


def _headroom(s: dict[str, Any], evaluate: Evaluate) -> dict[str, Any] | None:
    """Under ``"auto"``: the largest smaller ``device_memory_headroom`` (two decimals) that fits."""
    below = math.ceil(s["headroom"] * 100) - 1
    if s["offload_fraction"] != "auto" or below < 0:
        return None
    best = _largest_step(below, lambda i: not evaluate(
        {"headroom": (below - i) / 100}).fits)  # the most headroom kept: first that fits - 1
    h = (below - best - 1) / 100 if best is not None else below / 100
    return {"headroom": h} if h >= 0 and evaluate({"headroom": h}).fits else None


def _reserve(s: dict[str, Any], evaluate: Evaluate) -> dict[str, Any] | None:
    """The largest smaller host reserve (whole GiB) that fits."""
    have = s["host_reserve"] // GiB
    if s["host_memory"] is None or s["host_reserve"] == 0:
        return None
    top = _largest_step(have, lambda i: not evaluate({"host_reserve": (have - i) * GiB}).fits)
    r = (have - top - 1) if top is not None else have
    return {"host_reserve": r * GiB} if r >= 0 and evaluate(
        {"host_reserve": r * GiB}).fits else None


def _activation_changes(s: dict[str, Any], evaluate: Evaluate) -> list[dict[str, Any]]:
    """Changes that reduce the activations until the device fits: checkpointing and
    memory-efficient attention (alone, then together), each at the given batch or else the
    largest batch that fits; only when none fits, batch 1 and the longest sequence that fits.
    A change is left out when a part of it fits already."""
    mods: list[dict[str, Any]] = [{}]
    if not s["activation_checkpointing"]:
        mods.append({"activation_checkpointing": True})
    if s["attention"] == "eager":
        mods.append({"attention": "memory-efficient"})
    if len(mods) == 3:
        mods.append({**mods[1], **mods[2]})
    found: list[dict[str, Any]] = []
    for m in mods:
        if any(f.items() <= m.items() for f in found):
            continue
        if m and evaluate(m).device_fits:
            found.append(m)
        elif (b := _largest("batch_size", m, s, evaluate)) is not None:
            found.append({**m, "batch_size": b})
    if not found:
        for m in mods:
            one = {**m, "batch_size": 1} if s["batch_size"] > 1 else m
            if (q := _largest("seq_len", one, s, evaluate)) is not None:
                found.append({**one, "seq_len": q})
                break
    return found


def _pool(s: dict[str, Any], evaluate: Evaluate, cuda: bool) -> list[dict[str, Any]]:
    """The pool settings that fit: fraction, headroom (on a GPU, not with --offload-weights,
    where all of the state is on the host), host reserve."""
    split = cuda and not s.get("offload_weights")
    return [o for o in (_fraction(s, evaluate) if split else None,
                        _headroom(s, evaluate) if split else None, _reserve(s, evaluate))
            if o is not None]


def _flags(o: dict[str, Any]) -> str:
    """The ``lzo-plan`` flags of changes ``o``, ``" + "`` between changes."""
    parts = []
    for key, value in o.items():
        if key == "offload_fraction":
            parts.append(f"--offload-fraction {value:g}")
        elif key == "moment_dtype":
            parts.append(f"--moment-dtype {value}")
        elif key == "world_size":
            parts.append(f"--world-size {value} --ranks-per-node {o['ranks_per_node']}")
        elif key == "activation_checkpointing":
            parts.append("--activation-checkpointing")
        elif key == "attention":
            parts.append(f"--attention {value}")
        elif key == "delayed_update":
            parts.append("--no-delayed-update")
        elif key == "batch_size":
            parts.append(f"--batch-size {value}")
        elif key == "seq_len":
            parts.append(f"--seq-len {value}")
        elif key == "device_memory":
            parts.append(f"--device-memory {value // GiB}GiB")
        elif key == "headroom":
            parts.append(f"--device-memory-headroom {value:g}")
        elif key == "host_reserve":
            parts.append(f"--host-reserve {value // GiB}GiB")
    return " + ".join(parts)


_WHY = {
    "offload_fraction": "the largest share of the optimizer state on the host that fits both "
                        "memories, the rest (whole buckets) on the device",
    "moment_dtype": "the optimizer's moments kept in {value} on the host",
    "world_size": "more machines, as many ranks on each: a rank's host shard shrinks as 1/N",
    "activation_checkpointing": "each layer recomputed in backward: only layer inputs kept",
    "attention": "SDPA/flash kernels: no seq^2 attention scores kept",
    "delayed_update": "no second device copy of the weights, no second host gradient",
    "batch_size": "the largest batch that fits",
    "seq_len": "the longest sequence that fits (at batch 1)",
    "device_memory": "a larger device",
    "headroom": "less of the device kept free by \"auto\"",
    "host_reserve": "less host memory kept for the OS, Python and data loaders",
}


def _reasons(o: dict[str, Any], q: Any) -> str:
    """What changes ``o`` do, in words (``"; "`` between them), and where plan ``q`` leaves
    less than the headroom free on the device, that the engine warns of it."""
    why = [_WHY[k].format(value=v) for k, v in o.items() if k in _WHY]
    if any("the engine warns at setup" in n for n in q.notes):
        why.append(f"leaves less than --device-memory-headroom {q.device_memory_headroom:g} "
                   "of the device free: the engine warns at setup")
    return "; ".join(why)


def suggest(p: Any, s: dict[str, Any], evaluate: Evaluate) -> list[dict[str, Any]]:
    """The changes that make plan ``p`` (settings ``s``) fit: ``{change, reason, fits,
    device_bytes, host_bytes, device_headroom_bytes}`` each (``_entry``), ``host_bytes`` per
    node. Only changes that re-plan to a fit are listed."""
    cuda = s["device"] == "cuda"
    device_side: list[dict[str, Any]] = []
    host_side: list[dict[str, Any]] = []
    both: list[dict[str, Any]] = []
    # The pool's own settings first: each keeps the model, the machine and the batch; then
    # another moment dtype, alone or, where alone it does not fit, with a pool setting.
    pool = _pool(s, evaluate, cuda)
    if s["delayed_update"]:
        both.append({"delayed_update": False})
    for m in ("bf16", "int8"):
        if m != s["moment_dtype"]:
            host_side.append({"moment_dtype": m})
            if not evaluate({"moment_dtype": m}).fits:
                host_side += [{"moment_dtype": m, **o} for o in _pool(
                    {**s, "moment_dtype": m},
                    lambda o, m=m: evaluate({"moment_dtype": m, **o}), cuda)]
    if p.host_fits is False and (ranks := _smallest_world_size(s, evaluate)):
        host_side.append(ranks)
    weights_fit = p.device_memory is not None and (
        p.device_bytes - p.activation_bytes <= p.device_memory)
    if cuda and p.activation_bytes and p.device_fits is False and weights_fit:
        device_side += _activation_changes(s, evaluate)
    plans = {id(o): evaluate(o) for o in pool + host_side + device_side + both}
    fixes_device = [o for o in device_side + both if plans[id(o)].device_fits]
    if cuda and p.device_fits is False and not weights_fit:  # the weights alone: a larger GPU
        o = {"device_memory": math.ceil(p.device_bytes / GiB) * GiB}
        plans[id(o)] = evaluate(o)
        device_side.append(o)
        fixes_device.append(o)
    out = [_entry(o, plans[id(o)]) for o in pool + host_side + device_side + both
           if plans[id(o)].fits]
    if not out:  # both memories short (or delayed update and the host): one change of each
        for d in fixes_device:
            for h in host_side:
                if (q := evaluate({**d, **h})).fits:
                    out.append(_entry({**d, **h}, q))
    return out
