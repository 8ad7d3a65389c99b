"""One bucket shard's optimizer state, wherever it lives: the interface both owners keep.

A bucket shard's fp32 master and the rule's state live on the host (:class:`HostShard`: views of
``HostBuffers``' arrays, made once) or on the device (``stage.DeviceStage``, partial offload).
Both answer the same questions, so the step, checkpoints, the auto move and the master fill ask
the shard and never reach into it: :attr:`~Shard.master`; :meth:`~Shard.step` (the rule over the
shard's runs); :meth:`~Shard.export` (one field as fp32 on the host) and :meth:`~Shard.export_state`
(the rule's whole state so); :meth:`~Shard.own_fp32` (the shard's own fp32 state tensors, to
write in place, where it has them); :meth:`~Shard.load` (fp32 master and state in). Which owner
holds bucket ``b`` is ``placement.where``'s answer, asked once by ``HostBuffers.shard``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from lightning_zero_offload.core.rule import Rule
from lightning_zero_offload.ops.moments import Moments

Run = tuple[int, int, int]  # (begin, end, step): a range of a bucket shard stepped as one call


class Shard(Protocol):
    """Bucket ``b``'s shard of the fp32 master and of the rule's state."""

    b: int
    resident: bool  # its state lives on the device
    master: Tensor

    def step(self, rule: Rule, source: Tensor, hp: Any, runs: Sequence[Run], grad_scale: float,
             *, out: Tensor | None = None, threads: int = 1, seed: int = 0) -> None: ...

    def export(self, kind: str) -> Tensor: ...

    def export_state(self) -> tuple[Tensor, ...]: ...

    def own_fp32(self) -> tuple[Tensor, ...] | None: ...

    def load(self, master: Tensor | None = None, state32: Sequence[Tensor] | None = None,
             at: int = 0) -> None: ...


class HostShard:
    """Bucket ``b``'s shard in host memory: views of the host's master and moments (compact or
    fp32), the moments' stochastic rounding keyed by the elements' place in the whole model."""

    resident = False

    def __init__(self, b: int, master: Tensor, moments: Moments, rule: type[Rule]) -> None:
        self.b, self.master, self.moments, self.rule = b, master, moments, rule

    def step(self, rule: Rule, source: Tensor, hp: Any, runs: Sequence[Run], grad_scale: float,
             *, out: Tensor | None = None, threads: int = 1, seed: int = 0) -> None:
        """The rule's kernel over each run (the ranges between runs left as they are; their half
        weights in ``out``, which may hold stale ones, are the master's again)."""
        done = 0
        for begin, end, k in runs:
            self._untouched(out, done, begin)
            sl = slice(begin, end)
            rule.host_update(self.master[sl], source[sl], self.moments.chunk(begin, end - begin),
                             hp, step=k, grad_scale=grad_scale,
                             out=None if out is None else out[sl], threads=threads, seed=seed)
            done = end
        self._untouched(out, done, self.master.numel())

    def _untouched(self, out: Tensor | None, begin: int, end: int) -> None:
        if out is not None and begin < end:
            out[begin:end].copy_(self.master[begin:end])

    def export(self, kind: str) -> Tensor:
        if kind == "master":
            return self.master
        mom = self.moments
        return getattr(mom, kind) if mom.moment_dtype == "fp32" else self.export_state()[
            mom.names.index(kind)]

    def export_state(self) -> tuple[Tensor, ...]:
        return self.moments.to_fp32()

    def own_fp32(self) -> tuple[Tensor, ...] | None:
        mom = self.moments
        return tuple(mom.arrays.values()) if mom.moment_dtype == "fp32" else None

    def load(self, master: Tensor | None = None, state32: Sequence[Tensor] | None = None,
             at: int = 0) -> None:
        """fp32 ``master`` and ``state32`` (the rule's order) from element ``at`` on; compact
        moments round to nearest (the stochastic rounding is the kernel's, per step)."""
        if master is not None:
            self.master[at : at + master.numel()].copy_(master)
        if state32 is not None:
            n = state32[0].numel()
            self.moments.chunk(at, n).copy_(self.rule.from_fp32(state32, self.moments.moment_dtype))
