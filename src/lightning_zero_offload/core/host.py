"""The host buffers of this rank's shard and their sizing: one owner, one budget.

Per optimizer group, over this rank's shard: the fp32 master weights, the Adam moments (an
``ops.Moments`` in the config's ``moment_dtype``: fp32, bf16, or 8-bit codes plus per-block
scales) and, where the run accumulates, the fp32 gradient. Per bucket, on an asynchronous device:
one gradient staging slice (compute dtype) for both directions: the device-to-host copy lands
there, the kernel writes the new half weights in place over the gradient it consumed (or, where
the source was the fp32 gradient, over the staging already folded into it), and the host-to-
device copy reads them from there (rule 6 of ``core.device``). With delayed update a second
gradient set (staging, and the fp32 gradient where the run accumulates) receives the next
backward while the step reads the first. On the CPU the fp32 gradient is where buckets land
(always there) and the weights are written by the kernel or cast from the master.

:func:`plan` sizes exactly what :class:`HostBuffers` can ever allocate, pinned rounding included:
torch's pinned allocator rounds every block up to a power of two, so staging and output slices
are packed into a few power-of-two blocks (a few percent lost at most), and the one pinned
whole-group buffer (the fp32 master in ``"32-true"`` on CUDA, the source
of its copies) is budgeted rounded. On an asynchronous device the fp32 gradient exists only where
the run accumulates (``ZeroOffloadConfig.accumulate``): True allocates and budgets it at setup;
None budgets the run without it and allocates it at the first backward that accumulates
(:meth:`HostBuffers.need_fp32_grads`, before autograd, never in a hook) after its own host-memory
check; False refuses such a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_zero_offload.core.device_budget import state_bytes
from lightning_zero_offload.core.layout import Layout
from lightning_zero_offload.core.limits import BUCKET_BUFFERS
from lightning_zero_offload.core.placement import host_numel, where
from lightning_zero_offload.core.preflight import check_lazy_fp32
from lightning_zero_offload.core.rule import Rule
from lightning_zero_offload.core.shard import HostShard, Shard
from lightning_zero_offload.core.stage import DeviceStage, HostStage
from lightning_zero_offload.core.weights import frozen_bytes, untrained_bytes

_SLICE_ALIGN = 64  # bytes: every staging/output slice starts on a cache line
_MAX_BLOCK = 2**30  # pinned blocks of at most 1 GiB (or one slice, if a bucket is larger)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def pinned_size(nbytes: int) -> int:
    """What torch's pinned (caching host) allocator really reserves for ``nbytes``."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def _arena_blocks(slices: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Pack slices (bytes) in order into power-of-two blocks: (block sizes, [(block, offset)]).
    Full blocks of ``_MAX_BLOCK``; the rest in one rounded block when that wastes little, else
    in halving blocks, so what is reserved stays within a few percent of what is used."""
    padded = [_round_up(s, _SLICE_ALIGN) for s in slices]
    # What is left from each slice on (its sum and its largest), so packing stays linear in the
    # slice count: the planner packs models of 10^12 parameters, hundreds of times per plan.
    rests, bigs = [0] * (len(padded) + 1), [0] * (len(padded) + 1)
    for j in range(len(padded) - 1, -1, -1):
        rests[j], bigs[j] = rests[j + 1] + padded[j], max(bigs[j + 1], padded[j])
    blocks: list[int] = []
    places: list[tuple[int, int]] = []
    i = 0
    while i < len(padded):
        rest, big = rests[i], pinned_size(bigs[i])
        if rest >= _MAX_BLOCK:
            size = max(_MAX_BLOCK, big)
        elif pinned_size(rest) <= rest * 1.03:
            size = pinned_size(rest)
        else:
            size = max(big, 1 << (rest.bit_length() - 1))  # the largest power of two <= rest
        off = 0
        while i < len(padded) and off + padded[i] <= size:
            places.append((len(blocks), off))
            off += padded[i]
            i += 1
        blocks.append(size)
    return blocks, places


@dataclass
class Sizes:
    """Bytes of every host buffer an engine can allocate (what the preflight check budgets)."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def plan(layout: Layout, dtype: torch.dtype, *, asynchronous: bool, delayed: bool,
         pinned: bool, rule: type[Rule], moment_dtype: str = "fp32",
         accumulate: bool | None = False,
         on_device: int = 0) -> Sizes:
    """Sizes of :class:`HostBuffers` built with the same arguments (see the module docstring;
    ``accumulate=None`` counts the run that does not accumulate; the trailing ``on_device``
    buckets' state is on the device, ``core.placement``)."""
    n_host = len(layout.buckets) - on_device
    return plan_counts(host_numel(layout, on_device), [b.shard for b in layout.buckets[:n_host]],
                       dtype,
                       asynchronous=asynchronous, delayed=delayed, pinned=pinned,
                       rule=rule, moment_dtype=moment_dtype, accumulate=accumulate is True)


def plan_counts(group_shards: list[int], bucket_shards: list[int], dtype: torch.dtype, *,
                asynchronous: bool, delayed: bool, pinned: bool, rule: type[Rule],
                moment_dtype: str = "fp32", accumulate: bool = False) -> Sizes:
    """:func:`plan` from the numbers alone (also the planner's, for a model not built yet):
    this rank's elements per group and per bucket. ``"moments"`` is the rule's state with its
    scales, exactly as ``rule.zeros`` allocates it per group; ``"grad_fp32"`` the fp32
    gradient of every set (on an asynchronous device only when ``accumulate``: the run adds
    several backward passes per step); ``"staging"`` the half gradient staging of every set,
    which also carries the new weights to the device (the kernel writes them over the gradient
    it consumed: no separate output buffer)."""
    n, elem = sum(group_shards), torch.empty((), dtype=dtype).element_size()
    sets = 2 if delayed else 1
    parts = {"master": 4 * n,
             "moments": sum(rule.host_bytes(k, moment_dtype) for k in group_shards),
             "grad_fp32": 4 * n * sets if accumulate or not asynchronous else 0}
    if pinned and dtype == torch.float32:  # "32-true" on CUDA: the master is the pinned source
        parts["master"] = sum(pinned_size(4 * k) for k in group_shards)
    shard_bytes = [k * elem for k in bucket_shards]
    parts["staging"] = _arena_bytes(shard_bytes, pinned) * sets if asynchronous else 0
    return Sizes(parts)


def fp32_grad_bytes(group_numel: list[int], delayed: bool) -> int:
    """Bytes the fp32 gradient of every set takes (what a lazy allocation checks for)."""
    return 4 * sum(group_numel) * (2 if delayed else 1)


def _arena_bytes(slices: list[int], pinned: bool) -> int:
    if not pinned:
        return sum(_round_up(s, _SLICE_ALIGN) for s in slices)
    return sum(_arena_blocks(slices)[0])


def budget(sizes: Sizes, device_numel: int, max_bucket_numel: int, dtype: torch.dtype, *,
           cpu: bool, delayed: bool, frozen_bytes: int, untrained_bytes: int,
           buckets_in_flight: int) -> Sizes:
    """All host bytes of an engine: its buffers, the exact copies of frozen parameters and, with
    the CPU as compute device, what lives on that "device": the weights (``device_numel``,
    twice with delayed update), the module's other tensors in the compute dtype and the bucket
    buffers in flight."""
    parts = {**sizes.parts, "frozen_exact": frozen_bytes}
    if cpu:
        elem = torch.empty((), dtype=dtype).element_size()
        parts["device_weights"] = device_numel * elem * (2 if delayed else 1)
        parts["device_untrained"] = untrained_bytes
        parts["buckets_in_flight"] = buckets_in_flight * max_bucket_numel * elem
    return Sizes(parts)


def engine_budget(sizes: Sizes, layout: Layout, module: torch.nn.Module, trained: dict[int, str],
                  dtype: torch.dtype, *, cpu: bool, delayed: bool, rule: type[Rule],
                  on_device: int = 0, accumulate: bool | None = False) -> Sizes:
    """:func:`budget` for an engine over ``module`` (``trained``: its managed parameters;
    ``on_device``: trailing buckets whose state is on the device, host memory too on the CPU)."""
    out = budget(sizes, sum(layout.group_numel),
                 max((b.numel for b in layout.buckets), default=0), dtype, cpu=cpu,
                 delayed=delayed, frozen_bytes=frozen_bytes(module, trained, dtype),
                 untrained_bytes=untrained_bytes(module, trained, dtype),
                 buckets_in_flight=BUCKET_BUFFERS)  # on the CPU, host memory too
    if cpu and on_device:
        out.parts["device_state"] = state_bytes(layout, on_device, dtype, accumulate is not False,
                                                rule)
    return out


def budget_at(layout: Layout, module: torch.nn.Module, trained: dict[int, str],
              dtype: torch.dtype, *, cpu: bool, **kw: object):
    """``(on_device, accumulate) -> host bytes per part`` of an engine built with ``kw``
    (:func:`plan`'s arguments) and that many device-resident buckets."""
    def at(on_device: int, accumulate: bool | None) -> dict[str, int]:
        sizes = plan(layout, dtype, **{**kw, "accumulate": accumulate},  # type: ignore[arg-type]
                     on_device=on_device)
        return engine_budget(sizes, layout, module, trained, dtype, cpu=cpu,
                             delayed=bool(kw["delayed"]), on_device=on_device,
                             rule=kw["rule"],  # type: ignore[arg-type]
                             accumulate=accumulate).parts
    return at


class _Arena:
    """Per-bucket slices of a few large host blocks (pinned on CUDA)."""

    def __init__(self, numels: list[int], dtype: torch.dtype, pinned: bool) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        sizes = [k * elem for k in numels]
        if pinned:
            blocks, places = _arena_blocks(sizes)
            self.blocks = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in blocks]
        else:
            offs, off = [], 0
            for s in sizes:
                offs.append((0, off))
                off += _round_up(s, _SLICE_ALIGN)
            places, self.blocks = offs, [torch.empty(off, dtype=torch.uint8)]
        self.slices = [self.blocks[b][o : o + s].view(dtype)
                       for (b, o), s in zip(places, sizes, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)


class GradSet:
    """One set of gradient buffers: fp32 per group (maybe not allocated yet), staging, and the
    stage that owns each bucket shard's life in it (``core.stage``)."""

    def __init__(self, layout: Layout, dtype: torch.dtype, staged: bool, pinned: bool,
                 resident: list[DeviceStage]) -> None:
        self.layout, self.numel = layout, host_numel(layout, len(resident))
        self.fp32: list[Tensor] | None = None
        n_host = len(layout.buckets) - len(resident)
        self._arena = (_Arena([b.shard for b in layout.buckets[:n_host]], dtype, pinned)
                       if staged else None)
        self.staging = self._arena.slices if self._arena is not None else None
        self.stages: list[HostStage | DeviceStage] = [
            *(HostStage(b, None if self.staging is None else self.staging[b])
              for b in range(n_host)), *resident]

    def allocate_fp32(self) -> None:
        """The fp32 gradient, each host stage given its bucket's view of it."""
        if self.fp32 is not None:
            return
        self.fp32 = [torch.zeros(k) for k in self.numel]
        for stage in self.stages:
            if isinstance(stage, HostStage):
                bucket = self.layout.buckets[stage.b]
                stage.fp32 = self.fp32[bucket.group][
                    bucket.host_offset : bucket.host_offset + bucket.shard]

    def free(self) -> None:
        self.fp32 = self.staging = self._arena = None
        for stage in self.stages:
            if isinstance(stage, HostStage):
                stage.fp32 = stage.staging = None

    def nbytes(self) -> int:
        out = sum(t.numel() * 4 for t in self.fp32 or [])
        return out + (self._arena.nbytes if self._arena is not None else 0)


class HostBuffers:
    """This rank's host state; the only place that allocates host buffers of the shard's size."""

    def __init__(self, layout: Layout, dtype: torch.dtype, *, asynchronous: bool,
                 delayed: bool, pinned: bool, rule: type[Rule], moment_dtype: str = "fp32",
                 rank: int = 0,
                 accumulate: bool | None = False, check_memory: bool = False,
                 master: list[Tensor] | None = None,
                 on_fp32: Callable[[int], None] | None = None,
                 resident: list[DeviceStage] | None = None) -> None:
        self.layout, self.moment_dtype, self.rule = layout, moment_dtype, rule
        self.accumulate, self._check_memory, self._delayed = accumulate, check_memory, delayed
        self._on_fp32 = on_fp32  # told the bytes of a lazy fp32 gradient (the budget's owner)
        self._args = (dtype, asynchronous, pinned)
        self.resident = resident = list(resident or [])  # the device's trailing buckets
        half = dtype != torch.float32
        n = host_numel(layout, len(resident))
        self.sizes = plan(layout, dtype, asynchronous=asynchronous, delayed=delayed,
                          pinned=pinned, rule=rule, moment_dtype=moment_dtype,
                          accumulate=accumulate,
                          on_device=len(resident))
        self.master = master or [torch.zeros(k, pin_memory=pinned and not half) for k in n]
        self.moments = [rule.zeros(k, moment_dtype) for k in n]
        self._shards: list[Shard] | None = None  # shards(), made once
        # Each element draws its stochastic rounding from its place in the whole model (groups
        # back to back), not in this rank's shard: ranks do not round alike, and a layout that
        # is the same at another world size rounds the same.
        self._base = [sum(layout.group_numel[:g]) for g in range(len(n))]
        self.rank = rank
        self.grads: GradSet = GradSet(layout, dtype, asynchronous, pinned, resident)
        self.spare: GradSet | None = (
            GradSet(layout, dtype, asynchronous, pinned, resident) if delayed else None)
        if not asynchronous or accumulate:  # on the CPU the fp32 gradient is where buckets land
            self._allocate_fp32()

    def state_fp32(self, name: str) -> list[Tensor]:
        """The rule's state ``name`` per group, fp32 (``moment_dtype="fp32"`` only)."""
        if self.moment_dtype != "fp32":
            raise RuntimeError(f"the moments are {self.moment_dtype}; use HostBuffers.moments")
        return [getattr(m, name) for m in self.moments]

    def shard(self, b: int) -> Shard:
        """Bucket ``b``'s shard of the master and the rule's state, where it lives."""
        return self.shards()[b]

    def shards(self) -> list[Shard]:
        """Every bucket's shard, made once: a device stage, or the host's (block-aligned views:
        the layout pads bucket shards to whole blocks for 8-bit moments)."""
        if self._shards is None:
            self._shards = [where(self.layout, self.resident, b) or self._host_shard(b)
                            for b in range(len(self.layout.buckets))]
        return self._shards

    def _host_shard(self, b: int) -> HostShard:
        bucket = self.layout.buckets[b]
        g, sl = bucket.group, slice(bucket.host_offset, bucket.host_offset + bucket.shard)
        mom = self.moments[g].chunk(bucket.host_offset, bucket.shard)
        lo, _ = bucket.shard_range(self.rank)
        return HostShard(b, self.master[g][sl], mom.at(self._base[g] + lo), self.rule)

    def need_fp32_grads(self) -> None:
        """A backward is about to accumulate: the fp32 gradient of both sets exists from here on
        (the one place that allocates it after setup: when the streamer first accumulates,
        before autograd). ``accumulate=False`` refuses; ``None`` checks host memory first."""
        if self.grads.fp32 is not None:
            return
        if self.accumulate is False:
            raise RuntimeError(
                "ZeroOffload: this backward accumulates gradients into a step's earlier ones "
                "(several backward passes per step), but the engine was built with "
                "ZeroOffloadConfig(accumulate=False), so it has no fp32 host gradient to add "
                "into; set accumulate=True (or None) to accumulate, or call step() and "
                "zero_grad() after every backward")
        needed = fp32_grad_bytes(self.grads.numel, self._delayed)
        if self._check_memory:
            check_lazy_fp32(needed, self.rank)
        self._allocate_fp32()
        if self._on_fp32 is not None:  # budget = allocation, from here on with it
            self._on_fp32(needed)

    def _allocate_fp32(self) -> None:
        for s in (self.grads, self.spare):
            if s is not None:
                s.allocate_fp32()

    def reset_stages(self) -> None:
        """``zero_grad``: every stage of both sets starts over."""
        for s in (self.grads, self.spare):
            for stage in s.stages if s is not None else []:
                stage.reset()

    def swap(self) -> GradSet:
        """Delayed update: returns the set the step just decided reads; the next backward fills
        the other one."""
        spare = self.spare
        if spare is None:
            raise RuntimeError("ZeroOffload internal error: swap without delayed update")
        used, self.grads, self.spare = self.grads, spare, self.grads
        return used

    def move_to_device(self, resident: list[DeviceStage],
                       release: Callable[[], None] = lambda: None) -> dict[str, int]:
        """``resident`` (the stages of more trailing buckets, their state already copied from
        here) takes their state over: the host keeps a shorter prefix of every group in new
        arrays and the old ones go. Between steps, nothing in flight. ``release`` returns freed
        pinned blocks to the system (CUDA caches them). Returns the new sizes."""
        dtype, asynchronous, pinned = self._args
        self._shards = None  # views would keep the old arrays alive while the new ones are made
        self.resident = resident = [*resident, *self.resident]
        n = host_numel(self.layout, len(resident))
        half = dtype != torch.float32
        # The host is what runs short: the gradients go first (they are rebuilt), then each
        # array is replaced by its shorter copy before the next is made, so the host holds at
        # most one new array more than before the move, not a second set of state.
        had_fp32 = self.grads.fp32 is not None
        for s in (self.grads, self.spare):
            if s is not None:
                s.free()
        release()
        for g, k in enumerate(n):
            master = torch.empty(k, pin_memory=pinned and not half)
            self.master[g] = master.copy_(self.master[g][:k])
            if pinned and not half:
                release()
            self.moments[g].keep_prefix_(k)
        self.grads = GradSet(self.layout, dtype, asynchronous, pinned, resident)
        self.spare = (GradSet(self.layout, dtype, asynchronous, pinned, resident)
                      if self.spare is not None else None)
        if had_fp32:
            self._allocate_fp32()
        self.sizes = plan(self.layout, dtype, asynchronous=asynchronous, delayed=self._delayed,
                          pinned=pinned, rule=self.rule, moment_dtype=self.moment_dtype,
                          accumulate=self.accumulate or had_fp32, on_device=len(resident))
        return dict(self.sizes.parts)

    def allocated_bytes(self) -> int:
        """Bytes of everything allocated so far (at most ``sizes.total``)."""
        out = sum(t.numel() * 4 for t in self.master)
        out += sum(m.nbytes for m in self.moments)
        return out + sum(s.nbytes() for s in (self.grads, self.spare) if s is not None)

    def free(self) -> None:
        for stage in self.resident:
            stage.free()
        self.master, self.moments, self.resident = [], [], []
        self._shards = None
        for s in (self.grads, self.spare):
            if s is not None:
                s.free()
