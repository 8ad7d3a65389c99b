"""The planner's figures: device and host bytes of a run (``plan``), whether they fit, the
largest model that would, and the CPU step predicted from the kernel's speed on this host. The
terms are in the package's docstring (``lightning_zero_offload.planner``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from lightning_zero_offload._units import format_bytes
from lightning_zero_offload.core.buckets import device_budget
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.core.rules.rules import RULES, rule_named
from lightning_zero_offload.planner import counts, inputs, speed, split
from lightning_zero_offload.planner.advice import short_resources, suggest
from lightning_zero_offload.planner.largest import largest as find_largest
from lightning_zero_offload.planner.model import ATTENTION, activation_bytes, model_info

_ELEM = inputs.ELEM
MOMENT_DTYPES = inputs.MOMENT_DTYPES
DEFAULT_HOST_RESERVE = inputs.DEFAULT_HOST_RESERVE


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
    suggestions: list[dict[str, Any]] = field(default_factory=list)  # advice.suggest
    host_reserve: int = 0  # of host_memory, kept for the OS, Python and data loaders
    attention: str = "eager"  # what the activation estimate assumes
    offload_fraction: float = 1.0  # resolved: host elements / all trained elements (split)
    offload_fraction_setting: float | str = split.AUTO  # what was asked
    device_memory_headroom: float = split.DEFAULT_HEADROOM
    device_optimizer_bytes: int = 0  # device-resident optimizer state and gradients
    offload_fraction_after_first_step: float | None = None  # "auto" once the peak is measured
    # an asynchronous save's copy of the state (a blocking one holds none): per rank for a
    # sharded save, on rank 0 for a consolidated one; whether each fits beside the run
    async_copy_sharded: int = 0
    async_copy_consolidated: int = 0
    async_copy_fits: dict[str, bool | None] = field(default_factory=dict)
    # "auto" with no split that fits: the closest it tried (``_tried``), else None
    auto_tried: dict[str, Any] | None = None
    # the device part's step (torch's fused AdamW): elements per rank, memory traffic, and the
    # time measured where this machine has CUDA (else None)
    device_step_elements: int = 0
    device_step_bytes: int = 0
    device_step_seconds: float | None = None
    optimizer: str = "adamw"  # the update rule planned for (core.rules.rules)
    # how the ranks cut the model (``counts.Ranks``): world_size = data x tensor parallel; with
    # fsdp FSDP2 shards the weights over the data-parallel ranks, fsdp_unit_params its largest
    # unit; the device bytes by owner: the model's weights (sharded with fsdp), FSDP2's units in
    # flight, and the engine's own (gradient ring, spare weights, the device part's state)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    fsdp: bool = False
    fsdp_unit_params: int | None = None
    device_weight_bytes: int = 0
    fsdp_all_gather_bytes: int = 0
    device_engine_bytes: int = 0
    # --offload-weights: FSDP2 keeps the shards on the host, the engine's master (counts.
    # host_resident); the largest model's bound ("device", "host", "device and host"; None at
    # the planner's limit) and, where the host bounds it, the largest the device alone holds
    offload_weights: bool = False
    max_params_bound: str | None = None
    max_params_device_alone: int | None = None

    @property
    def host_usable(self) -> int | None:
        """Host memory per node the run may take: ``host_memory`` less ``host_reserve``."""
        return None if self.host_memory is None else self.host_memory - self.host_reserve

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        from lightning_zero_offload.planner.report import render

        return render(self)


def plan(params: int | float | str | None = None, *, model: str | os.PathLike | None = None,
         precision: str = "bf16-mixed", world_size: int = 1, ranks_per_node: int | None = None,
         device: str = "cuda", device_memory: int | str | None = None,
         host_memory: int | str | None = None,
         host_reserve: int | float | str = DEFAULT_HOST_RESERVE, batch_size: int | None = None,
         seq_len: int | None = None,
         bucket_size_mb: float = 25.0, delayed_update: bool = False,
         frozen_params: int | float | str = 0, measure: bool = True,
         cpu_threads: int | None = None, moment_dtype: str = "fp32",
         activation_checkpointing: bool = False, attention: str = "eager",
         accumulate: bool = False, offload_fraction: float | str = split.AUTO,
         device_memory_headroom: float = split.DEFAULT_HEADROOM, optimizer: str = "adamw",
         optimizer_options: dict | None = None, tensor_parallel_size: int = 1,
         fsdp: bool = False, fsdp_unit_params: int | float | str | None = None,
         offload_weights: bool = False) -> Plan:
    """Memory and CPU-step prediction for training ``params`` parameters (or the local HF model
    ``model``) with ZeRO-Offload; see the package docstring for every term. ``host_memory`` is
    the machine's, shared by its ``ranks_per_node`` ranks (default: all ``world_size``), less
    ``host_reserve`` (``"10%"`` of it or a size such as ``"8GiB"``) kept for the OS, Python and
    data loaders: "fits" and the largest model use what is left. ``frozen_params`` of the total
    do not train (e.g. a LoRA base model). ``moment_dtype`` is
    ``ZeroOffloadConfig.moment_dtype``. ``activation_checkpointing``: the model recomputes each
    layer in backward. ``attention``: what the activation estimate assumes, ``"eager"`` (the
    ``seq x seq`` scores are kept) or ``"memory-efficient"`` (SDPA/flash kernels keep none).
    ``accumulate``: the run accumulates gradients over several backward passes, so its host
    figure is the accumulating one. ``optimizer``: the update rule's key (``"adamw"``:
    Adam/AdamW, ``"lion"``, any of ``core.rules.rules.RULES``), whose state the host keeps, for an
    optimizer made with ``optimizer_options`` (those that shape its state). ``offload_fraction``
    (a number in [0, 1] or ``"auto"``) and ``device_memory_headroom`` are
    ``ZeroOffloadConfig``'s: the share of the optimizer state on the host (the rest, whole
    buckets, on the device; ``split``), and for ``"auto"`` the share of the device left free: it
    resolves to the largest fraction whose host part fits the host and whose device part fits
    within ``1 - device_memory_headroom`` of the device (1.0 when the host holds it all). When it
    does not fit, ``short`` names the memory that is short and ``suggestions`` the changes that
    fit, each re-planned. ``world_size`` ranks are ``tensor_parallel_size`` x data-parallel
    ranks; ``fsdp``: FSDP2 (``fully_shard``) shards the weights over the data-parallel ranks, its
    largest unit ``fsdp_unit_params`` (default: one layer of a ``model``, else 1/32 of the
    parameters; ``counts``); ``offload_weights`` (with ``fsdp``, on a GPU): FSDP2's
    ``CPUOffloadPolicy`` keeps the shards on the host, the engine's master, all of the state on
    the host (``counts.host_resident``). A bad argument raises ``ValueError`` (``TypeError`` for
    a wrong type) naming it."""
    if (params is None) == (model is None):
        raise ValueError("plan: give exactly one of params (a count) and model (a local folder "
                         "or config.json)")
    inputs.choice(precision, "precision", tuple(_ELEM))
    inputs.choice(moment_dtype, "moment_dtype", MOMENT_DTYPES)
    inputs.choice(optimizer, "optimizer", tuple(r.KEY for r in RULES))
    rule = rule_named(optimizer, **(optimizer_options or {}))
    inputs.choice(device, "device", ("cuda", "cpu"))
    inputs.choice(attention, "attention", ATTENTION)
    for name, val in (("world_size", world_size), ("ranks_per_node", ranks_per_node),
                      ("batch_size", batch_size), ("seq_len", seq_len),
                      ("cpu_threads", cpu_threads)):
        inputs.positive_int(val, name)
    counts.check(world_size, tensor_parallel_size, fsdp)
    if ranks_per_node is not None and ranks_per_node > world_size:
        raise inputs.PlanArgumentError("ranks_per_node", f"{ranks_per_node} is more than the "
                                       f"world size ({world_size}): a node holds at most all "
                                       "the ranks")
    bucket_mb = inputs.positive_number(bucket_size_mb, "bucket_size_mb")
    fraction = inputs.fraction(offload_fraction, "offload_fraction", split.AUTO)
    headroom = inputs.fraction(device_memory_headroom, "device_memory_headroom", below_one=True)
    if device == "cpu" and fraction not in (split.AUTO, 1.0):
        raise inputs.PlanArgumentError("offload_fraction", f"{offload_fraction!r} with the CPU "
                                       "as the compute device: its \"device\" is host memory "
                                       "already; use 1.0 or \"auto\"")
    for name, val in (("delayed_update", delayed_update), ("measure", measure),
                      ("activation_checkpointing", activation_checkpointing),
                      ("accumulate", accumulate)):
        inputs.flag(val, name)
    counts.check_offload_weights(offload_weights, fsdp, device, fraction, delayed_update)
    fraction = 1.0 if offload_weights else fraction  # every byte of the state on the host
    dev_mem = inputs.memory(device_memory, "device_memory")
    host_mem = inputs.memory(host_memory, "host_memory")
    reserve = inputs.reserve(host_reserve, host_mem)
    info = model_info(model) if model is not None else {}
    total = inputs.parse_count(params) if params is not None else int(info["params"])
    frozen = inputs.parse_count(frozen_params, "frozen_params")
    if total < 1:
        raise inputs.PlanArgumentError("params", f"{params!r} is not a count >= 1")
    if frozen >= total:
        raise inputs.PlanArgumentError("frozen_params", f"{frozen_params!r} is not below the "
                                       f"parameter count ({total}): something must train")
    unit = counts.unit_params(total, fsdp, fsdp_unit_params, info.get("num_hidden_layers"))
    st = dict(total=total, frozen=frozen, info=info, precision=precision,
              world_size=world_size, ranks_per_node=ranks_per_node, device=device,
              device_memory=dev_mem, host_memory=host_mem, host_reserve=reserve,
              batch_size=batch_size, seq_len=seq_len, bucket=int(bucket_mb * 2**20),
              delayed_update=delayed_update, moment_dtype=moment_dtype,
              activation_checkpointing=activation_checkpointing, attention=attention,
              accumulate=accumulate, offload_fraction=fraction, headroom=headroom, rule=rule,
              tensor_parallel=tensor_parallel_size, fsdp=fsdp, unit_share=(unit or 0) / total,
              offload_weights=offload_weights)
    result = _evaluate(st, search=True)
    if device == "cpu":
        result.notes.append("activations are not counted (with the CPU as the device they take "
                            "host memory too)")
    elif not result.activation_bytes:
        result.notes.append("activations are not counted in the device bytes: an estimate "
                            "needs batch_size, seq_len and a model config (--batch-size, "
                            "--seq-len, --model) for the hidden size, layers and heads")
    if fsdp and device == "cuda":
        result.notes += counts.fsdp_notes(offload_weights)
    if result.fits is False:
        result.short = short_resources(result)
        result.suggestions = suggest(result, st, lambda o: _evaluate({**st, **o}, search=False))
    if measure:
        import torch

        from lightning_zero_offload.core.step.threads import default_threads

        threads = cpu_threads or default_threads(world_size, torch.device(device),
                                                 delayed_update)
        rate = speed.measure_kernel(precision, threads, rule, moment_dtype=moment_dtype)
        result.cpu_threads, result.kernel_params_per_second = threads, rate
        # the host part only: the device part's buckets step on the device
        result.cpu_step_seconds = (-(-(total - frozen) // world_size)
                                   * result.offload_fraction / rate)
        result.notes.append("the CPU step prediction assumes this host trains the run, each "
                            f"rank with {threads} threads; a shared or busy machine measures "
                            "slower")
    if device == "cuda":  # the device part's step: its traffic, its time where CUDA is here
        result.device_step_elements = int(-(-(total - frozen) // world_size)
                                          * (1 - result.offload_fraction))
        result.device_step_bytes = result.device_step_elements * speed.device_step_bytes(
            _ELEM[precision], rule)
        if measure and result.device_step_elements:
            rate = speed.measure_device_step(precision, rule)
            result.device_step_seconds = None if rate is None else (
                result.device_step_elements / rate)
    return result


def _evaluate(st: dict[str, Any], search: bool) -> Plan:
    """The plan for settings ``st`` (``plan``'s, resolved), and with ``search`` the largest model
    that fits with the same settings (with ``"auto"``: at any fraction) and the same activation
    estimate."""
    total, frozen, device = st["total"], st["frozen"], st["device"]
    dev_mem, host_mem = st["device_memory"], st["host_memory"]
    usable = None if host_mem is None else host_mem - st["host_reserve"]
    ranks = st["ranks_per_node"] or st["world_size"]
    auto = st["offload_fraction"] == split.AUTO
    acts = activation_bytes(st["info"], st["batch_size"], st["seq_len"], st["precision"],
                            st["activation_checkpointing"], st["attention"])

    cut = counts.Ranks(st["world_size"], st["tensor_parallel"], st["fsdp"], st["unit_share"],
                       st["offload_weights"])

    def sizes(n_trained: int, n_frozen: int, accumulate: bool, a: int,
              k: int) -> tuple[dict, dict]:
        return counts.counts(n_trained, n_frozen, st["precision"], cut, device, st["bucket"],
                             st["delayed_update"], a, st["moment_dtype"], accumulate, k,
                             st["rule"])

    def fit(d: int, hb: int, k: int) -> tuple[bool | None, bool | None]:
        # "auto" puts state on the device only within the headroom
        limit = None if dev_mem is None else (
            dev_mem * (1 - st["headroom"]) if auto and k else dev_mem)
        dfit = (True if usable is not None else None) if device == "cpu" else (
            None if limit is None else d <= limit)
        return dfit, None if usable is None else hb * ranks <= usable

    def shards(n_trained: int) -> list[int]:
        return counts.shards(n_trained, st["precision"], cut, st["bucket"], st["moment_dtype"])

    def on_device(n_trained: int, n_frozen: int, a: int) -> int | None:
        """Buckets kept on the device; None when no "auto" split fits both memories."""
        if device == "cpu" or st["offload_weights"]:
            return 0
        if not auto:  # the engine's setup check: its own bytes (no activations yet) fit
            def engine_fits(k: int) -> bool:
                d = sizes(n_trained, n_frozen, st["accumulate"], 0, k)[0]
                return dev_mem is None or sum(d.values()) <= dev_mem
            return split.device_buckets(shards(n_trained), st["offload_fraction"], engine_fits)

        def fits(k: int) -> tuple[bool | None, bool | None]:
            d, hb = sizes(n_trained, n_frozen, st["accumulate"], a, k)
            return fit(sum(d.values()), sum(hb.values()), k)

        return split.resolve_auto(len(shards(n_trained)), lambda k: fits(k)[1] is not False,
                                  lambda k: fits(k)[0] is not False)

    k = on_device(total - frozen, frozen, acts)
    tried = None
    if k is None and device == "cuda":  # "auto" found no split: say the best one it tried
        tried = split.tried(lambda j: sizes(total - frozen, frozen, st["accumulate"], acts, j),
                       shards(total - frozen), dev_mem, usable, ranks, st["headroom"])
    k = 0 if k is None else k  # nothing fits: the figures with all state on the host
    dev, host = sizes(total - frozen, frozen, st["accumulate"], acts, k)
    dev_bytes, host_bytes = sum(dev.values()), sum(host.values())
    host_acc = host_bytes if st["accumulate"] else sum(
        sizes(total - frozen, frozen, True, acts, k)[1].values())
    device_fits, host_fits = fit(dev_bytes, host_bytes, k)
    fits = None if None in (device_fits, host_fits) else bool(device_fits and host_fits)
    notes = []
    if fits and usable is not None and not st["accumulate"]:
        if not auto and host_acc * ranks > usable:
            notes.append(f"with --accumulate (an fp32 host gradient) it would not fit: "
                         f"{format_bytes(host_acc * ranks)} per node")
        elif auto and not _evaluate({**st, "accumulate": True}, search=False).fits:
            notes.append("with --accumulate (an fp32 gradient per trained element) no offload "
                         "fraction fits both memories")
    if not auto and k and device_fits and dev_bytes > dev_mem * (1 - st["headroom"]):
        notes.append(  # as the engine warns at setup: the user chose it
            f"--offload-fraction {st['offload_fraction']:g} leaves "
            f"{format_bytes(dev_mem - dev_bytes)} of the device free, less than "
            f"--device-memory-headroom {st['headroom']:g} of it (what \"auto\" keeps); the "
            "engine warns at setup")
    own = shards(total - frozen)
    after = None
    if auto and fits and dev_mem is not None and device == "cuda":  # once the peak is known
        limit = dev_mem * (1 - st["headroom"])

        def within(j: int) -> bool:
            return sum(sizes(total - frozen, frozen, st["accumulate"], acts, j)[0].values()) \
                <= limit

        after = split.host_fraction(own, split.most_on_device(k, len(own), within))
    largest = blocked = bound = alone = None
    if search and fits is not None:  # bytes grow with the model (``largest``)
        share = frozen / total  # (same frozen share; batch, sequence and activations held)

        def fits_at(n: int, a: int = acts) -> tuple[bool | None, bool | None]:
            nf = int(n * share)
            j = on_device(n - nf, nf, a)
            if j is None:  # no offload split fits both memories
                return False, False
            d, hb = sizes(n - nf, nf, st["accumulate"], a, j)
            return fit(sum(d.values()), sum(hb.values()), j)

        largest, bound = find_largest(fits_at)
        if largest == 0 and acts and all(fits_at(1, 0)):  # fits but for the activations
            largest, bound, blocked = None, None, "activations"
        elif st["offload_weights"] and bound == "host":  # the device holds no weights
            alone = find_largest(lambda n: (fits_at(n)[0], True))[0]
    optimizer = sum(dev.get(key, 0) for key in device_budget.STATE_PARTS)
    copies = _async_copies(total - frozen, st["world_size"], st["moment_dtype"], k, st["rule"])
    room = None if usable is None else usable - host_bytes * ranks
    copy_fits = {kind: None if room is None else copy * (ranks if kind == "sharded" else 1)
                 <= room for kind, copy in copies.items()}
    return Plan(total, total - frozen, st["precision"], st["world_size"], device, dev_bytes,
                dev, host_bytes, host, host_acc, host_bytes * ranks, dev_mem, host_mem, fits,
                device_fits, host_fits, largest, None, None, None, notes,
                batch_size=st["batch_size"], seq_len=st["seq_len"], activation_bytes=acts,
                activation_checkpointing=st["activation_checkpointing"],
                accumulate=st["accumulate"], max_params_blocked_by=blocked,
                host_reserve=st["host_reserve"], attention=st["attention"],
                offload_fraction=split.host_fraction(own, k),
                offload_fraction_setting=st["offload_fraction"],
                device_memory_headroom=st["headroom"], device_optimizer_bytes=optimizer,
                offload_fraction_after_first_step=after,
                async_copy_sharded=copies["sharded"],
                async_copy_consolidated=copies["consolidated"], async_copy_fits=copy_fits,
                auto_tried=tried, optimizer=st["rule"].KEY, max_params_bound=bound,
                max_params_device_alone=alone, **_owners(dev, cut, total, acts))


def _owners(dev: dict[str, int], cut: counts.Ranks, total: int, acts: int) -> dict[str, Any]:
    """The plan's fields of the ranks' cut and the device bytes by owner (``Plan``)."""
    weights = dev.get(counts.WEIGHTS, 0) + dev.get(counts.SHARDED_WEIGHTS, 0)
    gather = dev.get(counts.ALL_GATHER, 0)
    return dict(tensor_parallel_size=cut.tensor_parallel, data_parallel_size=cut.data_parallel,
                fsdp=cut.fsdp, offload_weights=cut.offload_weights,
                fsdp_unit_params=round(cut.unit_share * total) if cut.fsdp else None,
                device_weight_bytes=weights, fsdp_all_gather_bytes=gather,
                device_engine_bytes=sum(dev.values()) - weights - gather - (acts if dev else 0))


def _async_copies(trained: int, world_size: int, moment_dtype: str, on_device: int,
                  rule: Rule) -> dict[str, int]:
    """Bytes an asynchronous save copies (``core.checkpoint.pending``): a sharded save a rank's
    shard as it is saved (fp32 master; the moments as held, fp32 where a device part is), a
    consolidated one the whole model's fp32 master and moments, on rank 0."""
    shard = -(-trained // world_size)
    saved = moment_dtype if on_device == 0 else "fp32"
    return {"sharded": 4 * shard + rule.host_bytes(shard, saved),
            "consolidated": 4 * trained + rule.host_bytes(trained, "fp32")}
