"""The device part of partial offload: how many buckets keep their optimizer state on the
device (``core.buckets.buckets`` says which), and the one move ``offload_fraction="auto"`` makes
after the first step.

At setup a fixed fraction is placed as ``core.buckets.placement`` says (its device part checked
against the device's free memory before anything is allocated); ``"auto"`` keeps on the device only
what the host cannot hold (none where the device has no memory of its own: the CPU). After the first
optimizer step ``"auto"`` reads the device's peak and capacity and moves more buckets' state,
next in the same order, while the peak plus what moves stays within ``1 - headroom`` of the
capacity: ranks agree on the smallest count, the state is copied up, and only once every rank
allocated its part do the host buffers shrink; an allocation failure on any rank leaves every
rank as it was, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist

from lightning_zero_offload._units import format_bytes
from lightning_zero_offload.core.buckets import device_budget, placement
from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Layout
from lightning_zero_offload.core.buckets.preflight import check_host_memory
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.device.device import SyncDevice
from lightning_zero_offload.core.dist import collectives
from lightning_zero_offload.core.rules.rule import Rule

logger = logging.getLogger(__name__)


class DevicePart:
    """Owns the count of device-resident buckets and the host budget at it."""

    def __init__(self, layout: Layout, dev: SyncDevice, dtype: torch.dtype,
                 config: ZeroOffloadConfig, rank: int, group: object | None,
                 budget: Callable[[int, bool | None], dict[str, int]], rule: Rule
                 ) -> None:
        """``budget(count, accumulate)``: the engine's host bytes per part at a count."""
        self.layout, self.dev, self.dtype, self.rank, self.group = layout, dev, dtype, rank, group
        self.rule = rule
        self.fraction, self.headroom = config.offload_fraction, config.device_memory_headroom
        self.accumulate, self._budget = config.accumulate, budget
        self._check_host = config.check_host_memory
        self._delayed = config.delayed_update
        self._host_weights = bool(config.offload_weights)  # FSDP2's shards: none on the device
        self.count = 0
        # This rank's host bytes per part: owned and written here only (set by agree(), the
        # auto move and a lazy fp32 gradient), read by the engine and the host-memory checks.
        self.host_budget: dict[str, int] = {}
        self._pending_move = self.fraction == "auto" and dev.memory() is not None

    @property
    def resolved(self) -> float:
        """Host elements over all trained elements (``ZeroOffload.offload_fraction``)."""
        return placement.host_fraction(self.layout, self.count)

    @property
    def may_accumulate(self) -> bool:
        """Whether the run can accumulate (an undeclared one may): the device part's fp32
        gradient sum is budgeted then."""
        return self.accumulate is not False

    def choose(self) -> None:
        """Setup, local, before any allocation: the count for this rank, then the host-memory
        check (MemoryError when it, a fixed fraction's device part, or the part the host cannot
        hold does not fit)."""
        self.count = self._choose()
        if self._check_host:
            check_host_memory(sum(self._budget(self.count, self.accumulate).values()),
                              collectives.process_rank())

    def _choose(self) -> int:
        free, accumulate = self.dev.free_memory(), self.may_accumulate
        available = psutil.virtual_memory().available

        def host_fits(n: int) -> bool:
            return sum(self._budget(n, self.accumulate).values()) <= available
        if self.fraction != "auto":
            n = device_budget.fixed_count(
                self.layout, float(self.fraction), self.dtype, delayed=self._delayed,
                accumulate=accumulate, free=free, rule=self.rule, host_weights=self._host_weights)
            memory = self.dev.memory()
            device_budget.check_fixed(
                self.layout, n, self.dtype, delayed=self._delayed, accumulate=accumulate,
                free=free, capacity=None if memory is None else memory[1],
                headroom=self.headroom, fraction=float(self.fraction), rank=self.rank,
                rule=self.rule, host_weights=self._host_weights)
        elif free is None or host_fits(0):
            n = 0
        else:  # the fewest trailing buckets whose host part fits (host bytes fall with n)
            lo, hi = 0, len(self.layout.buckets)
            if not host_fits(hi):
                n = 0  # not even all of it: the host-memory check says so
            else:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if host_fits(mid) else (mid, hi)
                n = hi
                need = sum(device_budget.engine_parts(
                    self.layout, n, self.dtype, delayed=self._delayed,
                    accumulate=accumulate, rule=self.rule).values())
                if need > free:
                    raise MemoryError(
                        f"ZeroOffload: rank {self.rank}'s host cannot hold its optimizer state "
                        f"and the part it cannot hold does not fit on the device either (the "
                        f"engine's device memory would be {format_bytes(need)}, "
                        f"{format_bytes(free)} is free); use more ranks, "
                        "moment_dtype='int8' or a smaller model")
        return n

    def agree(self) -> dict[str, int]:
        """Collective with several ranks: under ``"auto"`` the largest count of any rank (a
        short host's), for a fixed fraction the smallest (a rank whose device took the split
        with more on the host); sets and returns the host budget at it."""
        own = self.count
        self.count = self._reduce(self.count, dist.ReduceOp.MAX if self.fraction == "auto"
                                  else dist.ReduceOp.MIN)
        if self.fraction != "auto" and self._check_host:
            self._check_agreed(own)
        shards = [b.shard for b in self.layout.buckets]
        if self.fraction != "auto" and self.rank == 0 and placement.differs(
                shards, self.count, float(self.fraction)):
            nearest = placement.candidates(shards, float(self.fraction))[0]
            logger.warning(  # whole buckets only: said whenever the split is not the request
                "ZeroOffload: offload_fraction=%g runs at %.4f: the device keeps whole buckets "
                "(%d of %d), the nearest split%s; smaller buckets (bucket_size_mb) split the "
                "state closer to it", float(self.fraction), self.resolved, self.count,
                len(shards), "" if nearest == self.count else
                f" that fits the device ({placement.host_share(shards, nearest):.4f} does not)")
        self.host_budget = self._budget(self.count, self.accumulate)
        return self.host_budget

    def fp32_allocated(self, nbytes: int) -> None:
        """The host's lazy fp32 gradient (``nbytes``) exists from now on."""
        self.host_budget["grad_fp32"] = nbytes

    def _check_agreed(self, own: int) -> None:
        """Collective with several ranks: the agreed count of a fixed fraction may keep more on
        this rank's host than its own choice (a peer's device took the split with more on the
        host), so the host is checked again at it; every rank raises if any rank is short."""
        error = None
        if self.count != own:
            try:
                check_host_memory(sum(self._budget(self.count, self.accumulate).values()),
                                  collectives.process_rank())
            except MemoryError as e:
                error = e
        short = self._reduce(self.rank + 1 if error is not None else 0, dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if short:
            raise MemoryError(
                f"ZeroOffload: rank {short - 1}'s host cannot hold its optimizer shard at the "
                f"split the ranks agreed on (offload_fraction={self.fraction} runs at "
                f"{self.resolved:.4f}: a rank's device could not keep the nearer split); see "
                f"rank {short - 1}'s error")

    def _reduce(self, n: int, op: dist.ReduceOp.RedOpType) -> int:
        if self.layout.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64).to(
            collectives.collective_device(self.group, self.dev.device))
        collectives.all_reduce(t, op, self.group, "all-reduce of the device-resident buckets")
        return int(t.item())

    # -- "auto" after the first step ----------------------------------------------------------
    @property
    def wants_move(self) -> bool:
        return self._pending_move

    @torch.no_grad()
    def move(self, buckets: Buckets, delayed: Any, grads: Any) -> bool:
        """Collective with several ranks; between steps. Once the delayed update (``delayed``)
        and the gradient streamer (``grads``) have nothing in flight, moves the next buckets'
        state onto the device as far as the measured peak allows, the host budget following;
        True when it did."""
        delayed.join()
        grads.drain()
        self.dev.synchronize()
        grads.buffers_replaced()  # its views of the host gradients go first
        self._pending_move = False
        assert buckets.arrays is not None
        accumulating = buckets.arrays.has_fp32_grads
        memory = self.dev.memory()
        assert memory is not None
        peak, capacity = memory
        room = (1.0 - self.headroom) * capacity - peak
        candidates, more = buckets.next_to_device(), 0
        for bucket in candidates:
            need = device_budget.bucket_bytes(bucket.numel, self.dtype,
                                              accumulating or self.may_accumulate, self.rule)
            if need > room:
                break
            room -= need
            more += 1
        more = self._reduce(more, dist.ReduceOp.MIN)
        if more == 0:
            return False
        made: dict = {}
        try:
            made = buckets.made_for_device(sorted(bk.b for bk in candidates[:more]))
            ok = 1
        except torch.OutOfMemoryError as e:
            logger.warning("ZeroOffload: offload_fraction='auto' could not move %d more "
                           "buckets' optimizer state onto the device (%s); the run goes on "
                           "as it was, at offload_fraction=%.4f", more, e, self.resolved)
            ok = 0
        if not self._reduce(ok, dist.ReduceOp.MIN):
            buckets.drop(made)
            if ok:
                logger.warning("ZeroOffload: offload_fraction='auto': another rank could not "
                               "move its optimizer state onto the device; every rank goes on "
                               "as it was")
            return False
        try:
            buckets.to_device(made, self.dev.release_host_cache)
        except Exception as e:  # the host's arrays are half replaced: nothing to step from
            raise RuntimeError(
                f"ZeroOffload: offload_fraction='auto' failed while moving {more} buckets' "
                f"optimizer state onto the device, part-way through the host's side ({e}); this "
                "engine cannot go on. Resume from your last checkpoint; to avoid the move, set "
                f"offload_fraction={self.resolved:.4f} (where it was) or another number") from e
        self.count += more
        self.host_budget = self._budget(self.count, accumulating or self.accumulate)
        logger.info("ZeroOffload: offload_fraction='auto' moved %d buckets onto the device; "
                    "offload_fraction is now %.4f", more, self.resolved)
        return True
