"""The planner's text report (what ``lzo-plan`` prints and ``str(plan(...))`` gives). Sizes are
printed in the unit that shows them (``_units.format_bytes``)."""

from __future__ import annotations

from typing import Any

from lightning_zero_offload._units import format_bytes
from lightning_zero_offload.planner.counts import UNIT_GRAD
from lightning_zero_offload.planner.inputs import MAX_PARAMS


def _size(b: int | None) -> str:
    return "-" if b is None else format_bytes(b)


def _activation_terms(p: Any) -> str:
    kept = ("layer inputs kept: --activation-checkpointing" if p.activation_checkpointing
            else "no recomputation")
    attention = ("eager attention: keeps batch x heads x seq^2 scores" if p.attention == "eager"
                 else "memory-efficient attention: no seq^2 scores")
    return f" ({kept}; {attention})"


def _activation_fixes(p: Any) -> str:
    fixes = [] if p.activation_checkpointing else ["--activation-checkpointing"]
    fixes += ["--attention memory-efficient"] if p.attention == "eager" else []
    return ", ".join(fixes) + (" or " if fixes else "") + "a smaller --batch-size / --seq-len"


def _split(p: Any) -> list[str]:
    """The offload fraction: asked or resolved, what stays on the device, "auto"'s next move."""
    if p.offload_weights:
        return [f"offload fraction: {p.offload_fraction:.3f} (--offload-weights: the weights "
                "and all of the optimizer state on the host, stepped there in place)"]
    f, within = p.offload_fraction, f"{1 - p.device_memory_headroom:.0%}"
    on_device = ("all of the optimizer state on the host" if f == 1.0 else
                 f"{1 - f:.1%} of the optimizer state on the device "
                 f"({_size(p.device_optimizer_bytes)}: the buckets of the first layers)")
    t = p.auto_tried
    if t is not None:  # nothing fits: what auto tried, and which memory is short by how much
        short = [f"the device needs {_size(t['device_bytes'])} of the "
                 f"{_size(t['device_limit'])} it may use (within {within}: "
                 f"--device-memory-headroom), short by "
                 f"{_size(t['device_bytes'] - t['device_limit'])}"
                 if t["device_limit"] is not None and t["device_bytes"] > t["device_limit"]
                 else "", f"the host needs {_size(t['host_bytes_per_node'])} per node of "
                 f"{_size(t['host_usable'])}, short by "
                 f"{_size(t['host_bytes_per_node'] - t['host_usable'])}"
                 if t["host_usable"] is not None and t["host_bytes_per_node"] > t["host_usable"]
                 else ""]
        how = ("all of the optimizer state on the device: the host is short even so"
               if short[1] else "the fewest device buckets whose host part fits")
        return [f"offload fraction: no split fits both memories (auto tried "
                f"{t['offload_fraction']:.3f}, {how}: {'; '.join(x for x in short if x)}); "
                "the figures above are all-host"]
    if p.offload_fraction_setting != "auto":
        return [f"offload fraction: {f:.3f} (--offload-fraction "
                f"{p.offload_fraction_setting:g}): {on_device}"]
    how = (on_device if f == 1.0 else "the host holds what fits; "
           f"{on_device}, within {within} of its memory: --device-memory-headroom")
    lines = [f"offload fraction: {f:.3f} (auto: {how})"]
    after = p.offload_fraction_after_first_step
    if after is not None and after < f:
        lines.append(f"  after the first step \"auto\" moves more onto the device while it "
                     f"stays within {within} of its memory: about {after:.3f}" +
                     ("" if p.activation_bytes else
                      " (activations not counted here: the first step's measured peak decides)"))
    return lines


def _checkpoints(p: Any) -> str:
    """What a checkpoint needs beside the run: nothing blocking, a copy asynchronous."""
    said = {True: "fits beside the run", False: "does NOT fit beside the run: it saves blocking",
            None: "give --host-memory to check"}
    fits = p.async_copy_fits
    return ("checkpoints: a blocking save or load holds no copy of the state; an asynchronous "
            f"save (async_checkpoint=True) copies it: sharded {_size(p.async_copy_sharded)} "
            f"per rank ({said[fits.get('sharded')]}), consolidated "
            f"{_size(p.async_copy_consolidated)} on rank 0 ({said[fits.get('consolidated')]})")


def _ranks(p: Any) -> str:
    """How the ranks cut the model, where more than data parallelism does."""
    cut = ([f"tensor parallel {p.tensor_parallel_size} x data parallel "
            f"{p.data_parallel_size}"] if p.tensor_parallel_size > 1 else [])
    cut += ["weights sharded by FSDP2"] if p.fsdp else []
    return f" ({', '.join(cut)})" if cut else ""


def _fsdp(p: Any) -> list[str]:
    """Under FSDP2: the device bytes by owner, and what the all-gather term assumes."""
    if not p.fsdp or p.device != "cuda":
        return []
    weights = ("none (FSDP2's shards are on the host: --offload-weights)" if p.offload_weights
               else f"{_size(p.device_weight_bytes)} (1/"
               f"{p.data_parallel_size * p.tensor_parallel_size} per rank)")
    return [f"  by owner: the model's weights {weights}, FSDP2's all-gather "
            f"{_size(p.fsdp_all_gather_bytes)} (2 units in flight of "
            f"{p.fsdp_unit_params / 1e9:.3f}B parameters: --fsdp-unit-params), the engine "
            f"{_size(p.device_engine_bytes)}"]


def _per_parameter(p: Any) -> list[str]:
    """--offload-weights: the host bytes per trained parameter of the rank's shard, by term."""
    if not p.offload_weights:
        return []
    b, n = p.host_breakdown, -(-p.trainable_params // p.world_size)
    terms = {"the weights = the fp32 master": b.get("master", 0),
             "the optimizer state": b.get("moments", 0),
             "the gradient": b.get("staging", 0) + b.get("grad_fp32", 0),
             "FSDP2's unit gradient": b.get(UNIT_GRAD, 0)}
    return [f"  per trained parameter of the rank's shard: {sum(terms.values()) / n:.2f} bytes ("
            + ", ".join(f"{k} {v / n:.2f}" for k, v in terms.items()) + ")"]


def _bound(p: Any) -> list[str]:
    """--offload-weights: which memory bounds the largest model, and what the device holds."""
    if not p.offload_weights or p.max_params_bound is None:
        return []
    held = (f"FSDP2's 2 units in flight ({p.fsdp_unit_params / p.params:.1%} of the model "
            "each: --fsdp-unit-params)" + (", the gradient buckets and the activations"
                                           if p.activation_bytes else
                                           " and the gradient buckets"))
    alone = p.max_params_device_alone
    if p.max_params_bound != "host":
        return [f"  bounded by {p.max_params_bound} memory: the device holds {held}"]
    return ["  bounded by host memory" + ("" if alone is None else
            f"; the device holds no weights, only {held}: alone it would hold "
            f"{alone / 1e9:.2f}B" + (" or more" if alone >= MAX_PARAMS else ""))]


def render(p: Any) -> str:
    """The planner's text report of plan ``p``."""
    yes = {True: "yes", False: "NO", None: "unknown (give the memory sizes)"}
    lines = [f"lzo-plan: {p.params / 1e9:.3f}B parameters "
             f"({p.trainable_params / 1e9:.3f}B trained), {p.precision}, "
             f"world size {p.world_size}{_ranks(p)}, compute device {p.device}, optimizer "
             f"{p.optimizer}"]
    if p.device == "cuda":
        lines.append(f"device bytes: {_size(p.device_bytes)} of {_size(p.device_memory)}")
        lines += [f"  {k:<26} {_size(v)}" for k, v in p.device_breakdown.items()]
        if p.activation_bytes:
            lines[-1] += _activation_terms(p)
        lines += _fsdp(p)
    if p.accumulate:
        run = "the run accumulates gradients: --accumulate"
    elif p.host_bytes_accumulating == p.host_bytes_per_rank:
        run = "the same with --accumulate"
    else:
        run = f"with --accumulate: {_size(p.host_bytes_accumulating)}"
    lines.append(f"host bytes per rank: {_size(p.host_bytes_per_rank)} ({run}); "
                 f"per node {_size(p.host_bytes_per_node)} of {_size(p.host_usable)}" +
                 ("" if p.host_memory is None else
                  f" ({_size(p.host_memory)} less a {_size(p.host_reserve)} reserve for the "
                  "OS, Python and data loaders: --host-reserve)"))
    lines += [f"  {k:<26} {_size(v)}" for k, v in p.host_breakdown.items()]
    lines += _per_parameter(p)
    if p.device == "cuda":
        lines += _split(p)
    lines.append(f"fits: {yes[p.fits]}")
    lines += [f"  {s['resource']} memory is short: {_size(s['needed'])} needed"
              f"{' per node' if s['resource'] == 'host' else ''}, {_size(s['available'])} "
              f"available{' (after the reserve)' if s['resource'] == 'host' else ''}"
              for s in p.short]
    if p.fits is False:
        lines.append("changes that fit:" if p.suggestions else
                     "changes that fit: none among offload fraction, moment dtype, ranks, "
                     "activation checkpointing, attention, delayed update, batch size, "
                     "sequence length")
        for e in p.suggestions:  # the flags to paste, then why
            free = e["device_headroom_bytes"]
            lines.append(f"  {e['change']}: device {_size(e['device_bytes'])}" +
                         ("" if free is None else f" ({_size(free)} of it free)") +
                         f", host {_size(e['host_bytes'])} per node")
            lines.append(f"    {e['reason']}")
    if p.max_params_blocked_by == "activations":
        lines.append(f"largest model that fits: none at batch {p.batch_size} x {p.seq_len}: "
                     f"activations are the limit (estimate {_size(p.activation_bytes)}, device "
                     f"{_size(p.device_memory)})")
        lines.append("  use " + _activation_fixes(p))
    elif p.max_params_that_fit is not None:
        lines.append(f"largest model that fits: {p.max_params_that_fit / 1e9:.2f}B parameters "
                     "(same settings" + (", activations held at this batch and model)"
                                         if p.activation_bytes else "; activations not counted)"))
        lines += _bound(p)
    lines.append(_checkpoints(p))
    rate = p.kernel_params_per_second
    if p.cpu_step_seconds is not None and rate is not None:
        lines.append(f"predicted CPU step: {p.cpu_step_seconds:.3f} s per optimizer step "
                     f"({rate / 1e9:.2f} G params/s measured here with {p.cpu_threads} threads"
                     + (")" if p.offload_fraction == 1.0 else
                        f"; the host part, {p.offload_fraction:.1%} of the state)"))
    if p.device_step_elements:
        when = ("not measured: this machine has no CUDA device" if p.device_step_seconds is None
                else f"{p.device_step_seconds:.3f} s measured on this machine's device")
        lines.append(f"device part's step: {p.device_step_elements / 1e9:.2f}B elements per "
                     f"rank, {_size(p.device_step_bytes)} of device memory traffic per "
                     f"optimizer step (torch's fused AdamW, memory-bound; {when})")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
