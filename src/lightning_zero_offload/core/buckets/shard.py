"""One bucket shard's optimizer state, wherever it lives: the interface both owners keep.

A bucket shard's fp32 master and the rule's state live on the host (:class:`HostShard`: views of
``core.buckets.host.HostBuffers``' arrays) or on the device (:class:`DeviceShard`, partial offload).
Both answer the same questions, so the step, checkpoints, the auto move and the master fill ask the
shard and never reach into it: :attr:`~Shard.master` (to read); :meth:`~Shard.step` (the rule
over the shard's runs); :meth:`~Shard.export` (one field as fp32 on the host) and
:meth:`~Shard.export_state` (the rule's whole state so); :meth:`~Shard.load` (master and state
in: the only way anything writes a shard's tensors). Both sides' state is the rule's
(``Rule.zeros``). Which bucket holds which shard is ``core.buckets.buckets``'s answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_zero_offload.core.buckets.pieces import PiecesSlice
from lightning_zero_offload.core.device.device import SyncDevice
from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.ops.moments import BLOCK, Moments

Run = tuple[int, int, int]  # (begin, end, step): a range of a bucket shard stepped as one call


class Shard(Protocol):
    """Bucket ``b``'s shard of the fp32 master and of the rule's state."""

    b: int

    @property
    def master(self) -> Tensor: ...

    def step(self, rule: Rule, source: Tensor, hp: Any, runs: Sequence[Run], grad_scale: float,
             *, out: Tensor | None = None, threads: int = 1, seed: int = 0) -> None: ...

    def export(self, kind: str) -> Tensor: ...

    def export_state(self) -> tuple[Tensor, ...]: ...

    def load(self, master: Tensor | None = None, state32: Sequence[Tensor] | None = None,
             at: int = 0, *, state: Moments | None = None) -> None: ...

    def tensors(self) -> list[Tensor]: ...

    def free(self) -> None: ...


def _step_in_place(rule: Rule, master: PiecesSlice, source: Tensor, moments: Moments,
                   begin: int, end: int, kw: dict) -> None:
    """The kernel over run ``[begin, end)``, one parameter of FSDP2's host shards (the runs are
    cut at parameters): in place over the parameter's whole int8 moment blocks, the rest (its
    last partial block and the layout's padding after it, which the moments' blocks cover)
    through a buffer of less than a block."""
    parts = master.pieces.views(master.lo + begin, master.lo + end)
    assert len(parts) == 1 and parts[0][0] == 0, "a run of host shards spans one parameter"
    view = parts[0][1]
    n = view.numel()
    cut = n - n % BLOCK if moments.moment_dtype == "int8" and end - begin > n else n
    if cut:
        rule.host_update(view[:cut], source[begin : begin + cut],
                         moments.chunk(begin, cut), **kw)
    if begin + cut < end:
        tail = torch.zeros(end - begin - cut)
        tail[: n - cut].copy_(view[cut:])
        rule.host_update(tail, source[begin + cut : end], moments.chunk(begin + cut, tail.numel()),
                         **kw)
        view[cut:].copy_(tail[: n - cut])


class HostArrays(Protocol):
    """What a host shard reads of ``core.buckets.host.HostBuffers``: per group the fp32 master and
    the rule's state (empty before it is allocated)."""

    master: list[Tensor]
    moments: list[Moments]


class HostShard:
    """Bucket ``b``'s shard in host memory: elements ``[offset, offset + numel)`` of group
    ``group``'s host arrays, read from them when used (the host may replace its arrays: the
    auto move), the moments' stochastic rounding keyed by ``base``, the elements' place in the
    whole model."""

    def __init__(self, arrays: HostArrays, b: int, group: int, offset: int, numel: int,
                 base: int, rule: Rule) -> None:
        self._arrays, self.b, self.rule = arrays, b, rule
        self._where, self._base = (group, offset, numel), base

    @property
    def master(self) -> Tensor:
        g, a, n = self._where
        return self._arrays.master[g][a : a + n]

    @property
    def _moments(self) -> Moments:
        g, a, n = self._where
        return self._arrays.moments[g].chunk(a, n).at(self._base)

    def step(self, rule: Rule, source: Tensor, hp: Any, runs: Sequence[Run], grad_scale: float,
             *, out: Tensor | None = None, threads: int = 1, seed: int = 0) -> None:
        """The rule's kernel over each run (the ranges between runs left as they are; their half
        weights in ``out``, which may hold stale ones, are the master's again)."""
        done, master, moments = 0, self.master, self._moments
        if isinstance(master, PiecesSlice):  # FSDP2's host shards (CPUOffloadPolicy)
            for begin, end, k in runs:
                _step_in_place(rule, master, source, moments, begin, end,
                               dict(hp=hp, step=k, grad_scale=grad_scale, out=None,
                                    threads=threads, seed=seed))
            return
        for begin, end, k in runs:
            self._untouched(out, master, done, begin)
            sl = slice(begin, end)
            rule.host_update(master[sl], source[sl], moments.chunk(begin, end - begin),
                             hp, step=k, grad_scale=grad_scale,
                             out=None if out is None else out[sl], threads=threads, seed=seed)
            done = end
        self._untouched(out, master, done, master.numel())

    @staticmethod
    def _untouched(out: Tensor | None, master: Tensor, begin: int, end: int) -> None:
        if out is not None and begin < end:
            out[begin:end].copy_(master[begin:end])

    def export(self, kind: str) -> Tensor:
        if kind == "master":  # FSDP2's host shards (CPUOffloadPolicy): a flat copy
            master = self.master
            return master if isinstance(master, Tensor) else master.materialize()
        mom = self._moments
        return mom.arrays[kind] if mom.moment_dtype == "fp32" else self.export_state()[
            mom.names.index(kind)]

    def export_state(self) -> tuple[Tensor, ...]:
        return self._moments.to_fp32()

    def load(self, master: Tensor | None = None, state32: Sequence[Tensor] | None = None,
             at: int = 0, *, state: Moments | None = None) -> None:
        """fp32 ``master`` and ``state32`` (the rule's order), or the rule's ``state`` in any
        moment format (its own copied exactly), from element ``at`` on; fp32 into compact
        moments rounds to nearest (the stochastic rounding is the kernel's, per step)."""
        if master is not None:
            self.master[at : at + master.numel()].copy_(master)
        if state is None and state32 is None:
            return
        mine = self._moments
        if state is not None and state.moment_dtype == mine.moment_dtype:
            mine.chunk(at, state.numel).copy_(state)
            return
        if state is not None:
            state32 = state.to_fp32()
        if state32:  # a rule with no state (SGD without momentum) has nothing to load
            n = state32[0].numel()
            mine.chunk(at, n).copy_(self.rule.from_fp32(state32, mine.moment_dtype))

    def tensors(self) -> list[Tensor]:
        """Device memory it holds: none."""
        return []

    def free(self) -> None:
        """Nothing to give back: the host arrays are ``core.buckets.host``'s."""


class DeviceShard:
    """Bucket ``b``'s shard kept on the device: its fp32 master and the rule's state there, in
    fp32 whatever ``moment_dtype`` (the rule's arrays, ``Rule.zeros``, each allocated on the
    device; its device update runs torch ops over them)."""

    def __init__(self, dev: SyncDevice, b: int, numel: int, rule: Rule) -> None:
        self.dev, self.b = dev, b
        shape = rule.zeros(0, "fp32")  # the rule's arrays (names, dtypes), none of its memory
        made: list[Tensor] = []
        try:  # an allocation that fails frees the ones before it
            for what, dtype in (("master weights", torch.float32),
                                *((name, t.dtype) for name, t in shape.arrays.items())):
                made.append(dev.zeros(numel, dtype, f"device-resident {what}"))
                dev.track(made[-1], f"device-resident {what}")  # named by the race detector
        except BaseException:
            for t in made:
                dev.free(t)
            raise
        self.names = tuple(shape.arrays)
        self._master, self._state = made[0], made[1:]

    @property
    def master(self) -> Tensor:
        return self._master

    def tensors(self) -> list[Tensor]:
        return [self._master, *self._state]

    def step(self, rule: Rule, source: Tensor, hp: Any, runs: Sequence[Run], grad_scale: float,
             *, out: Tensor | None = None, threads: int = 1, seed: int = 0) -> None:
        """The rule's device update over each run, on the compute stream (torch ops: no host
        threads, no seed; the caller casts the new weights from :attr:`master`, no ``out``)."""
        assert out is None, "the device part's weights are cast from its master"
        for begin, end, k in runs:
            sl = slice(begin, end)
            rule.device_update(self._master[sl], source[sl], [t[sl] for t in self._state], hp,
                               step=k, grad_scale=grad_scale)

    def export(self, kind: str) -> Tensor:
        """``"master"`` or one of the rule's state tensors by its name, on the host."""
        return (self._master if kind == "master" else
                self._state[self.names.index(kind)]).cpu()

    def export_state(self) -> tuple[Tensor, ...]:
        return tuple(t.cpu() for t in self._state)

    def load(self, master: Tensor | None = None, state32: Sequence[Tensor] | None = None,
             at: int = 0, *, state: Moments | None = None) -> None:
        """fp32 ``master`` and ``state32`` (the rule's order), or ``state`` in any moment format
        (kept in fp32 here), from element ``at`` on."""
        if master is not None:
            self._master[at : at + master.numel()].copy_(master)
        if state is not None:
            state32 = state.to_fp32()
        if state32 is not None:
            for t, value in zip(self._state, state32, strict=True):
                t[at : at + value.numel()].copy_(value)

    def free(self) -> None:
        """Give the device memory back: nothing of it stays referenced (a bucket, or an engine
        kept alive, still points at this shard)."""
        for t in self.tensors():
            self.dev.free(t)
        empty = self._master.new_empty(0)
        self._master, self._state = empty, [empty for _ in self._state]
