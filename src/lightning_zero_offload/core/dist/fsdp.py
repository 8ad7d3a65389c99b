"""FSDP2: a module ``fully_shard``-ed by PyTorch, its weights sharded over the data-parallel ranks.

FSDP2 owns the weights (each rank's local shards, in the run's half precision), their
all-gathers and the gradients' reduce-scatter; the engine owns the optimizer side of this rank's
local shards. Each rank's local shard is then the parameter the engine manages, as under tensor
parallelism (``core.dist.tensor_parallel``), and the engine's own partition is FSDP2's: it runs
over a process group of this rank alone (no reduce-scatter, no all-gather of its own), while the
global norm, the setup checks and checkpoints span every process (:class:`Fsdp`).

Public API only: units are found with ``isinstance(m, FSDPModule)``; reduced gradients arrive
through ``register_post_accumulate_grad_hook`` on the sharded parameters (FSDP2 calls it right
after a unit's reduce-scatter); new weights are written into ``DTensor.to_local()``, which the
next all-gather reads; accumulation without a reduction goes through
``set_requires_gradient_sync``. FSDP2's ``MixedPrecisionPolicy`` cannot be read back, so it is
checked where it shows: the dtype of the unsharded weights in a unit's first forward.

Supported: ``fully_shard`` per block and at the root, over a 1-D mesh or over the
``"data_parallel"`` dimension of a ``("data_parallel", "tensor_parallel")`` mesh whose other
dimension carries ``parallelize_module``. Refused at setup, by name: FSDP1
(``FullyShardedDataParallel``), HSDP (a replicated data-parallel dimension), ``fully_shard``
over another dimension, a shard placement other than dim 0 (``shard_placement_fn``), parameters
``fully_shard`` does not manage. With ``CPUOffloadPolicy`` (:func:`host_config`) the host shards are the master.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.dist import tensor_parallel
from lightning_zero_offload.core.dist.tensor_parallel import DP, TP, TensorParallel


def units(module: nn.Module) -> list[nn.Module]:
    """The ``fully_shard`` units in ``module``, outermost first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _refuse_fsdp1(module: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise ValueError("ZeroOffload: the module is wrapped in FSDP1's FullyShardedDataParallel, "
                         "which is not supported; shard it with FSDP2's fully_shard instead "
                         "(torch.distributed.fsdp.fully_shard), or pass the plain module")


@dataclass
class Fsdp(TensorParallel):
    """The sharded side of a ``fully_shard`` model: every process holds distinct local shards
    (``rank``: this rank's tensor-parallel coordinate, 0 without tensor parallelism; ``size``:
    every process), so the norm adds every process's sums, counting once what the
    tensor-parallel ranks hold alike (``whole``)."""

    units: list[nn.Module] = field(default_factory=list)

    @property
    def group(self) -> Any:
        return None  # every process

    def describe(self) -> dict:
        return {"fsdp": True, "rank": dist.get_rank(), "size": self.size,
                "mesh": list(self.mesh.mesh.shape)}

    def whole_value(self, param: Tensor, value: Tensor) -> Tensor:
        """Collective over the parameter's mesh: ``value`` (of ``param``'s local shape) whole."""
        if not isinstance(param, DTensor):
            return value
        whole = DTensor.from_local(value.to(param.to_local().device), param.device_mesh,
                                   param.placements, run_check=False, shape=param.shape,
                                   stride=torch.empty(param.shape, device="meta").stride())
        return whole.full_tensor().cpu()

    def local_value(self, param: Tensor, value: Tensor) -> Tensor:
        """``value`` (of ``param``'s whole shape) cut to this rank's local shard, as FSDP2 and
        DTensor cut it (no communication)."""
        if not isinstance(param, DTensor):
            return value
        cut = distribute_tensor(value.to(param.to_local().device), param.device_mesh,
                                param.placements, src_data_rank=None)
        return cut.to_local().cpu().contiguous()

    @contextlib.contextmanager
    def reducing(self, sync: bool) -> Iterator[None]:
        """Backward passes inside reduce-scatter when ``sync``, else FSDP2 accumulates their
        unsharded gradients on the device until one does."""
        if sync:
            yield
            return
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, sync: bool) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(sync, recurse=False)  # type: ignore[operator]

    def backward_order(self, order: dict[int, int], module: nn.Module) -> dict[int, int]:
        """``order`` (registration positions) as FSDP2's gradients arrive: unit by unit in
        reverse forward order, the root unit's own parameters last (FSDP2 reduces them in its
        final callback), and within a unit in registration order (its reduce-scatter hands them
        over all at once, in that order), so each bucket completes in turn."""
        unit_of = {id(p): u for u, unit in enumerate(self.units) for p in unit.parameters()}
        arrival = sorted(order, key=lambda pid: (-unit_of.get(pid, 0), order[pid]))
        return {pid: -i for i, pid in enumerate(arrival)}

    def check_forward_dtype(self, dtype: torch.dtype) -> list:
        """One-shot forward pre-hooks on every unit (after FSDP2's, which unshards it): the
        unsharded weights are in ``dtype``, else a ``MixedPrecisionPolicy`` disagrees with the
        engine's precision. Returns the handles."""
        handles: list = []

        def check(unit: nn.Module, _args: object) -> None:
            for name, p in unit.named_parameters():
                if not isinstance(p, DTensor) and p.dtype != dtype:
                    raise ValueError(
                        f"ZeroOffload: fully_shard computes {name!r} in {p.dtype} "
                        f"(MixedPrecisionPolicy(param_dtype={p.dtype})) but the engine's "
                        f"precision computes in {dtype}; drop the MixedPrecisionPolicy's "
                        f"param_dtype or set it to {dtype}")
            for h in handles:
                h.remove()
        handles += [u.register_forward_pre_hook(check) for u in self.units]
        return handles


def _placements_error(name: str, p: Tensor, tp_size: int, dp_name: str) -> str | None:
    """What is wrong with a sharded parameter's placements, or None."""
    if not isinstance(p, DTensor):
        return (f"parameter {name!r} is not sharded by fully_shard (apply fully_shard to the "
                "root module too, so FSDP2 manages every parameter)")
    names = tuple(p.device_mesh.mesh_dim_names or ())
    if any(isinstance(x, Replicate) for x in p.placements[:1]) or len(names) > 2:
        return (f"parameter {name!r} is replicated over a data-parallel dimension "
                f"(mesh {names}, placements {p.placements}): HSDP is not supported; use "
                "fully_shard over one data-parallel dimension")
    if tp_size > 1 and names and names[0] != dp_name:
        return (f"parameter {name!r} is sharded over mesh dimension {names[0]!r}; fully_shard "
                f"must run over the {dp_name!r} dimension (mesh[{dp_name!r}])")
    first = p.placements[0]  # Shard(0), or (over a tensor-parallel Shard(0)) a strided one
    if first.is_replicate() or first.is_partial() or getattr(first, "dim", None) != 0:
        return (f"parameter {name!r} has FSDP placement {first!r}; only fully_shard's default "
                "Shard(0) is supported (no shard_placement_fn)")
    return None


def setup(module: nn.Module, device_mesh: Any, process_group: Any,
          device: torch.device) -> tuple[TensorParallel | None, Any]:
    """``(sharded side or None, the engine's own process group)``: for a ``fully_shard`` model
    an :class:`Fsdp` and a group of this rank alone, else tensor parallelism's
    (``core.dist.tensor_parallel.setup``)."""
    _refuse_fsdp1(module)
    found = units(module)
    if not found:
        return tensor_parallel.setup(module, device_mesh, process_group)
    if process_group is not None:
        raise ValueError("ZeroOffload: a fully_shard model shards over its own mesh; do not pass "
                         "process_group=")
    tp_size, tp_rank, mesh, dp_name = 1, 0, None, DP
    if device_mesh is None:  # a 2-D mesh the model carries (Hugging Face's fsdp x tp): by position
        device_mesh = next((p.device_mesh for p in module.parameters()
                            if isinstance(p, DTensor) and p.device_mesh.ndim == 2), None)
        dp_name = (device_mesh.mesh_dim_names or (DP,))[0] if device_mesh is not None else DP
    elif device_mesh.ndim == 2 and tuple(device_mesh.mesh_dim_names or ()) != (DP, TP):
        raise ValueError(f"ZeroOffload: device_mesh has dimensions "
                         f"{device_mesh.mesh_dim_names}; with fully_shard pass a 1-D mesh "
                         f"or a 2-D one with dimensions {(DP, TP)}")
    if device_mesh is not None and device_mesh.ndim == 2:  # data-parallel x tensor-parallel
        tp_size, tp_rank, mesh = device_mesh.size(1), device_mesh.get_local_rank(1), device_mesh
    whole: set[int] = set()
    for name, p in module.named_parameters():
        problem = _placements_error(name, p, tp_size, dp_name)
        if problem is not None:
            raise ValueError(f"ZeroOffload: {problem}")
        assert isinstance(p, DTensor)  # _placements_error says so otherwise
        if tp_size > 1 and (p.device_mesh.ndim == 1 or p.placements[1].is_replicate()):
            whole.add(id(p))  # the tensor-parallel ranks hold the same shard
        mesh = mesh if mesh is not None else p.device_mesh
    rank = dist.get_rank()
    side = Fsdp(mesh, mesh, tp_rank, dist.get_world_size(), whole, units=found)
    return side, dist.new_group([rank], use_local_synchronization=True)


def host_config(side: TensorParallel | None, module: nn.Module, config: ZeroOffloadConfig,
                device: torch.device) -> ZeroOffloadConfig:
    """``config`` with ``offload_weights`` resolved: the ``fully_shard`` shards live on the host
    (``CPUOffloadPolicy``) and are the fp32 master the host step updates in place. Read from
    where the shards live on an accelerator; on the CPU compute device only ``True`` says so
    (FSDP2 has no public getter for its offload policy). Refuses what cannot combine."""
    want = config.offload_weights
    if not isinstance(side, Fsdp):
        if want:
            raise ValueError("ZeroOffload: offload_weights=True needs a model fully_shard-ed "
                             "with offload_policy=CPUOffloadPolicy() (FSDP2 keeps its weights "
                             "on the host); shard it so, or leave offload_weights unset")
        return config.replace(offload_weights=False)
    shards = [p.to_local() for p in module.parameters() if isinstance(p, DTensor)]
    on_host = all(t.device.type == "cpu" for t in shards)
    if device.type != "cpu" and want is not None and want != on_host:
        raise ValueError(
            f"ZeroOffload: offload_weights={want} but the fully_shard shards live "
            f"{'on the host' if on_host else 'on ' + str(device)}; "
            + ("leave offload_weights unset (the host shards are the master)" if on_host else
               "pass fully_shard(..., offload_policy=CPUOffloadPolicy()) to keep them on the "
               "host, or leave offload_weights unset"))
    host = on_host if device.type != "cpu" else bool(want)
    if not host:
        return config.replace(offload_weights=False)
    wrong = next((t.dtype for t in shards if t.dtype != torch.float32), None)
    if wrong is not None:
        raise ValueError(f"ZeroOffload: with CPUOffloadPolicy the fully_shard shards are the fp32 "
                         f"master, but they are {wrong}; keep the model in fp32 and compute in "
                         "half precision through MixedPrecisionPolicy(param_dtype=...)")
    if config.delayed_update:
        raise ValueError("ZeroOffload: delayed_update does not combine with CPUOffloadPolicy's "
                         "host weights (the host step overlaps the next forward exactly instead: "
                         "overlap_host_step); set delayed_update=False")
    if config.offload_fraction not in ("auto", 1, 1.0):
        raise ValueError(f"ZeroOffload: offload_fraction={config.offload_fraction!r} does not "
                         "combine with CPUOffloadPolicy's host weights (they and the whole "
                         "optimizer state live on the host); leave it unset")
    return config.replace(offload_weights=True, offload_fraction=1.0)
