"""The 2-D device mesh of the strategies: ``data_parallel_size`` x ``tensor_parallel_size``, with
``ModelParallelStrategy``'s argument names and dimension names (``"data_parallel"``,
``"tensor_parallel"``), so a LightningModule written for that strategy (its ``configure_model``
parallelizes itself over ``self.device_mesh["tensor_parallel"]``) runs here unchanged.

The Trainer strategy hands its mesh to the LightningModule the way ``ModelParallelStrategy``
does (:func:`hand_over`), so ``configure_model`` may also ``fully_shard`` over
``self.device_mesh["data_parallel"]`` (FSDP2; the engine then steps each rank's local shards).
With ``offload_policy=CPUOffloadPolicy()`` the shards live on the host and the engine steps them
in place; on a GPU it sees that from where they live, on the CPU the strategy's config says
``offload_weights=True``.

"auto" differs in one place: with both sizes "auto" the run stays data-parallel only (tensor
parallel size 1), as the strategy always was; with one size given, "auto" is the rest of the
world (``ModelParallelStrategy`` would put every device of a node into one tensor-parallel
group by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero_offload.core.dist.tensor_parallel import DP, TP

Size = Literal["auto"] | int


def resolve_sizes(data_parallel_size: Size, tensor_parallel_size: Size,
                  world_size: int) -> tuple[int, int]:
    """``(data-parallel size, tensor-parallel size)`` for ``world_size`` processes."""
    for name, v in (("data_parallel_size", data_parallel_size),
                    ("tensor_parallel_size", tensor_parallel_size)):
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"ZeroOffloadStrategy: {name} must be 'auto' or a positive int, "
                             f"got {v!r}")
    dp, tp = data_parallel_size, tensor_parallel_size
    if tp == "auto":
        tp = 1 if dp == "auto" else world_size // int(dp)
    if dp == "auto":
        dp = world_size // int(tp)
    dp, tp = int(dp), int(tp)
    if dp * tp != world_size:
        raise ValueError(
            f"ZeroOffloadStrategy: data_parallel_size={data_parallel_size!r} x "
            f"tensor_parallel_size={tensor_parallel_size!r} must equal the number of processes "
            f"({world_size} = devices x num_nodes); got {dp} x {tp}")
    return dp, tp


def build_mesh(device_type: str, dp: int, tp: int) -> Any:
    """The mesh over every process (collective: after the process group exists)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(DP, TP))


def mesh_for(sizes: tuple[Size, Size], world_size: int, device_type: str) -> Any:
    """The strategies' mesh for ``(data_parallel_size, tensor_parallel_size)``: None when both
    are "auto" (data parallel only), else :func:`build_mesh` (collective)."""
    if sizes == ("auto", "auto"):
        return None
    return build_mesh(device_type, *resolve_sizes(*sizes, world_size))


def hand_over(strategy: Any, sizes: tuple[Size, Size]) -> Any:
    """The Trainer strategy's mesh for ``(data_parallel_size, tensor_parallel_size)`` (None when
    both are "auto"), given to its LightningModule as ``self.device_mesh`` for
    ``configure_model`` (collective: after the process group exists).

    ``LightningModule.device_mesh`` is read-only: Lightning's ``ModelParallelStrategy`` hands the
    mesh over in its ``setup_environment``. So one is made here over ``strategy``'s devices,
    cluster environment and module, and its public ``setup_environment`` builds the mesh and
    hands it over (the process group already exists: it joins that one). No private attribute
    of Lightning is touched."""
    if sizes == ("auto", "auto"):
        return None
    dp, tp = resolve_sizes(*sizes, strategy.world_size)
    module = strategy.lightning_module
    if module is None:  # nothing to hand over to
        return build_mesh(strategy.root_device.type, dp, tp)
    from lightning.pytorch.strategies import ModelParallelStrategy

    lender = ModelParallelStrategy(dp, tp, process_group_backend=strategy.process_group_backend)
    lender.accelerator = strategy.accelerator
    lender.parallel_devices = strategy.parallel_devices
    lender.cluster_environment = strategy.cluster_environment
    lender.num_nodes = strategy.num_nodes
    lender.connect(module)
    lender.setup_environment()
    return lender.device_mesh


def sampler_kwargs(mesh: Any) -> dict[str, int]:
    """The DistributedSampler's part: tensor-parallel ranks of one data-parallel rank read the
    same batches."""
    sub = mesh[DP]
    return {"num_replicas": sub.size(), "rank": sub.get_local_rank()}


def parallelize(fn: Callable[[Module, Any], Module], module: Module, mesh: Any,
                optimizer: Optimizer | None = None) -> Module:
    """``fn(module, mesh)`` (Fabric's ``parallelize_fn``). ``parallelize_module`` replaces each
    parameter by a DTensor one, so an ``optimizer`` built over the module before is pointed at
    the new parameters, by name."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out = fn(module, mesh)
    if not isinstance(out, Module):
        raise TypeError(f"parallelize_fn must return the parallelized module, got {type(out)}")
    if optimizer is None:
        return out
    if optimizer.state:
        raise ValueError("ZeroOffloadFabricStrategy(parallelize_fn=...): the optimizer has "
                         "already stepped; pass a fresh one to fabric.setup(model, optimizer)")
    new = dict(out.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        try:
            group["params"] = [new[names[id(p)]] for p in group["params"]]
        except KeyError:
            raise ValueError("ZeroOffloadFabricStrategy(parallelize_fn=...): the optimizer holds "
                             "a parameter that is not the module's, or parallelize_fn renamed "
                             "one; build the optimizer over model.parameters()") from None
    return out
