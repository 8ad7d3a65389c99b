"""The host arrays of this rank's shard: one owner, one budget (``host_plan`` sizes them).

Per optimizer group, over the host buckets' shards (``core.buckets.buckets``): the fp32 master
weights, the rule's state (an ``ops.Moments`` in the config's ``moment_dtype``: fp32, bf16, or 8-bit
codes plus per-block scales) and, where the run accumulates, the fp32 gradient. Per host bucket, on
an asynchronous device: one gradient staging slice (compute dtype) for both directions: the
device-to-host copy lands there, the kernel writes the new half weights in place over the
gradient it consumed (or, where the source was the fp32 gradient, over the staging already
folded into it), and the host-to-device copy reads them from there (rule 6 of
``core.device.device``). With delayed update a second gradient set (staging, and the fp32 gradient
where the run accumulates) receives the next backward while the step reads the first. On the CPU the
fp32 gradient is where buckets land (always there) and the weights are written by the kernel or cast
from the master.

The arrays are allocated in setup's order: the master first (filled before the device weights
take the parameters over), the rest by :meth:`HostBuffers.allocate` once the user's fp32 copy is
gone. A bucket's shard and gradient sides (``core.buckets.shard``, ``core.buckets.stage``) read
their slices of these arrays when they use them; only the shard writes the master and the state. On
an asynchronous device the fp32 gradient exists only where the run accumulates: ``accumulate=True``
allocates it at setup; None allocates it at the first backward that accumulates
(:meth:`HostBuffers.need_fp32_grads`, before autograd, never in a hook) after its own host-memory
check; False refuses such a backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.host_plan import (
    SLICE_ALIGN,
    arena_blocks,
    budget,
    budget_at,
    fp32_grad_bytes,
    held_numel,
    plan,
    plan_counts,
    round_up,
)
from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.buckets.pieces import Pieces
from lightning_zero_offload.core.buckets.preflight import check_lazy_fp32
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.ops.moments import Moments

__all__ = ["HostBuffers", "budget", "budget_at", "plan", "plan_counts"]  # the sizing's, too


class _Arena:
    """Per-bucket slices of a few large host blocks (pinned on CUDA)."""

    def __init__(self, numels: list[int], dtype: torch.dtype, pinned: bool) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        sizes = [k * elem for k in numels]
        if pinned:
            blocks, places = arena_blocks(sizes)
            self.blocks = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in blocks]
        else:
            offs, off = [], 0
            for s in sizes:
                offs.append((0, off))
                off += round_up(s, SLICE_ALIGN)
            places, self.blocks = offs, [torch.empty(off, dtype=torch.uint8)]
        self.slices = [self.blocks[b][o : o + s].view(dtype)
                       for (b, o), s in zip(places, sizes, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)


class HostBuffers:
    """This rank's host arrays; the only place that allocates host buffers of the shard's size.

    ``master``, ``moments``: per group; ``staging[s]``: per gradient set ``s``, bucket -> its
    slice (None on a synchronous device); ``fp32[s]``: per set, the fp32 gradient per group
    (None until allocated)."""

    def __init__(self, layout: Layout, dtype: torch.dtype, *, asynchronous: bool,
                 delayed: bool, pinned: bool, rule: Rule, moment_dtype: str = "fp32",
                 rank: int = 0, accumulate: bool | None = False, check_memory: bool = False,
                 on_fp32: Callable[[int], None] | None = None,
                 host: list[int] | None = None, masters: list[Pieces] | None = None) -> None:
        """Allocates the master (zeros, to be filled) of buckets ``host`` (default: all), unless
        ``masters`` are given: FSDP2's host shards per group (``CPUOffloadPolicy``), stepped in
        place."""
        self.layout, self.moment_dtype, self.rule = layout, moment_dtype, rule
        self.accumulate, self._check_memory, self._delayed = accumulate, check_memory, delayed
        self._on_fp32 = on_fp32  # told the bytes of a lazy fp32 gradient (the budget's owner)
        self._args = (dtype, asynchronous, pinned)
        self.rank = rank
        self.host = list(range(len(layout.buckets))) if host is None else list(host)
        self.numel = held_numel(layout, self.host)
        self.owns_master = masters is None
        self.sizes = self._plan(accumulate)
        self.master: list = masters if masters is not None else [
            torch.zeros(k, pin_memory=self._pinned_master) for k in self.numel]
        self.moments: list[Moments] = []
        sets = 2 if delayed else 1
        self.staging: list[dict[int, Tensor] | None] = [None] * sets
        self.fp32: list[list[Tensor] | None] = [None] * sets
        self._arenas: list[_Arena | None] = [None] * sets

    @property
    def _pinned_master(self) -> bool:
        dtype, _, pinned = self._args
        return pinned and dtype == torch.float32  # "32-true" on CUDA: the source of its copies

    def _plan(self, accumulate: bool | None):  # noqa: ANN202 (host_plan.Sizes)
        dtype, asynchronous, pinned = self._args
        return plan(self.layout, dtype, asynchronous=asynchronous, delayed=self._delayed,
                    pinned=pinned, rule=self.rule, moment_dtype=self.moment_dtype,
                    accumulate=accumulate, host=self.host,
                    own_master=self.owns_master)

    def allocate(self) -> None:
        """Everything but the master: the rule's state, the gradient sets' staging and, where
        buckets land in it or the run accumulates, the fp32 gradient."""
        _, asynchronous, _ = self._args
        self.moments = [self.rule.zeros(k, self.moment_dtype) for k in self.numel]
        self._allocate_staging()
        if not asynchronous or self.accumulate:  # on the CPU buckets land in the fp32 gradient
            self.allocate_fp32()

    def _allocate_staging(self) -> None:
        dtype, asynchronous, pinned = self._args
        if not asynchronous:
            return
        shards = [self.layout.buckets[b].shard for b in self.host]
        for s in range(len(self._arenas)):
            arena = self._arenas[s] = _Arena(shards, dtype, pinned)
            self.staging[s] = dict(zip(self.host, arena.slices, strict=True))

    def state_fp32(self, name: str) -> list[Tensor]:
        """The rule's state ``name`` per group, fp32 (``moment_dtype="fp32"`` only)."""
        if self.moment_dtype != "fp32":
            raise RuntimeError(f"the moments are {self.moment_dtype}; use HostBuffers.moments")
        return [m.arrays[name] for m in self.moments]

    @property
    def has_fp32_grads(self) -> bool:
        return self.fp32[0] is not None

    def need_fp32_grads(self) -> None:
        """A backward is about to accumulate: the fp32 gradient of both sets exists from here on
        (the one place that allocates it after setup: when the streamer first accumulates,
        before autograd). ``accumulate=False`` refuses; ``None`` checks host memory first."""
        if self.has_fp32_grads:
            return
        if self.accumulate is False:
            raise RuntimeError(
                "ZeroOffload: this backward accumulates gradients into a step's earlier ones "
                "(several backward passes per step), but the engine was built with "
                "ZeroOffloadConfig(accumulate=False), so it has no fp32 host gradient to add "
                "into; set accumulate=True (or None) to accumulate, or call step() and "
                "zero_grad() after every backward")
        needed = fp32_grad_bytes(self.numel, self._delayed)
        if self._check_memory:
            check_lazy_fp32(needed, self.rank)
        self.allocate_fp32()
        if self._on_fp32 is not None:  # budget = allocation, from here on with it
            self._on_fp32(needed)

    def allocate_fp32(self) -> None:
        """The fp32 gradient of every set (once)."""
        for s in range(len(self.fp32)):
            if self.fp32[s] is None:
                self.fp32[s] = [torch.zeros(k) for k in self.numel]

    def shrink(self, host: list[int], release: Callable[[], None] = lambda: None
               ) -> dict[str, int]:
        """Only buckets ``host`` stay here (the others' state was copied to the device): the
        arrays keep a shorter prefix of every group, in new arrays, and the old ones go.
        Between steps, nothing in flight. ``release`` returns freed pinned blocks to the system
        (CUDA caches them). Returns the new sizes."""
        self.host, self.numel = list(host), held_numel(self.layout, host)
        # The host is what runs short: the gradients go first (they are made anew), then each
        # array is replaced by its shorter copy before the next is made, so the host holds at
        # most one new array more than before the move, not a second set of state.
        had_fp32 = self.has_fp32_grads
        self._free_grads()
        release()
        for g, k in enumerate(self.numel):
            master = torch.empty(k, pin_memory=self._pinned_master)
            self.master[g] = master.copy_(self.master[g][:k])
            if self._pinned_master:
                release()
            self.moments[g].keep_prefix_(k)
        self._allocate_staging()
        if had_fp32:
            self.allocate_fp32()
        self.sizes = self._plan(self.accumulate or had_fp32)
        return dict(self.sizes.parts)

    def allocated_bytes(self) -> int:
        """Bytes of everything allocated so far (at most ``sizes.total``)."""
        out = sum(t.numel() * 4 for t in self.master) if self.owns_master else 0
        out += sum(m.nbytes for m in self.moments)
        out += sum(t.numel() * 4 for f in self.fp32 for t in f or [])
        return out + sum(a.nbytes for a in self._arenas if a is not None)

    def _free_grads(self) -> None:
        n = len(self.fp32)
        self.staging, self.fp32, self._arenas = [None] * n, [None] * n, [None] * n

    def free(self) -> None:
        self.master, self.moments = [], []
        self._free_grads()
