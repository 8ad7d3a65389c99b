"""A flat range made of separate tensors: FSDP2's local shards seen as one optimizer group.

FSDP2 owns the storage of each rank's local shards (its next all-gather reads them), so the engine
cannot make them views of a flat buffer of its own. A :class:`Pieces` is the flat range a group's
layout gives them instead: each shard at its offset, the gaps between them (the layout's
alignment) holding nothing. The device weights of a ``fully_shard`` model are such pieces
(``core.transfer.shard_weights``), and with ``CPUOffloadPolicy`` the host master is too: the kernel
then steps each parameter's range (runs cut at parameter boundaries) in place.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Pieces:
    """A flat range ``[0, numel)`` made of separate tensors at given offsets."""

    def __init__(self, numel: int, pieces: list[tuple[int, Tensor]]) -> None:
        self.numel, self.pieces = numel, sorted(pieces, key=lambda p: p[0])
        self.dtype = pieces[0][1].dtype if pieces else torch.float32
        self.device = pieces[0][1].device if pieces else torch.device("cpu")

    def __getitem__(self, where: slice) -> PiecesSlice:
        lo, hi, _ = where.indices(self.numel)
        return PiecesSlice(self, lo, hi)

    def views(self, lo: int, hi: int) -> list[tuple[int, Tensor]]:
        """``(offset from lo, view)`` of every piece part inside ``[lo, hi)``."""
        out = []
        for at, t in self.pieces:
            a, z = max(lo, at), min(hi, at + t.numel())
            if a < z:
                out.append((a - lo, t[a - at : z - at]))
        return out


class PiecesSlice:
    """``pieces[lo:hi]``, as far as the engine uses a slice of a flat tensor: a target of
    ``copy_``, its ``numel``, a sub-slice (a real view where it lies in one piece: the kernel's
    runs), and :meth:`materialize` (a flat copy, gaps zero) for a checkpoint."""

    def __init__(self, pieces: Pieces, lo: int, hi: int) -> None:
        self.pieces, self.lo, self.hi = pieces, lo, hi
        self.dtype, self.device = pieces.dtype, pieces.device

    def numel(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, where: slice) -> Tensor | PiecesSlice:
        """A real view where ``[lo, hi)`` lies within one piece (a kernel run), else a slice."""
        lo, hi, _ = where.indices(self.numel())
        views = self.pieces.views(self.lo + lo, self.lo + hi)
        if len(views) == 1 and views[0][0] == 0 and views[0][1].numel() == hi - lo:
            return views[0][1]
        return PiecesSlice(self.pieces, self.lo + lo, self.lo + hi)

    def copy_(self, src: Tensor, non_blocking: bool = False) -> PiecesSlice:
        with torch.no_grad():
            for at, view in self.pieces.views(self.lo, self.hi):
                view.copy_(src[at : at + view.numel()], non_blocking=non_blocking)
        return self

    def materialize(self) -> Tensor:
        """A flat fp32 host copy (the gaps zero)."""
        out = torch.zeros(self.numel())
        for at, view in self.pieces.views(self.lo, self.hi):
            out[at : at + view.numel()].copy_(view)
        return out
