"""Tensor parallelism: a module whose parameters are DTensors over a 2-D ``DeviceMesh``.

The engine treats such a module like any model, with each DTensor parameter's LOCAL shard as the
parameter: the layout, ZeRO-2 partition and reduce-scatter work over the data-parallel group
(the engine's process group), so host state per rank is 1/(DP x TP) of the model's. The global
gradient norm adds the tensor-parallel group's sums, counting what every tensor-parallel rank
holds whole (``Replicate()`` DTensors and plain parameters) once, from tensor-parallel rank 0.
The parameters stay DTensors with their placements (``parallelize_module``'s hooks need them);
their local tensors view the engine's flat buffers (:func:`bind`).

Supported: ``ColwiseParallel``/``RowwiseParallel`` plans (``Shard(0)``/``Shard(1)`` weights,
``Shard(0)`` or ``Replicate()`` biases) over the ``"tensor_parallel"`` dimension of a mesh
``("data_parallel", "tensor_parallel")``. Refused at setup, by name: sequence parallelism, loss
parallelism (DTensor outputs), other shardings, meshes of more than two dimensions, and a
``RowwiseParallel`` Linear whose input size does not divide by the tensor-parallel size.

A model that carries its own tensor parallelism (Hugging Face's ``from_pretrained(...,
tp_plan="auto")``: its ``tp_size`` and a ``tp_plan`` of style names, DTensor parameters over a
1-D mesh) needs no mesh: the mesh its parameters carry is the tensor-parallel one and the ranks
holding the same shards form the data-parallel group (one rank each when the mesh spans every
process). Its styles are checked by name (:data:`HF_STYLES`); the others are refused naming the
layer and the style.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard  # public from torch 2.4 (floor)

from lightning_zero_offload.core.dist import collectives

DP, TP = "data_parallel", "tensor_parallel"


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The plain tensor the engine manages: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def data_ptrs(tensors: Iterable[Tensor]) -> list[int]:
    """Where each tensor's local data lives, in order (one call for a whole model)."""
    return [local(t).data_ptr() for t in tensors]


def local_grad(param: Tensor, grad: Tensor) -> Tensor:
    """``param``'s gradient ``grad`` as the local shard of the parameter's own placements (a
    ``Partial()`` gradient of a replicated parameter is reduced over its group first)."""
    if not is_dtensor(grad):
        return grad
    if grad.placements != param.placements:  # type: ignore[union-attr]
        grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore
    return grad._local_tensor  # type: ignore[union-attr]


def bind_all(pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
    """:func:`bind` each ``(param, view)``."""
    for param, view in pairs:
        bind(param, view)


@torch.no_grad()
def bind(param: Tensor, view: Tensor) -> None:
    """``param`` (a DTensor or plain parameter) now holds ``view`` (local shape) as its data,
    in place (the same Python object, so the optimizer's references hold). A DTensor keeps its
    placements and takes ``view``'s dtype and device; nothing else that holds ``param`` (an
    autograd graph a traceback keeps alive, a user's list) stands in the way, where
    ``torch.utils.swap_tensors`` would refuse it."""
    if not is_dtensor(param):
        param.data = view
        return
    spec = param._spec  # type: ignore[attr-defined]
    if spec.tensor_meta.dtype != view.dtype or param.device != view.device:
        new = DTensor.from_local(view, param.device_mesh, param.placements,  # type: ignore
                                 run_check=False, shape=param.shape, stride=param.stride())
        param.data = new  # the wrapper's own dtype and device, as autograd sees them
        spec = new._spec
    param._spec, param._local_tensor = spec, view  # type: ignore[attr-defined]


@dataclass
class TensorParallel:
    """The tensor-parallel side of a 2-D mesh, for the layout, norm and checkpoints."""

    mesh: Any  # the 2-D DeviceMesh
    tp_mesh: Any
    rank: int  # this rank's tensor-parallel coordinate
    size: int
    whole: set[int] = field(default_factory=set)  # ids of parameters every TP rank holds whole

    @property
    def group(self) -> Any:
        return self.tp_mesh.get_group()

    @property
    def counts_all(self) -> bool:
        """Whether this rank's whole gradient shard counts in the global norm."""
        return self.rank == 0 or not self.whole

    def counted(self, layout: Any, sources: list[Tensor], rank: int) -> list[Tensor]:
        """The parts of this rank's gradient shards (per bucket, ``sources``) that count in the
        global norm: everything on tensor-parallel rank 0, the sharded parameters elsewhere."""
        if self.counts_all:
            return sources
        out: list[Tensor] = []
        for bucket, src in zip(layout.buckets, sources, strict=True):
            a, z = bucket.shard_range(rank)
            for i in bucket.slots:
                s = layout.slots[i]
                lo, hi = max(s.offset, a), min(s.offset + s.numel, z)
                if lo < hi and id(s.param) not in self.whole:
                    out.append(src[lo - a : hi - a])
        return out

    def describe(self) -> dict:
        """Where this rank's shards sit, as a sharded checkpoint records it."""
        return {"rank": self.rank, "size": self.size, "mesh": list(self.mesh.mesh.shape)}

    def whole_value(self, param: Tensor, value: Tensor) -> Tensor:
        """Collective over the tensor-parallel group when ``param`` is sharded: ``value`` (of
        ``param``'s local shape: its master weights, a moment) gathered whole, on the host."""
        if not is_dtensor(param) or not isinstance(param.placements[0], Shard):  # type: ignore
            return value
        dev = local(param).device
        whole = DTensor.from_local(value.to(dev), param.device_mesh,  # type: ignore[union-attr]
                                   param.placements, run_check=False,  # type: ignore
                                   shape=param.shape, stride=torch.empty(param.shape).stride())
        return whole.full_tensor().cpu()

    def local_value(self, param: Tensor, value: Tensor) -> Tensor:
        """``value`` (of ``param``'s whole shape) cut to this rank's shard, as DTensor cuts it
        (``torch.chunk``; ranks past the last chunk hold an empty one)."""
        if not is_dtensor(param) or not isinstance(param.placements[0], Shard):  # type: ignore
            return value
        dim = param.placements[0].dim  # type: ignore[union-attr]
        parts = value.chunk(self.size, dim=dim)
        if self.rank < len(parts):
            return parts[self.rank].contiguous()
        return value.narrow(dim, 0, 0).contiguous()

    def reduce_norm(self, local_sum: Tensor, op: Any) -> Tensor:
        """Collective over the tensor-parallel group: the norm's partial sums (or max) added."""
        t = local_sum.to(collectives.collective_device(self.group, local_sum.device))
        collectives.all_reduce(t, op, self.group, "all-reduce of the gradient norm over the "
                               "tensor-parallel group")
        return t


def _style_error(module_name: str, hook: Any) -> str | None:
    """What a ``parallelize_module`` hook of ``module_name`` does that the engine refuses."""
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            fn = cell.cell_contents
        except ValueError:
            continue
        if not isinstance(fn, functools.partial):
            continue
        style, _, what = getattr(fn.func, "__qualname__", "").partition(".")
        if style == "SequenceParallel":
            return f"SequenceParallel on {module_name!r}: sequence parallelism"
        layouts = [p for a in fn.args if isinstance(a, tuple) for p in a]
        sharded = any(isinstance(p, Shard) for p in layouts)
        if style == "ColwiseParallel" and what == "_prepare_input_fn" and sharded:
            return (f"ColwiseParallel(input_layouts=Shard(...)) on {module_name!r}: sequence "
                    "parallelism")
        if style in ("ColwiseParallel", "RowwiseParallel") and what == "_prepare_output_fn":
            if False in fn.args:
                return (f"{style}(use_local_output=False) on {module_name!r}: DTensor outputs "
                        "(loss parallelism)")
            if style == "RowwiseParallel" and sharded:
                return (f"RowwiseParallel(output_layouts=Shard(...)) on {module_name!r}: "
                        "sequence parallelism")
    return None


def _check_plan(module: nn.Module, tp_mesh: Any) -> set[int]:
    """Refuse what is not supported (by name); return the ids of the parameters held whole."""
    for name, m in module.named_modules():
        for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]:
            problem = _style_error(name or "module", hook)
            if problem is not None:
                raise ValueError(f"ZeroOffload: {problem} is not supported with ZeRO-Offload; "
                                 "use ColwiseParallel/RowwiseParallel with their default "
                                 "layouts (replicated activations between blocks)")
    whole = set()
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            whole.add(id(p))
            continue
        pm = p.device_mesh  # type: ignore[attr-defined]
        if (pm.mesh_dim_names != tp_mesh.mesh_dim_names
                or pm.mesh.tolist() != tp_mesh.mesh.tolist()):
            raise ValueError(
                f"ZeroOffload: parameter {name!r} is a DTensor over mesh {pm.mesh.tolist()} "
                f"{pm.mesh_dim_names}; only tensor parallelism over the mesh's {TP!r} dimension "
                "is supported (not FSDP's fully_shard: ZeRO-Offload partitions the data-parallel "
                "dimension itself)")
        place = p.placements[0]  # type: ignore[attr-defined]
        _check_divides(name, p, place, tp_mesh.size())
        if isinstance(place, Replicate):
            whole.add(id(p))
        elif not (isinstance(place, Shard) and place.dim in ((0, 1) if p.dim() == 2 else (0,))):
            raise ValueError(
                f"ZeroOffload: parameter {name!r} ({p.dim()}-D) has placement {place!r}; supported "
                "are the shardings of ColwiseParallel/RowwiseParallel (Shard(0) or Shard(1) of a "
                "weight, Shard(0) of a bias) and Replicate()")
    return whole


def _check_divides(name: str, p: Tensor, place: Any, size: int) -> None:
    """A Linear's weight sharded on its input dimension (RowwiseParallel) must cut it evenly:
    DTensor's matmul of an unevenly sharded input fails in the first forward (torch's "Sharding
    propagation failed for aten.addmm"), also without the engine. An embedding's rows (Shard(0))
    and a column-wise layer's outputs may be uneven."""
    if not (isinstance(place, Shard) and place.dim == 1 and p.dim() == 2):
        return
    n = p.shape[1]
    if n % size:
        module = name.rpartition(".")[0] or name
        raise ValueError(
            f"ZeroOffload: RowwiseParallel on {module!r}: its input size {n} does not divide by "
            f"the tensor-parallel size {size}, and torch's DTensor cannot multiply an unevenly "
            f"sharded input (the first forward would fail in aten.addmm). Use an input size that "
            f"divides by {size} (e.g. {-(-n // size) * size}), or keep the uneven dimension on "
            "an embedding or a ColwiseParallel layer's output")


def _chunk_sizes(n: int, parts: int) -> list[int]:
    """How DTensor's ``Shard`` cuts ``n`` rows over ``parts`` ranks (``torch.chunk``: the first
    ranks get ceil(n / parts), the last ones what is left, possibly nothing)."""
    step = -(-n // parts)
    return [max(0, min(step, n - r * step)) for r in range(parts)]


def _local_desc(p: Tensor, tp: TensorParallel) -> str:
    """A parameter's shards as every rank describes them alike (uneven shards included); a
    local shard of another size than DTensor's cut adds this rank's shape, so it shows up."""
    place = p.placements[0] if is_dtensor(p) else None  # type: ignore[attr-defined]
    if not isinstance(place, Shard):
        return ""
    sizes = _chunk_sizes(p.shape[place.dim], tp.size)
    want = (*p.shape[:place.dim], sizes[tp.rank], *p.shape[place.dim + 1:])
    have = tuple(local(p).shape)
    return f" chunks {sizes}" + (f" local {have} (expected {want})" if have != want else "")


def _agree(module: nn.Module, mesh: Any, tp: TensorParallel) -> None:
    """Collective over every process: the same mesh, placements and cut of each sharded
    parameter (its chunk sizes, equal on every rank even when uneven), and the same dtypes and
    buffers (the broadcast over the tensor-parallel group that follows sends them all)."""
    desc = [f"mesh {tuple(mesh.mesh.shape)} {mesh.mesh_dim_names} {mesh.mesh.tolist()}"]
    desc += [f"parameter {n!r}: {tuple(p.shape)} {p.dtype} {getattr(p, 'placements', 'plain')}"
             f"{_local_desc(p, tp)}" for n, p in module.named_parameters()]
    desc += [f"buffer {n!r}: {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    mine = (hashlib.sha256("\n".join(desc).encode()).hexdigest(), desc)
    every = collectives.gather_objects("setup check of the device mesh", mine)
    for r, (digest, other) in enumerate(every):
        if digest != every[0][0]:
            diff = next((f"{b} where rank 0 has {a}" for a, b in zip(every[0][1], other,
                                                                      strict=False) if a != b),
                        f"{len(other) - 1} parameters and buffers where rank 0 has "
                        f"{len(every[0][1]) - 1}")
            raise ValueError(f"ZeroOffload: the ranks' device meshes or tensor-parallel plans "
                             f"differ: rank {r} has {diff}. Build the same mesh and call "
                             "parallelize_module with the same plan on every rank.")


# Hugging Face's tensor-parallel styles (``transformers.distributed.tensor_parallel``) that are
# ColwiseParallel/RowwiseParallel/embedding shardings with replicated activations between
# layers; why others are refused.
HF_STYLES = {"colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep",
             "rowwise_split_input", "embedding_rowwise", "embedding_colwise", "replicate"}
_FUSED, _UNIT = "strided shards of a fused weight", "parameters over a second, per-head mesh"
_HF_REFUSED = {
    "sequence_parallel": "sequence parallelism", "moe_tp_experts": "expert parallelism",
    "replicated_with_grad_allreduce": "its hook all-reduces gradients the engine took already",
    "packed_colwise": _FUSED, "packed_rowwise": _FUSED, "unit_colwise": _UNIT,
    "unit_rowwise": _UNIT}


def _carried_mesh(module: nn.Module) -> Any:
    """The 1-D tensor-parallel mesh of a model that carries its own plan (Hugging Face's
    ``tp_size`` > 1 and ``tp_plan``), its styles checked by name; None for any other model."""
    size, plan = getattr(module, "tp_size", None), getattr(module, "tp_plan", None)
    if not isinstance(size, int) or size < 2 or not isinstance(plan, dict):
        return None
    names = [n for n, _ in module.named_modules()] + [n for n, _ in module.named_parameters()]
    for pattern, style in plan.items():
        key = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        layer = next((n for n in names if key.fullmatch(n)), None)
        if style not in HF_STYLES and layer is not None:  # (plans name absent layers too)
            why = _HF_REFUSED.get(style, "a style the engine does not know")
            raise ValueError(f"ZeroOffload: tensor-parallel style {style!r} on {layer!r} ({why}) "
                             f"is not supported with ZeRO-Offload; supported styles: "
                             f"{sorted(HF_STYLES)}")
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()): (n, p.device_mesh)
              for n, p in module.named_parameters() if isinstance(p, DTensor)}
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes.values()))[1].ndim != 1:
        raise ValueError("ZeroOffload: the model's tensor-parallel parameters lie on other "
                         "meshes than one 1-D mesh: " + ", ".join(
                             f"{n!r} on {m.mesh_dim_names} {m.mesh.tolist()}"
                             for n, m in meshes.values()))
    return next(iter(meshes.values()))[1]


def _around(tp_mesh: Any) -> Any:
    """A 2-D ``(data_parallel, tensor_parallel)`` mesh whose tensor-parallel groups are
    ``tp_mesh``'s (collective: every process builds it)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, size = dist.get_world_size(), tp_mesh.size()
    mesh = (init_device_mesh(tp_mesh.device_type, (world // size, size), mesh_dim_names=(DP, TP))
            if world % size == 0 else None)
    if mesh is None or mesh[TP].mesh.tolist() != tp_mesh.mesh.tolist():
        raise ValueError(
            f"ZeroOffload: the model's tensor-parallel mesh holds ranks {tp_mesh.mesh.tolist()} "
            f"of {world}; supported are groups of {size} consecutive ranks (the tensor-parallel "
            f"dimension of init_device_mesh(device, (data_parallel, {size})))")
    return mesh


def setup(module: nn.Module, device_mesh: Any, process_group: Any
          ) -> tuple[TensorParallel | None, Any]:
    """``(tensor-parallel side or None, the data-parallel process group)`` for the engine."""
    carried = _carried_mesh(module)
    if carried is not None and device_mesh is None:
        if process_group is not None:
            raise ValueError("ZeroOffload: the model's tensor-parallel mesh sets the data-parallel "
                             "group; do not pass process_group=")
        return _setup_2d(module, _around(carried), carried)
    if device_mesh is None:
        bad = next((n for n, p in module.named_parameters() if is_dtensor(p)), None)
        if bad is not None:
            raise ValueError(f"ZeroOffload: parameter {bad!r} is a DTensor; pass the 2-D mesh "
                             f"as ZeroOffload(..., device_mesh=mesh) with dimensions {(DP, TP)}")
        return None, process_group
    if process_group is not None:
        raise ValueError("ZeroOffload: pass device_mesh= or process_group=, not both (the "
                         f"mesh's {DP!r} dimension is the data-parallel group)")
    names = tuple(device_mesh.mesh_dim_names or ())
    if device_mesh.ndim == 1:
        if carried is not None:
            raise ValueError("ZeroOffload: the model carries its tensor-parallel mesh, which sets "
                             "the data-parallel group; pass no device_mesh")
        setup(module, None, None)  # DTensor parameters need the 2-D mesh
        return None, device_mesh.get_group()
    if device_mesh.ndim > 2 or names != (DP, TP):
        raise ValueError(
            f"ZeroOffload: device_mesh has {device_mesh.ndim} dimensions {names}; supported are "
            f"a 1-D data-parallel mesh or a 2-D mesh with dimensions {(DP, TP)} (pipeline "
            "parallelism and meshes of more dimensions are not supported)")
    if device_mesh.size() != dist.get_world_size():
        raise ValueError(f"ZeroOffload: the device mesh has {device_mesh.size()} ranks but "
                         f"{dist.get_world_size()} processes run; build it over every process "
                         "(init_device_mesh(device, (data_parallel, tensor_parallel)))")
    if carried is not None and carried.mesh.tolist() != device_mesh[TP].mesh.tolist():
        raise ValueError(
            f"ZeroOffload: the model's tensor-parallel mesh holds ranks {carried.mesh.tolist()}, "
            f"device_mesh[{TP!r}] ranks {device_mesh[TP].mesh.tolist()} (from_pretrained builds "
            "the mesh it shards over itself); pass no device_mesh, the engine takes the model's")
    return _setup_2d(module, device_mesh, device_mesh[TP] if carried is None else carried)


def _setup_2d(module: nn.Module, device_mesh: Any, tp_mesh: Any) -> tuple[TensorParallel, Any]:
    """The tensor-parallel side over ``tp_mesh`` (``device_mesh[TP]``, or the 1-D mesh the
    parameters carry) and ``device_mesh``'s data-parallel group."""
    tp = TensorParallel(device_mesh, tp_mesh, tp_mesh.get_local_rank(), tp_mesh.size(),
                        _check_plan(module, tp_mesh))
    _agree(module, device_mesh, tp)
    if tp.size > 1:  # what every tensor-parallel rank holds whole starts from TP rank 0's values
        src = dist.get_global_rank(tp.group, 0)
        with torch.no_grad():
            for p in [*module.parameters(), *module.buffers()]:
                if id(p) in tp.whole or (not is_dtensor(p) and p.is_floating_point()):
                    t = local(p).detach().to(collectives.collective_device(tp.group, p.device))
                    collectives.broadcast(t, src, tp.group, "broadcast of replicated weights")
                    local(p).copy_(t)
    return tp, device_mesh[DP].get_group()
