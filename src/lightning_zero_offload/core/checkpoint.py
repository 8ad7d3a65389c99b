"""The engine's state in and out: this rank's shard, the consolidated form, checkpoint folders.

:class:`EngineState` reads and writes the host buffers, step counts and loss scaler through the
layout and this rank's place in it; it knows nothing of streams or the step. File formats and
atomic I/O are ``core.state``'s. Calls that gather across ranks say "Collective".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero_offload.core import checks
from lightning_zero_offload.core import state as ckpt
from lightning_zero_offload.core.host import HostBuffers
from lightning_zero_offload.core.layout import Layout, shard_pieces
from lightning_zero_offload.core.step import Stepper
from lightning_zero_offload.core.weights import DeviceWeights

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _host_copy(t: Tensor) -> Tensor:
    """A module buffer or untrained tensor for the full state: on the host, floats in fp32."""
    t = t.detach().cpu()
    return t.float() if t.is_floating_point() else t.clone()


class EngineState:
    def __init__(self, layout: Layout, rank: int, process_group: object | None,
                 host: HostBuffers, weights: DeviceWeights, stepper: Stepper,
                 module: nn.Module, param_groups: list[dict], precision: str) -> None:
        self.layout, self.rank, self.group = layout, rank, process_group
        self.world_size = layout.world_size
        self.host, self.weights, self.stepper = host, weights, stepper
        self.module, self.param_groups, self.precision = module, param_groups, precision
        self.group_sizes = list(layout.group_sizes)

    # -- this rank's shard --------------------------------------------------------------------
    def shard(self) -> dict:
        scaler = self.stepper.scaler
        return {
            "format": ckpt.SHARD_FORMAT, "rank": self.rank, "world_size": self.world_size,
            "precision": self.precision, "layout": self.layout.describe(),
            "groups": [
                {"step": self.stepper.steps[g], "master": self.host.master[g],
                 "exp_avg": self.host.exp_avg[g], "exp_avg_sq": self.host.exp_avg_sq[g]}
                for g in range(len(self.group_sizes))
            ],
            "param_groups": [ckpt.group_hparams(g) for g in self.param_groups],
            "scaler": scaler.state_dict() if scaler else None,
        }

    def load_shard(self, state: dict) -> None:
        checks.check_shard(state, self)
        with torch.no_grad():
            for g, saved in enumerate(state["groups"]):
                self.host.master[g].copy_(saved["master"])
                self.host.exp_avg[g].copy_(saved["exp_avg"])
                self.host.exp_avg_sq[g].copy_(saved["exp_avg_sq"])
                self.stepper.steps[g] = int(saved["step"])
        for group, hp in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(hp)
        self._load_scaler(state)

    def _load_scaler(self, state: dict) -> None:
        if self.stepper.scaler is not None and state.get("scaler"):
            self.stepper.scaler.load_state_dict(state["scaler"])

    # -- the consolidated form ----------------------------------------------------------------
    def gather_full(self, host: list[Tensor]) -> list[Tensor]:
        """Collective. Full fp32 flat buffers per group from every rank's shard of ``host``."""
        full = [torch.zeros(n) for n in self.layout.group_numel]
        coll = (checks.collective_device(self.group, self.weights.dev.device)
                if self.world_size > 1 else None)
        for bucket in self.layout.buckets:
            g, size = bucket.group, bucket.shard
            mine = host[g][bucket.host_offset : bucket.host_offset + size]
            if self.world_size == 1:
                full[g][bucket.start : bucket.start + bucket.numel] = mine
                continue
            out = torch.empty(bucket.numel, device=coll)
            _all_gather(out, mine.to(coll), group=self.group)
            full[g][bucket.start : bucket.start + bucket.numel] = out.cpu()
        return full

    def untrained(self) -> dict[str, Tensor]:
        """Buffers and frozen parameters, on the host; frozen ones exact."""
        frozen, trained = self.weights.frozen, self.weights.trained
        return {name: frozen[id(t)].clone() if id(t) in frozen else _host_copy(t)
                for name, t in self.module.state_dict(keep_vars=True).items()
                if id(t) not in trained}

    def remember_frozen(self, state: dict[str, Tensor]) -> None:
        """After a load into the module: keep the exact values of its frozen parameters."""
        frozen = self.weights.frozen
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in frozen and name in state:
                frozen[id(t)].copy_(state[name])

    def full(self, *, model: bool, optimizer: bool) -> dict:
        """Collective. See ``ZeroOffload.full_state_dict``."""
        keys = ("master",) * model + ("exp_avg", "exp_avg_sq") * optimizer
        flats = {k: self.gather_full(getattr(self.host, k)) for k in keys}
        hparams = [ckpt.group_hparams(g) for g in self.param_groups]
        out = ckpt.assemble(self.layout.describe(), flats, list(self.stepper.steps), hparams)
        full: dict[str, Any] = {"format": ckpt.FULL_FORMAT}
        trained = self.weights.trained
        if model:  # keyed like module.state_dict(): buffers and untrained tensors too
            untrained = self.untrained()
            full["model"] = {
                name: out["model"][trained[id(t)]] if id(t) in trained else untrained[name]
                for name, t in self.module.state_dict(keep_vars=True).items()
            }
        if optimizer:
            full["optimizer"] = out["optimizer"]
        scaler = self.stepper.scaler
        full["scaler"] = scaler.state_dict() if scaler else None
        return full

    def load_full(self, state: dict) -> None:
        model, opt = checks.check_full(state, self)
        with torch.no_grad():
            self.module.load_state_dict(model, strict=True)
            self.remember_frozen(model)
            states = opt["state"] if opt else {}
            for g in range(len(self.group_sizes)):
                steps = [int(states[s.index]["step"]) for s in self.layout.slots
                         if s.group == g and s.index in states]
                self.stepper.steps[g] = max(steps, default=0)
            host = self.host
            for slot, lo, hi, at in shard_pieces(self.layout, self.rank):
                sl = slice(at, at + hi - lo)
                host.master[slot.group][sl] = model[slot.name].reshape(-1)[lo:hi]
                st = states.get(slot.index)
                for buf, key in ((host.exp_avg, "exp_avg"), (host.exp_avg_sq, "exp_avg_sq")):
                    buf[slot.group][sl] = st[key].reshape(-1)[lo:hi] if st else 0.0
        if opt:
            for group, saved in zip(self.param_groups, opt["param_groups"], strict=True):
                group.update(ckpt.group_hparams(saved))
        self._load_scaler(state)

    # -- checkpoint files ---------------------------------------------------------------------
    def save(self, path: str | os.PathLike, *, sharded: bool) -> None:
        """Collective. See ``ZeroOffload.save_checkpoint``."""
        path = Path(path)
        if not sharded:
            full = self.full(model=True, optimizer=True)
            if self.rank == 0:
                ckpt.atomic_save(full, path)
            self.barrier()
            return
        tmp = path.with_name(path.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        ckpt.atomic_save({**self.shard(), "module_extra": self.untrained()},
                         tmp / ckpt.shard_name(self.rank, self.world_size))
        self.barrier()
        if self.rank == 0:
            ckpt.publish_dir(tmp, path)
        self.barrier()

    def load(self, path: str | os.PathLike) -> None:
        """What ``save`` wrote, at this or any other world size (the caller pushes weights)."""
        path = Path(path)
        if path.is_dir():
            mine = path / ckpt.shard_name(self.rank, self.world_size)
            if mine.is_file():
                shard = ckpt.safe_load(mine)
                self.module.load_state_dict(shard["module_extra"], strict=False)
                self.remember_frozen(shard["module_extra"])
                self.load_shard(shard)
                return
            shards = ckpt.read_shard_dir(path)
            full = ckpt.consolidate(shards)
            trained = self.weights.trained
            names = self.module.state_dict(keep_vars=True)
            model = {k: full["model"][trained[id(v)]] if id(v) in trained else
                     shards[0]["module_extra"].get(k) for k, v in names.items()}
            self.load_full({**full, "model": model, "scaler": shards[0]["scaler"]})
            return
        if not path.exists():
            raise ckpt.CheckpointError(f"no checkpoint at {str(path)!r}")
        self.load_full(ckpt.safe_load(path))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
