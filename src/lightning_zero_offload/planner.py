"""Will it fit? Device and host bytes of a ZeRO-Offload run, before building anything.

``plan(7e9, precision="bf16-mixed", device_memory="24GiB", host_memory="128GiB")`` (or the
``lzo-plan`` command) counts what the engine allocates for a model of that many parameters, says
whether it fits, the largest model that would, and predicts the CPU step's time from a 0.2 s
measurement of the fused AdamW kernel on this host. When it does not fit it names the memory
that is short and the changes that fit (``planner_advice``), each re-planned here.

``P`` = trained parameters, ``F`` = frozen ones, ``W`` = data-parallel
ranks, ``S = P / W`` = this rank's shard, ``h`` = bytes per element of the compute dtype (2 for
``bf16-mixed``/``16-mixed``, 4 for ``32-true``):

host, per rank
    exactly what the engine budgets (``core.host.plan_counts`` and ``core.host.budget``, the
    functions ``ZeroOffload`` itself sizes with), over buckets of ``bucket_size_mb``: fp32
    master weights ``4 S`` and the moments ``exp_avg`` and ``exp_avg_sq`` (``moment_dtype``:
    fp32 ``8 S``, bf16 ``4 S``, int8 ``2 S`` plus an fp32 scale per 256 elements each); the
    fp32 gradient ``4 S`` (as ``plan_counts`` counts it for a run that accumulates,
    ``accumulate``, or not; ``host_bytes_accumulating`` is the accumulating figure); on a GPU the
    gradient staging ``h S`` and, in half precision, the kernel's weight output ``h S``, packed
    into power-of-two pinned blocks (CUDA's pinned allocator rounds every block up to a power of
    two; the fp32 master, pinned in ``32-true``, is rounded whole); with delayed update a second
    fp32 gradient and staging; the exact copies of frozen parameters ``4 F`` in half precision.
    With the CPU as compute device the "device" is the host: add the flat weights ``h P`` (twice
    with delayed update), the frozen ones in the compute dtype ``h F`` and one bucket buffer
    (two with several ranks).
device (CUDA)
    the weights ``h (P + F)`` (every rank holds all of them), a second copy ``h P`` with delayed
    update, three gradient buckets of ``bucket_size_mb`` (one filling while at most two are
    reduced and copied out: ``core.limits.MAX_IN_FLIGHT``) and, when ``batch_size``/
    ``seq_len`` and a model config are given, an activation estimate (batch ``b``, sequence
    ``s``, hidden size ``H``, ``a`` heads, ``L`` layers, vocabulary ``V``) for a decoder-only
    transformer without recomputation (Korthikanti et al. 2022, 16-bit:
    ``s b H (34 + 5 a s / H)`` bytes per layer, plus the logits ``s b V (h + 4)``; fused
    attention kernels drop most of the ``5 a s / H`` term). With ``activation_checkpointing``
    each of the ``L`` layers keeps only its input and one layer at a time is recomputed in
    full: ``L s b H h + s b H (34 + 5 a s / H) + s b V (h + 4)``. Not counted: the CUDA
    context (~0.5 GiB), allocator fragmentation, torch's workspace.

Parameter alignment pads every parameter to 16 elements (not counted: under 0.1% for real
models) and every bucket to ``16 W`` (counted). The largest model that fits keeps the batch, the
sequence and so the activation estimate; when activations alone leave no room it says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from lightning_zero_offload.planner_advice import render, short_resources, suggest
from lightning_zero_offload.planner_model import activation_bytes, model_info

__all__ = ["Plan", "plan", "parse_bytes", "model_info", "main"]

_ELEM = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
GiB = 2**30


def parse_bytes(value: int | float | str) -> int:
    """``24GiB``, ``24 GB``, ``2.5e10`` or a number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size: use e.g. 24GiB, 80GB or 2.5e10")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_count(value: int | float | str) -> int:
    """``7e9``, ``7B``, ``350M`` or an int: a parameter count."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(value))
    if not m:
        raise ValueError(f"cannot read {value!r} as a parameter count: use e.g. 7e9 or 7B")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


@dataclass
class Plan:
    """What ``plan`` found; every size in bytes, times in seconds."""

    params: int
    trainable_params: int
    precision: str
    world_size: int
    device: str
    device_bytes: int
    device_breakdown: dict[str, int]
    host_bytes_per_rank: int
    host_breakdown: dict[str, int]
    host_bytes_accumulating: int  # per rank, when the run accumulates gradients
    host_bytes_per_node: int
    device_memory: int | None
    host_memory: int | None
    fits: bool | None
    device_fits: bool | None
    host_fits: bool | None
    max_params_that_fit: int | None
    cpu_step_seconds: float | None
    kernel_params_per_second: float | None
    cpu_threads: int | None
    notes: list[str] = field(default_factory=list)
    batch_size: int | None = None
    seq_len: int | None = None
    activation_bytes: int = 0  # the device's activation estimate
    activation_checkpointing: bool = False
    accumulate: bool = False
    max_params_blocked_by: str | None = None  # "activations": no model fits at this batch
    short: list[dict[str, Any]] = field(default_factory=list)  # {resource, needed, available}
    suggestions: list[dict[str, Any]] = field(default_factory=list)  # planner_advice.suggest

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return render(self)


def _counts(trained: int, frozen: int, precision: str, world_size: int, device: str,
            bucket_bytes: int, delayed: bool, activations: int, moment_dtype: str = "fp32",
            accumulate: bool = False) -> tuple[dict, dict]:
    """(device breakdown, host breakdown) for these counts. The host side is the engine's own
    sizing (``core.host.plan_counts`` and ``budget``) over buckets of ``bucket_bytes``, for a
    run that accumulates gradients or not."""
    from lightning_zero_offload.core.config import PRECISIONS
    from lightning_zero_offload.core.host import budget, plan_counts
    from lightning_zero_offload.core.layout import shard_align
    from lightning_zero_offload.core.limits import MAX_IN_FLIGHT

    dtype, h = PRECISIONS[precision], _ELEM[precision]
    half, cpu = h != 4, device == "cpu"
    unit = shard_align(moment_dtype) * world_size  # buckets pad to this (as core.layout's)
    bucket = max(unit, bucket_bytes // h // unit * unit)
    full, rest = divmod(trained, bucket)
    rest = -(-rest // unit) * unit
    buckets = [bucket] * full + ([rest] if rest else [])
    shards = [b // world_size for b in buckets]
    sizes = plan_counts([sum(shards)], shards, dtype, asynchronous=not cpu, delayed=delayed,
                        pinned=not cpu,
                        moment_dtype=moment_dtype, accumulate=accumulate)
    host = budget(sizes, sum(buckets), max(buckets, default=0), dtype, cpu=cpu,
                  delayed=delayed, frozen_bytes=4 * frozen if half else 0,
                  untrained_bytes=h * frozen, buckets_in_flight=MAX_IN_FLIGHT + 1).parts
    dev: dict[str, int] = {}
    if not cpu:
        dev["weights"] = h * (trained + frozen)
        if delayed:
            dev["delayed: spare weights"] = h * trained
        dev[f"gradient buckets ({MAX_IN_FLIGHT + 1})"] = (MAX_IN_FLIGHT + 1) * min(
            bucket_bytes, h * trained)
        if activations:
            dev["activations (estimate)"] = activations
    return dev, {k: v for k, v in host.items() if v}


def measure_kernel(precision: str, threads: int, seconds: float = 0.2,
                   numel: int = 4 * 2**20, moment_dtype: str = "fp32") -> float:
    """Parameters per second of ``ops.fused_adamw_`` on this host (fp32 master, moments in
    ``moment_dtype``, the gradient and weight output in the compute dtype), timed for about
    ``seconds``."""
    import torch

    from lightning_zero_offload.core.config import PRECISIONS
    from lightning_zero_offload.ops import Moments, fused_adamw_

    dtype = PRECISIONS[precision]
    half = dtype != torch.float32
    p, mom = torch.randn(numel), Moments.zeros(numel, moment_dtype)
    g = torch.randn(numel).to(dtype)
    out = torch.empty(numel, dtype=dtype) if half else None
    def run(step: int) -> None:
        fused_adamw_(p, g, step=step, lr=1e-4, weight_decay=0.01, out=out,
                     num_threads=threads, **mom.kernel_args())

    run(1)  # build/load the kernel and touch every page
    steps, start = 0, time.perf_counter()
    while True:
        steps += 1
        run(steps + 1)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * numel / elapsed


def plan(params: int | float | str | None = None, *, model: str | os.PathLike | None = None,
         precision: str = "bf16-mixed", world_size: int = 1, ranks_per_node: int | None = None,
         device: str = "cuda", device_memory: int | str | None = None,
         host_memory: int | str | None = None, batch_size: int | None = None,
         seq_len: int | None = None, bucket_size_mb: float = 25.0, delayed_update: bool = False,
         frozen_params: int | float | str = 0, measure: bool = True,
         cpu_threads: int | None = None, moment_dtype: str = "fp32",
         activation_checkpointing: bool = False, accumulate: bool = False) -> Plan:
    """Memory and CPU-step prediction for training ``params`` parameters (or the local HF model
    ``model``) with ZeRO-Offload; see the module docstring for every term. ``host_memory`` is the
    machine's, shared by its ``ranks_per_node`` ranks (default: all ``world_size``).
    ``frozen_params`` of the total do not train (e.g. a LoRA base model). ``moment_dtype`` is
    ``ZeroOffloadConfig.moment_dtype`` (``"fp32"``, ``"bf16"`` or ``"int8"``).
    ``activation_checkpointing``: the model recomputes each layer in backward (smaller
    activation estimate). ``accumulate``: the run accumulates gradients over several backward
    passes, so its host figure is the accumulating one. When it does not fit, ``short`` names
    the memory that is short and ``suggestions`` the changes that fit, each re-planned."""
    if (params is None) == (model is None):
        raise ValueError("plan: give exactly one of params (a count) and model (a local folder "
                         "or config.json)")
    if precision not in _ELEM:
        raise ValueError(f"plan: precision={precision!r} is not supported; use one of "
                         f"{', '.join(map(repr, _ELEM))}")
    if moment_dtype not in ("fp32", "bf16", "int8"):
        raise ValueError(f"plan: moment_dtype={moment_dtype!r} is not supported; use one of "
                         "'fp32', 'bf16', 'int8'")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"plan: device must be 'cuda' or 'cpu', got {device!r}")
    for name, val in (("world_size", world_size), ("ranks_per_node", ranks_per_node),
                      ("batch_size", batch_size), ("seq_len", seq_len)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"plan: {name} must be an int >= 1, got {val!r}")
    if not bucket_size_mb > 0:
        raise ValueError(f"plan: bucket_size_mb must be > 0, got {bucket_size_mb!r}")
    info = model_info(model) if model is not None else {}
    total = _parse_count(params) if params is not None else int(info["params"])
    frozen = _parse_count(frozen_params)
    if total < 1 or not 0 <= frozen < total:
        raise ValueError(f"plan: need params >= 1 and 0 <= frozen_params < params, got "
                         f"{total} and {frozen}")
    st = dict(total=total, frozen=frozen, info=info, precision=precision,
              world_size=world_size, ranks_per_node=ranks_per_node, device=device,
              device_memory=parse_bytes(device_memory) if device_memory is not None else None,
              host_memory=parse_bytes(host_memory) if host_memory is not None else None,
              batch_size=batch_size, seq_len=seq_len, bucket=int(bucket_size_mb * 2**20),
              delayed_update=delayed_update, moment_dtype=moment_dtype,
              activation_checkpointing=activation_checkpointing, accumulate=accumulate)
    result = _evaluate(st, search=True)
    if (batch_size or seq_len) and not result.activation_bytes:
        result.notes.append("no activation estimate: it needs batch_size, seq_len and a model "
                            "config (--model) for the hidden size, layers and heads")
    if result.fits is False:
        result.short = short_resources(result)
        result.suggestions = suggest(result, st, lambda o: _evaluate({**st, **o}, search=False))
    if measure:
        import torch

        from lightning_zero_offload.core.threads import default_threads

        threads = cpu_threads or default_threads(world_size, torch.device(device),
                                                 delayed_update)
        rate = measure_kernel(precision, threads, moment_dtype=moment_dtype)
        result.cpu_threads, result.kernel_params_per_second = threads, rate
        result.cpu_step_seconds = -(-(total - frozen) // world_size) / rate
        result.notes.append("the CPU step prediction assumes this host trains the run, each "
                            f"rank with {threads} threads; a shared or busy machine measures "
                            "slower")
    return result


def _evaluate(st: dict[str, Any], search: bool) -> Plan:
    """The plan for settings ``st`` (``plan``'s, resolved), and with ``search`` the largest model
    that fits with the same settings and the same activation estimate."""
    total, frozen, device = st["total"], st["frozen"], st["device"]
    dev_mem, host_mem = st["device_memory"], st["host_memory"]
    ranks = st["ranks_per_node"] or st["world_size"]
    acts = activation_bytes(st["info"], st["batch_size"], st["seq_len"], st["precision"],
                        st["activation_checkpointing"])

    def sizes(n_trained: int, n_frozen: int, accumulate: bool, a: int) -> tuple[dict, dict]:
        return _counts(n_trained, n_frozen, st["precision"], st["world_size"], device,
                       st["bucket"], st["delayed_update"], a, st["moment_dtype"], accumulate)

    def fit(d: int, hb: int) -> tuple[bool | None, bool | None]:
        dfit = (True if host_mem is not None else None) if device == "cpu" else (
            None if dev_mem is None else d <= dev_mem)
        return dfit, None if host_mem is None else hb * ranks <= host_mem

    dev, host = sizes(total - frozen, frozen, st["accumulate"], acts)
    dev_bytes, host_bytes = sum(dev.values()), sum(host.values())
    host_acc = host_bytes if st["accumulate"] else sum(
        sizes(total - frozen, frozen, True, acts)[1].values())
    device_fits, host_fits = fit(dev_bytes, host_bytes)
    fits = None if None in (device_fits, host_fits) else bool(device_fits and host_fits)
    notes = []
    if fits and not st["accumulate"] and host_acc * ranks > host_mem:
        notes.append(f"with --accumulate (an fp32 host gradient) it would not fit: "
                     f"{host_acc * ranks / GiB:.2f} GiB per node")
    largest = blocked = None
    if search and fits is not None:  # bytes grow with the model: bisect on the total
        share = frozen / total  # (same frozen share; batch, sequence and activations held)

        def ok(n: int, a: int = acts) -> bool:
            nf = int(n * share)
            d, hb = sizes(n - nf, nf, st["accumulate"], a)
            return all(fit(sum(d.values()), sum(hb.values())))

        lo, hi = 0, 1
        while ok(hi) and hi < 10**15:
            lo, hi = hi, hi * 2
        while hi - lo > max(1, lo // 10**4):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        largest = lo
        if lo == 0 and acts and ok(1, 0):  # a tiny model fits but for the activations
            largest, blocked = None, "activations"
    return Plan(total, total - frozen, st["precision"], st["world_size"], device, dev_bytes,
                dev, host_bytes, host, host_acc, host_bytes * ranks, dev_mem, host_mem, fits,
                device_fits, host_fits, largest, None, None, None, notes,
                batch_size=st["batch_size"], seq_len=st["seq_len"], activation_bytes=acts,
                activation_checkpointing=st["activation_checkpointing"],
                accumulate=st["accumulate"], max_params_blocked_by=blocked)


def main(argv: list[str] | None = None) -> int:
    """The ``lzo-plan`` command."""
    p = argparse.ArgumentParser(prog="lzo-plan", description="Will a ZeRO-Offload run fit? "
                                "Device and host bytes, the largest model that fits, and the "
                                "CPU step time predicted from this host's kernel speed.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count: 7e9, 7B, 350M")
    src.add_argument("--model", help="local HF model folder or its config.json")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(_ELEM))
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, help="default: --world-size (one machine)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="compute device (cpu: everything is host memory)")
    p.add_argument("--device-memory", help="per device, e.g. 24GiB")
    p.add_argument("--host-memory", help="per machine, e.g. 128GiB")
    p.add_argument("--batch-size", type=int, help="per device, for the activation estimate")
    p.add_argument("--seq-len", type=int, help="for the activation estimate")
    p.add_argument("--bucket-size-mb", type=float, default=25.0)
    p.add_argument("--delayed-update", action="store_true")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="the model recomputes each layer in backward (keeps only layer inputs)")
    p.add_argument("--accumulate", action="store_true",
                   help="the run accumulates gradients (accumulate_grad_batches > 1)")
    p.add_argument("--moment-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="how the host keeps the Adam moments (ZeroOffloadConfig.moment_dtype)")
    p.add_argument("--frozen-params", default="0", help="parameters that do not train")
    p.add_argument("--no-measure", action="store_true", help="skip the 0.2 s kernel timing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        result = plan(a.params, model=a.model, precision=a.precision, world_size=a.world_size,
                      ranks_per_node=a.ranks_per_node, device=a.device,
                      device_memory=a.device_memory, host_memory=a.host_memory,
                      batch_size=a.batch_size, seq_len=a.seq_len, bucket_size_mb=a.bucket_size_mb,
                      delayed_update=a.delayed_update, frozen_params=a.frozen_params,
                      measure=not a.no_measure, moment_dtype=a.moment_dtype,
                      activation_checkpointing=a.activation_checkpointing,
                      accumulate=a.accumulate)
    except (ValueError, OSError, ImportError) as e:
        p.error(str(e))
    print(json.dumps(result.to_dict()) if a.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
