"""The engine's state in and out: this rank's shard, the consolidated form, checkpoint folders.

:class:`EngineState` reads and writes the host buffers through the layout and this rank's place
in it; the step's counters (step counts, loss scaler) go through the step's own
``state_dict``/``load_state_dict``, the exact frozen weights through the device weights. It
knows nothing of streams. The formats are ``formats``'s, the files and atomic publish
``files``'s, the checks ``validation``'s, the cross-rank agreement ``agreement``'s. Calls that
gather across ranks say "Collective".

Under tensor parallelism or ``fully_shard`` the host state is this rank's share of its
DTensors' local shards: a shard (one file per process of the mesh) resumes at the same mesh
only (``fully_shard``'s even over one process); the consolidated form holds every tensor whole
(gathered a tensor at a time over the tensor-parallel group, every process under
``fully_shard``), so it loads into any mesh or a plain model, and a load cuts it back to this
rank's shards a tensor at a time (``places``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero_offload.core.buckets import shard_view
from lightning_zero_offload.core.buckets.buckets import Buckets
from lightning_zero_offload.core.buckets.layout import Layout, shard_pieces
from lightning_zero_offload.core.checkpoint import (
    agreement,
    files,
    formats,
    gather,
    pending,
    places,
    reader,
    stream,
    validation,
)
from lightning_zero_offload.core.checkpoint.gather import trim
from lightning_zero_offload.core.checkpoint.pending import PendingSave
from lightning_zero_offload.core.dist import collectives
from lightning_zero_offload.core.dist.fsdp import Fsdp
from lightning_zero_offload.core.dist.tensor_parallel import TensorParallel, local
from lightning_zero_offload.core.step.step import Stepper
from lightning_zero_offload.core.transfer.weights import DeviceWeights


class EngineState:
    def __init__(self, layout: Layout, rank: int, process_group: object | None,
                 buckets: Buckets, weights: DeviceWeights, stepper: Stepper,
                 module: nn.Module, param_groups: list[dict], precision: str) -> None:
        self.layout, self.rank, self.group = layout, rank, process_group
        self.world_size = layout.world_size
        assert buckets.arrays is not None
        self.buckets, self.host = buckets, buckets.arrays  # the host's: its rule and format
        self.weights, self.stepper = weights, stepper
        self.module, self.param_groups, self.precision = module, param_groups, precision
        self.group_sizes = list(layout.group_sizes)
        self.saves = pending.InFlight()  # an asynchronous save in flight

    @property
    def tp(self) -> TensorParallel | None:
        """The tensor-parallel side, when there is one of more than one rank."""
        tp = self.layout.tp
        return tp if tp is not None and tp.size > 1 else None

    def tp_describe(self) -> dict | None:  # fully_shard's even over one process: resumes there
        tp = self.layout.tp
        return tp.describe() if tp is not None and (tp.size > 1 or isinstance(tp, Fsdp)) else None

    @property
    def files_rank(self) -> tuple[int, int, Any]:
        """``(rank, world size, group)`` of checkpoint files and their agreement: every process
        of the mesh under tensor parallelism (each writes its shard), else the data-parallel
        group."""
        if self.tp is None:
            return self.rank, self.world_size, self.group
        return dist.get_rank(), dist.get_world_size(), None

    def _fill_module(self, values: dict[str, Tensor], *, strict: bool) -> None:
        """The module's tensors from ``values`` (under tensor parallelism: local shards); the
        stand-ins of trained ones are left to the master weights, pushed after a load."""
        if any(isinstance(v, stream.Later) for v in values.values()):
            values, strict = {k: v for k, v in values.items()
                              if not isinstance(v, stream.Later)}, False  # keys were checked
        if self.layout.tp is None:  # (fully_shard over one process: DTensors, tp None)
            self.module.load_state_dict(values, strict=strict)
            return
        for name, t in self.module.state_dict(keep_vars=True).items():
            if name in values:
                local(t).copy_(values[name])

    # -- this rank's shard --------------------------------------------------------------------
    def shard(self, *, to_write: bool = False) -> dict:
        """This rank's shard; ``to_write``: with a device part, its group tensors as stand-ins
        made a bucket at a time as they are written (else each joined in memory), and so the
        master where it is FSDP2's host shards."""
        counters = self.stepper.state_dict()
        tp = {"tensor_parallel": self.tp_describe()} if self.tp_describe() is not None else {}
        return {
            "format": formats.SHARD_FORMAT, "rank": self.rank, "world_size": self.world_size,
            **tp,
            "precision": self.precision, "layout": self.layout.describe(),
            "rule": self.host.rule.KEY, "rule_options": self.host.rule.options,
            "moment_dtype": shard_view.saved_moment_dtype(self.buckets),
            "groups": [{"step": counters["steps"][g], **self._group(g, to_write)}
                       for g in range(len(self.group_sizes))],
            "param_steps": counters["param_steps"],
            "param_groups": [formats.group_hparams(g) for g in self.param_groups],
            "scaler": counters["scaler"],
        }

    def _group(self, g: int, to_write: bool) -> dict:
        n = self.layout.group_shard_numel[g]

        def later(kind: str) -> stream.Later:
            return stream.Later((n,), torch.float32,
                                lambda: shard_view.group_pieces(self.buckets, g, kind))

        if to_write and self.buckets.device():
            return {kind: later(kind) for kind in ("master", *self.host.rule.names)}
        # FSDP2's host shards (CPUOffloadPolicy) are the master: a bucket at a time, not joined
        fsdp_host = not isinstance(self.host.master[g], Tensor)
        return {"master": later("master") if to_write and fsdp_host else
                shard_view.group_master(self.buckets, g),
                **formats.moments_fields(shard_view.group_moments(self.buckets, g))}

    def load_shard(self, state: dict) -> None:
        self.saves.settle()  # a save in flight reads the state this changes
        if self._converts_layout(state):
            self._load_converted(state)
            return
        validation.check_shard(state, self)
        for g, saved in enumerate(state["groups"]):
            shard_view.load_group(self.buckets, g, saved["master"],
                                  formats.group_moments(state, g))
        self.stepper.load_state_dict({
            "steps": [int(saved["step"]) for saved in state["groups"]],
            "param_steps": formats.param_steps(state), "scaler": state.get("scaler")})
        for group, hp in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(hp)

    def _converts_layout(self, state: object) -> bool:
        """A one-rank shard of another ``moment_dtype`` whose layout differs only because of it
        (8-bit moments pad buckets to whole blocks): loaded through the consolidated form."""
        return (isinstance(state, dict) and state.get("format") in formats.SHARD_FORMATS
                and self.tp is None and "tensor_parallel" not in state
                and self.world_size == 1 and state.get("world_size") == 1
                and formats.shard_moment_dtype(state) != self.host.moment_dtype
                and state.get("layout") != self.layout.describe())

    def _load_converted(self, state: dict) -> None:
        names = self.module.state_dict(keep_vars=True)
        numels = [formats.shard_numel(state["layout"], g) for g in range(len(state["groups"]))]
        validation.check_shard_groups(state, numels, "ZeroOffload.load_state_dict")
        full = reader.lazy_full([state])
        trained, untrained = self.weights.trained, self.weights.untrained()
        model = {k: full["model"][trained[id(v)]] if id(v) in trained else untrained[k]
                 for k, v in names.items()}
        self.load_full({**full, "model": model, "scaler": state.get("scaler")})

    # -- the consolidated form ----------------------------------------------------------------
    def gather_full(self, host: list[Tensor]) -> list[Tensor]:
        """Collective. Full fp32 flat buffers per group from every rank's shard of ``host``."""
        full = [torch.zeros(n) for n in self.layout.group_numel]
        coll = (collectives.collective_device(self.group, self.weights.dev.device)
                if self.world_size > 1 else None)
        for bucket in self.layout.buckets:
            g, size = bucket.group, bucket.shard
            mine = host[g][bucket.host_offset : bucket.host_offset + size]
            if self.world_size == 1:
                full[g][bucket.start : bucket.start + bucket.numel] = mine
                continue
            out = torch.empty(bucket.numel, device=coll)
            collectives.all_gather(out, mine.to(coll), self.group)
            full[g][bucket.start : bucket.start + bucket.numel] = out.cpu()
        return full

    def masters(self) -> list[Tensor]:
        """This rank's whole fp32 master shard per group, on the host."""
        return [shard_view.group_master(self.buckets, g) for g in range(len(self.group_sizes))]

    def full_later(self, *, model: bool, optimizer: bool) -> dict:
        """``ZeroOffload.full_state_dict()``'s form with ``stream.Later`` stand-ins for the
        trained tensors (``gather.full_later``)."""
        return gather.full_later(self, model=model, optimizer=optimizer)

    def load_full(self, state: dict) -> None:
        self.saves.settle()  # a save in flight reads the state this changes
        model, opt = places.cut(self, *validation.check_full(state, self))
        with torch.no_grad():
            self._fill_module(model, strict=True)
            self.weights.remember_frozen(model)
            states = opt["state"] if opt else {}
            steps, param_steps = [0] * len(self.group_sizes), []
            for s in self.layout.slots:
                n = int(states[s.index].get("step", 1)) if s.index in states else 0  # Lion
                param_steps.append(n)
                steps[s.group] = max(steps[s.group], n)
            self.stepper.load_state_dict({"steps": steps, "param_steps": param_steps,
                                          "scaler": state.get("scaler")})
            pieces: dict[int, list] = {}
            for piece in shard_pieces(self.layout, self.rank):
                pieces.setdefault(piece[0].bucket, []).append(piece)
            for bucket in self.buckets:  # one bucket shard at a time, loaded by the shard
                a, k, shard = bucket.host_offset, bucket.numel, bucket.shard
                state32 = [torch.zeros(k) for _ in self.host.rule.names]
                for slot, lo, hi, at in pieces.get(bucket.b, []):
                    sl = slice(at - a, at - a + hi - lo)
                    shard.load(stream.made(model[slot.name]).reshape(-1)[lo:hi], at=at - a)
                    st = states.get(slot.index)
                    if st:
                        for t, name in zip(state32, self.host.rule.names, strict=True):
                            t[sl] = stream.made(st[name]).reshape(-1)[lo:hi]
                shard.load(state32=tuple(state32))
                del state32
                trim()  # the bucket's temporaries, before the next bucket's
        if opt:
            for group, saved in zip(self.param_groups, opt["param_groups"], strict=True):
                group.update(formats.group_hparams(saved))

    # -- checkpoint files ---------------------------------------------------------------------
    def coll(self) -> torch.device:
        _, world, group = self.files_rank
        return (collectives.collective_device(group, self.weights.dev.device)
                if world > 1 else torch.device("cpu"))

    def agree(self, error: BaseException | None) -> None:
        _, world, group = self.files_rank
        agreement.agree(error, world, group, self.coll())

    def save(self, path: str | os.PathLike, *, sharded: bool, extra: dict[str, dict] | None = None,
             blocking: bool = True, owner: object = None) -> PendingSave | None:
        """Collective. See ``ZeroOffload.save_checkpoint``: an error on any rank raises on every
        rank, a failed save leaves nothing behind, an OS error names ``path``; ``owner`` lives
        while an asynchronous save is in flight (the engine: its process group)."""
        self.saves.settle()
        with files.writing(path := files.check_name(path)):
            if not blocking and threading.main_thread().is_alive():  # at exit: none settles it
                if sharded:
                    shard = {**self.shard(to_write=True), "module_extra": self.weights.untrained()}
                    started = pending.start_dir(self, path, shard, extra or {})
                else:
                    started = pending.start_file(
                        self, self.full_later(model=True, optimizer=True), path)
                if started is not None:
                    return self.saves.hold(started, owner)
            self._save(path, sharded, extra)
        return None

    def _save(self, path: Path, sharded: bool, extra: dict[str, dict] | None) -> None:
        rank, world, group = self.files_rank
        on_zero = rank == 0
        if not sharded:
            self._write_file(self.full_later(model=True, optimizer=True), path)
            return
        token, error = files.begin_dir(path) if on_zero else ("", None)
        token = agreement.share_token(token, world, group, self.coll())
        if error is not None or not token:
            raise error or formats.CheckpointError(
                f"rank 0 could not start the checkpoint at {str(path)!r} (see its error)")
        tmp = files.temp_path(path, "tmp", token)
        try:
            shard = {**self.shard(to_write=True), "module_extra": self.weights.untrained()}
            self.agree(agreement.capture(lambda: files.atomic_save(
                shard, tmp / files.shard_name(rank, world))))
            self.agree(agreement.capture(lambda: self._publish(tmp, path, token, world,
                                                                extra or {}))
                        if on_zero else None)
        finally:
            if on_zero:
                files.discard(tmp)  # left only if the save failed: nothing of it is kept

    def save_file(self, obj: dict, path: str | os.PathLike, blocking: bool = True,
                  owner: object = None) -> PendingSave | None:
        """Collective. ``obj`` (its stand-ins from :meth:`full_later` made as they are written)
        as one checksummed file that rank 0 writes; an error on any rank raises on every rank."""
        self.saves.settle()
        with files.writing(path := files.check_name(path)):
            if not blocking and threading.main_thread().is_alive():  # at exit: none settles it
                started = pending.start_file(self, obj, path)
                if started is not None:
                    return self.saves.hold(started, owner)
            self._write_file(obj, path)
        return None

    def _write_file(self, obj: dict, path: Path) -> None:
        on_zero = self.files_rank[0] == 0
        self.agree(agreement.capture(lambda: files.check_file_target(path)) if on_zero else None)
        try:
            self.agree(agreement.capture(lambda: files.atomic_save(obj, path) if on_zero
                                          else stream.make_all(obj)))
        finally:
            trim()

    @staticmethod
    def _publish(tmp: Path, path: Path, token: str, world: int, extra: dict[str, dict]) -> None:
        for name, obj in extra.items():
            files.atomic_save(obj, tmp / name)
        files.publish_dir(tmp, path, world, token)

    def load(self, path: str | os.PathLike) -> None:
        """Collective. What ``save`` wrote, at this or any other world size: everything is read
        and checked (checksums, model, layout) on every rank before anything changes; the
        caller pushes the weights."""
        self.saves.settle()
        loaded: list[tuple[str, dict]] = []
        self.agree(agreement.capture(lambda: loaded.append(self._read(files.resolve(path)))))
        kind, state = loaded[0]
        if self.tp is not None and self._anywhere(kind == "local"):
            # Uneven TP shards: this rank's layout may be the saved one while a peer's is not
            # (another moment_dtype pads its shards otherwise); the peer gathers whole tensors
            # over the TP group, so every rank goes the consolidated way (and agrees again).
            if kind == "shard":
                loaded.clear()
                error = agreement.capture(lambda: loaded.append(
                    self._read(files.resolve(path), consolidate=True)))
            else:
                error = None
            self.agree(error)
            kind, state = loaded[0]
        if kind == "shard":
            with torch.no_grad():
                self._fill_module(state["module_extra"], strict=False)
            self.weights.remember_frozen(state["module_extra"])
            self.load_shard(state)
        else:
            self.load_full(places.whole(self, state) if kind == "local" else state)

    def _anywhere(self, flag: bool) -> bool:
        """Collective: whether ``flag`` holds on any rank."""
        return bool(self.max_over_ranks(float(flag), "agreement on a checkpoint's path"))

    def max_over_ranks(self, value: float, what: str) -> float:
        """Collective over the checkpoint's ranks: the largest ``value``."""
        _, world, group = self.files_rank
        if world == 1:
            return value
        t = torch.tensor([value], device=self.coll())
        collectives.all_reduce(t, dist.ReduceOp.MAX, group, what)
        return float(t.item())

    def _read(self, path: Path, consolidate: bool = False) -> tuple[str, dict]:
        """``("shard", this rank's shard)``, ``("full", full state)`` or, under tensor
        parallelism, ``("local", the full state of this rank's local shards)``, validated;
        ``consolidate``: never ``"shard"``."""
        if not path.is_dir():
            full = files.safe_load(path)
            validation.check_full(full, self)
            return "full", full
        trained = self.weights.trained
        names = self.module.state_dict(keep_vars=True)
        expected = {k: (trained.get(id(v)), tuple(local(v).shape)) for k, v in names.items()}
        shards = files.read_shards(path, *self.files_rank[:2])
        validation.check_tensor_parallel(shards, self.tp_describe(), path)
        validation.validate_shards(shards, expected)
        if len(shards) == 1 and shards[0]["world_size"] == self.world_size:
            if shards[0]["layout"] == self.layout.describe() and not consolidate:
                validation.check_shard(shards[0], self)
                return "shard", shards[0]
            # Another layout at this world size (e.g. another moment_dtype: int8 pads buckets
            # to whole blocks): through the consolidated form, which needs every shard; under
            # tensor parallelism every data-parallel rank's of this rank's place (the rest is
            # another place's local shards), consolidated over the data-parallel ranks alone.
            place = shards[0].get("tensor_parallel")
            shards = [{k: v for k, v in s.items() if k != "tensor_parallel"} for s in
                      files.read_shards(path, -1, 0,
                                        lambda s: s.get("tensor_parallel") == place)]
            validation.validate_shards(shards, expected)
        # without tensor parallelism, read a parameter at a time (no second copy of the state)
        full = formats.consolidate(shards) if self.tp is not None else reader.lazy_full(shards)
        model = {k: full["model"][trained[id(v)]] if id(v) in trained else
                 shards[0]["module_extra"][k] for k, v in names.items()}
        full = {**full, "model": model, "scaler": shards[0]["scaler"]}
        if self.tp is not None:  # local shards: gathered whole after the agreement (collective)
            return "local", full
        validation.check_full(full, self)
        return "full", full
