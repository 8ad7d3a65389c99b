"""A rank's device and host bytes for a model of a given size: the engine's own count over the
rank's share of the model (``core.buckets.host_plan`` and ``core.buckets.device_budget``), that
share cut by tensor parallelism and, with FSDP2 (``fully_shard``), by the data-parallel ranks
too, plus FSDP2's all-gather buffers (``Ranks``; the terms are in ``planner``'s docstring). With
``offload_weights`` (FSDP2's ``CPUOffloadPolicy``) the weights live on the host and are the
engine's master: :func:`host_resident` states its bytes term by term."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero_offload.core.buckets import device_budget
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.planner import inputs

WEIGHTS = "weights"  # every rank holds them all (divided by the tensor-parallel size)
SHARDED_WEIGHTS = "weights (FSDP2 shard)"
IN_FLIGHT_UNITS = 2  # FSDP2 unshards the unit that runs and prefetches the next one
ALL_GATHER = f"FSDP2 all-gather ({IN_FLIGHT_UNITS} units)"
FROZEN_SHARDS = "FSDP2 frozen shards"  # host, --offload-weights: frozen weights, fp32
UNIT_GRAD = "FSDP2 unit gradient"  # host, --offload-weights: its fp32 gradient of one unit
DEFAULT_UNITS = 32  # the units assumed without a layer count or --fsdp-unit-params


@dataclass(frozen=True)
class Ranks:
    """How the ranks cut the model: ``world_size`` = data-parallel x ``tensor_parallel``
    ranks. Without ``fsdp`` a rank holds 1/TP of the weights and the engine partitions their
    state over the data-parallel ranks; with ``fsdp`` a rank holds 1/(DP x TP) of the weights
    and the engine steps exactly those (its partition is FSDP2's: a world of one, as
    ``core.dist.fsdp`` lays it out). ``unit_share``: FSDP2's largest unit, a share of all the
    parameters. ``offload_weights``: FSDP2 keeps the shards on the host (``CPUOffloadPolicy``)."""

    world_size: int
    tensor_parallel: int = 1
    fsdp: bool = False
    unit_share: float = 0.0
    offload_weights: bool = False

    def __post_init__(self) -> None:
        check(self.world_size, self.tensor_parallel, self.fsdp)  # a search's sizes too

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def engine_world(self) -> int:
        """The ranks the engine partitions its layout over."""
        return 1 if self.fsdp else self.data_parallel

    def local(self, n: int) -> int:
        """Of ``n`` parameters, those one rank holds and the engine lays out."""
        return -(-n // (self.world_size if self.fsdp else self.tensor_parallel))

    def unit(self, params: int) -> int:
        """FSDP2's largest unit of a model of ``params`` parameters (0 without FSDP2)."""
        return max(1, round(self.unit_share * params)) if self.fsdp else 0

    def all_gather(self, params: int, elem: int) -> int:
        """Bytes of FSDP2's unsharded units in flight for a model of ``params`` parameters in
        ``elem``-byte weights (a unit gathers its tensor-parallel rank's part); 0 without."""
        return IN_FLIGHT_UNITS * elem * -(-self.unit(params) // self.tensor_parallel)


def check(world_size: int, tensor_parallel: int, fsdp: bool) -> None:
    """Refuse a tensor-parallel size that does not divide the world size."""
    inputs.positive_int(tensor_parallel, "tensor_parallel_size")
    inputs.flag(fsdp, "fsdp")
    if world_size % tensor_parallel:
        raise inputs.PlanArgumentError(
            "tensor_parallel_size", f"{tensor_parallel} does not divide the world size "
            f"({world_size}): the data-parallel size is the world size / the tensor-parallel "
            "size; give a divisor of it, or another --world-size")


def check_offload_weights(offload_weights: bool, fsdp: bool, device: str,
                          offload_fraction: float | str, delayed_update: bool) -> None:
    """Refuse ``offload_weights`` where it has no meaning: without FSDP2, with the CPU as the
    compute device, with part of the state on the device or with the delayed update."""
    if not inputs.flag(offload_weights, "offload_weights"):
        return
    if not fsdp:
        raise inputs.PlanArgumentError(
            "offload_weights", "needs --fsdp (fsdp=True): the weights live on the host as "
            "FSDP2's CPUOffloadPolicy keeps the shards of a fully_shard-ed model")
    if device == "cpu":
        raise inputs.PlanArgumentError(
            "offload_weights", "with the CPU as the compute device (--device cpu) the weights "
            "are in host memory already: --offload-weights plans a GPU run")
    if offload_fraction not in (inputs.AUTO, 1.0):
        raise inputs.PlanArgumentError(
            "offload_fraction", f"{offload_fraction!r} with --offload-weights: the engine steps "
            "FSDP2's host shards in place, so all of the optimizer state is on the host; use "
            "1.0 or auto")
    if delayed_update:
        raise inputs.PlanArgumentError(
            "delayed_update", "with --offload-weights: the host step runs under the next "
            "forward, exactly, in its place; drop --delayed-update")


def fsdp_notes(offload_weights: bool) -> list[str]:
    """What the FSDP2 figures of a GPU run leave out."""
    held = "" if offload_weights else "its sharded weights and "
    notes = [f"FSDP2's own bytes beyond {held}two units in flight are not counted: the root "
             "unit's parameters, unsharded from forward to backward, and a unit's gradients "
             "before their reduce-scatter"]
    if offload_weights:
        notes.append("FSDP2 pins each parameter's host shard on its own (CPUOffloadPolicy's "
                     "pin_memory=True, its default) and torch's pinned allocator rounds every "
                     "block up to a power of two: up to twice the weights' 4 bytes per "
                     "parameter, by the model's shapes; not counted")
    return notes


def unit_params(total: int, fsdp: bool, given: int | float | str | None,
                layers: int | None) -> int | None:
    """FSDP2's largest unit in parameters: ``given`` (``--fsdp-unit-params``), else one block of
    ``layers`` (a model config's ``num_hidden_layers``), else ``total / DEFAULT_UNITS``."""
    if given is not None:
        if not fsdp:
            raise inputs.PlanArgumentError("fsdp_unit_params", f"{given!r} without fsdp: "
                                           "FSDP2's units exist only with --fsdp")
        unit = inputs.parse_count(given, "fsdp_unit_params")
        if not 1 <= unit <= total:
            raise inputs.PlanArgumentError("fsdp_unit_params", f"{given!r} is not a count in "
                                           f"[1, {total}] (the model's parameters)")
        return unit
    if not fsdp:
        return None
    return -(-total // (layers or DEFAULT_UNITS))


def buckets(trained: int, precision: str, world_size: int, bucket_bytes: int,
            moment_dtype: str) -> list[int]:
    """The buckets' elements in reduction order, padded as ``core.buckets.layout`` pads them."""
    from lightning_zero_offload.core.buckets.layout import shard_align

    h = inputs.ELEM[precision]
    unit = shard_align(moment_dtype) * world_size
    bucket = max(unit, bucket_bytes // h // unit * unit)
    full, rest = divmod(trained, bucket)
    rest = -(-rest // unit) * unit
    return [bucket] * full + ([rest] if rest else [])


def shards(trained: int, precision: str, ranks: Ranks, bucket_bytes: int,
           moment_dtype: str) -> list[int]:
    """This rank's shard of every bucket of the engine's layout, in reduction order."""
    w = ranks.engine_world
    return [b // w for b in buckets(ranks.local(trained), precision, w, bucket_bytes,
                                    moment_dtype)]


def counts(trained: int, frozen: int, precision: str, ranks: Ranks, device: str,
           bucket_bytes: int, delayed: bool, activations: int, moment_dtype: str,
           accumulate: bool, on_device: int, rule: Rule) -> tuple[dict, dict]:
    """(device breakdown, host breakdown) of one rank for these counts, the last ``on_device``
    buckets' optimizer state on the device (``split``). The host side is the engine's own sizing
    (``core.buckets.host_plan.plan_counts`` and ``budget``) over the other buckets of
    ``bucket_bytes``, for a run that accumulates gradients or not."""
    from lightning_zero_offload.core.buckets.host_plan import budget, plan_counts
    from lightning_zero_offload.core.config import PRECISIONS
    from lightning_zero_offload.core.limits import MAX_IN_FLIGHT

    if ranks.offload_weights:
        return host_resident(trained, frozen, precision, ranks, bucket_bytes, activations,
                             moment_dtype, accumulate, rule)
    dtype, h = PRECISIONS[precision], inputs.ELEM[precision]
    half, cpu = h != 4, device == "cpu"
    n, nf, w = ranks.local(trained), ranks.local(frozen) if frozen else 0, ranks.engine_world
    laid = buckets(n, precision, w, bucket_bytes, moment_dtype)
    own = [b // w for b in laid]
    hosted = own[: len(own) - on_device]
    sizes = plan_counts([sum(hosted)], hosted, dtype, asynchronous=not cpu, delayed=delayed,
                        pinned=not cpu, rule=rule, moment_dtype=moment_dtype,
                        accumulate=accumulate)
    host = budget(sizes, sum(laid), max(laid, default=0), dtype, cpu=cpu,
                  delayed=delayed, frozen_bytes=4 * nf if half else 0,
                  untrained_bytes=h * nf, buckets_in_flight=MAX_IN_FLIGHT + 1).parts
    gather = ranks.all_gather(trained + frozen, h)
    dev: dict[str, int] = {}
    if cpu:  # the "device" is host memory: FSDP2's unsharded units too
        host[ALL_GATHER] = gather
    else:  # the engine's own count, the model's frozen weights with its weights
        parts = device_budget.parts(
            trained=n, max_bucket=max(laid, default=0), max_shard=max(own, default=0),
            world_size=w, resident=sum(own) - sum(hosted), elem=h, delayed=delayed,
            accumulate=accumulate, rule=rule)
        parts[WEIGHTS] = parts.get(WEIGHTS, 0) + h * nf
        name = SHARDED_WEIGHTS if ranks.fsdp else WEIGHTS
        dev = {name if k == WEIGHTS else k: v for k, v in parts.items()}
        if gather:
            dev[ALL_GATHER] = gather
        if activations:
            dev["activations (estimate)"] = activations
    return dev, {k: v for k, v in host.items() if v}


def host_resident(trained: int, frozen: int, precision: str, ranks: Ranks, bucket_bytes: int,
                  activations: int, moment_dtype: str, accumulate: bool,
                  rule: Rule) -> tuple[dict, dict]:
    """(device breakdown, host breakdown) of one rank of a model ``fully_shard``-ed with
    FSDP2's ``CPUOffloadPolicy`` (``--offload-weights``, on a GPU): FSDP2's fp32 host shards
    are the engine's master, stepped in place. ``n`` = this rank's trained elements
    (``ranks.local``), ``nf`` its frozen ones, ``u`` its part of FSDP2's largest unit ``U``
    (``U / (D T)``), ``h`` the compute dtype's bytes, ``B`` a bucket's elements (``buckets``),
    ``T`` the tensor-parallel size. Terms, in bytes:

    device
        ``ALL_GATHER``: ``2 h U / T``, FSDP2's unsharded units in flight (the one that runs
        and the prefetched one) in the compute dtype; ``"gradient buckets (3)"``: ``3 h B``,
        the engine's ring (``core.buckets.device_budget.parts``, a world of one); the
        activations where estimated. No weights: FSDP2 copies each unit up as it runs.
    host
        ``"master"``: ``4 n``, FSDP2's shards (its memory, the only fp32 copy);
        ``"moments"``: ``rule.host_bytes(n, moment_dtype)`` (AdamW 8 / 4 / 2 + 8/256 with
        fp32 / bf16 / int8 moments); ``"staging"``: ``h n`` in pinned power-of-two blocks
        (``core.buckets.host_plan.plan_counts``): the reduced gradient the kernel reads, which
        carries no weights back (the kernel writes the master); ``"grad_fp32"``: ``4 n`` where
        the run accumulates; ``FROZEN_SHARDS``: ``4 nf``, FSDP2's fp32 shards of the frozen
        weights; ``UNIT_GRAD``: ``4 u``, FSDP2's fp32 host gradient of one unit at a time,
        dropped once the engine has its copy.

    So per trained element in bf16-mixed, fixed buffers aside: 14 / 10 / 8.03 (fp32 / bf16 /
    int8 moments), plus ``4 u / n``."""
    from lightning_zero_offload.core.buckets.host_plan import plan_counts
    from lightning_zero_offload.core.config import PRECISIONS

    h = inputs.ELEM[precision]
    n, nf = ranks.local(trained), ranks.local(frozen) if frozen else 0
    laid = buckets(n, precision, 1, bucket_bytes, moment_dtype)
    engine = plan_counts([n], laid, PRECISIONS[precision], asynchronous=True, delayed=False,
                         pinned=True, rule=rule, moment_dtype=moment_dtype,
                         accumulate=accumulate).parts
    host = {"master": 4 * n, "moments": engine["moments"], "staging": engine["staging"],
            "grad_fp32": engine["grad_fp32"], FROZEN_SHARDS: 4 * nf,
            UNIT_GRAD: 4 * ranks.local(ranks.unit(trained + frozen))}
    dev = device_budget.parts(trained=0, max_bucket=max(laid, default=0),
                              max_shard=max(laid, default=0), world_size=1, resident=0, elem=h,
                              delayed=False, accumulate=accumulate, rule=rule)
    dev[ALL_GATHER] = ranks.all_gather(trained + frozen, h)
    if activations:
        dev["activations (estimate)"] = activations
    return dev, {k: v for k, v in host.items() if v}
