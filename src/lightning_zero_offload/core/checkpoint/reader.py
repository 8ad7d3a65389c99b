"""The consolidated form of a sharded checkpoint, read a parameter at a time.

Loading shards into another world size or ``moment_dtype`` goes through the consolidated form;
``formats.consolidate`` builds it whole (a second copy of the state). :func:`lazy_full` builds
the same dict with ``stream.Later`` stand-ins instead: a parameter's fp32 master weights are a
view of the (memory-mapped) shard that holds them, or one parameter-sized tensor where they lie
across ranks; compact moments are converted one saved bucket shard at a time (the last kept).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero_offload.core.checkpoint import formats
from lightning_zero_offload.core.checkpoint.stream import Later


class ShardReader:
    """Values of the saved parameters, by kind (``"master"`` or a moment's name)."""

    def __init__(self, shards: list[dict]) -> None:
        self.desc = shards[0]["layout"]
        self.world = self.desc["world_size"]
        self.by_rank = {s["rank"]: s for s in shards}
        self._key: tuple[int, int, int] | None = None
        self._moments: tuple[Tensor, ...] | None = None

    def _piece(self, kind: str, r: int, g: int, host: int, size: int, lo: int, hi: int) -> Tensor:
        """Elements ``[lo, hi)`` of rank ``r``'s shard of a bucket at ``host``, in fp32."""
        shard = self.by_rank[r]
        if kind == "master":
            return shard["groups"][g]["master"][host + lo : host + hi]
        moments = formats.group_moments(shard, g)
        if moments.moment_dtype == "fp32":
            return getattr(moments, kind)[host + lo : host + hi]
        if self._key != (r, host, g) or self._moments is None:
            self._moments = None  # the previous bucket shard's goes first
            self._moments = moments.chunk(host, size).to_fp32()
            self._key = (r, host, g)
        return self._moments[moments.names.index(kind)][lo:hi]

    def value(self, kind: str, g: int, offset: int, numel: int, shape: tuple) -> Tensor:
        """The saved parameter at ``offset`` of group ``g``: a view where one rank holds it."""
        pieces = []
        for bg, start, bnumel, host in self.desc["buckets"]:
            if bg != g or not start <= offset < start + bnumel:
                continue
            size = bnumel // self.world
            for r in range(self.world):
                a = start + r * size
                lo, hi = max(offset, a), min(offset + numel, a + size)
                if lo < hi:
                    pieces.append((lo - offset, self._piece(kind, r, g, host, size, lo - a,
                                                            hi - a)))
        if len(pieces) == 1:
            return pieces[0][1].view(shape)
        out = torch.empty(numel)
        for at, piece in pieces:
            out[at : at + piece.numel()] = piece
        return out.view(shape)


def lazy_full(shards: list[dict]) -> dict:
    """``formats.consolidate(shards)``'s form, its tensors ``stream.Later`` stand-ins that read
    the shards when made (in any order)."""
    reader = ShardReader(shards)
    steps, rule = formats.param_steps(shards[0]), formats.shard_rule(shards[0])
    model: dict[str, Tensor | Later] = {}
    state: dict[int, dict] = {}
    for (name, g, index, offset, numel, shape), step in zip(reader.desc["params"], steps,
                                                          strict=True):
        def later(kind: str, g=g, offset=offset, numel=numel, shape=tuple(shape)) -> Later:
            return Later(shape, torch.float32, lambda: reader.value(kind, g, offset, numel, shape))

        model[name] = later("master")
        if step > 0:
            state[index] = {"step": torch.tensor(float(step)),
                            **{k: later(k) for k in rule.names}}
    param_groups, first = [], 0
    for hp, size in zip(shards[0]["param_groups"], reader.desc["group_sizes"], strict=True):
        param_groups.append({**hp, "params": list(range(first, first + size))})
        first += size
    return {"model": model, "optimizer": formats.optimizer_state(state, param_groups, rule)}
