"""``Fabric(strategy="zero_offload")``: the engine behind ``fabric.setup(model, optimizer)``.

``fabric.backward``, ``optimizer.step()``/``zero_grad()``, ``fabric.clip_gradients(max_norm=...)``,
``fabric.no_backward_sync`` and ``fabric.save``/``fabric.load`` all reach the engine. The module
is not wrapped in DDP; the engine reduces and partitions gradients itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero_offload.core import ZeroOffload, ZeroOffloadConfig
from lightning_zero_offload.lightning import checkpoint as ckpt
from lightning_zero_offload.lightning import mesh as tp_mesh
from lightning_zero_offload.lightning.common import (
    EngineOwner,
    Scheduler,
    norm_clipping_only,
    retarget_scheduler,
)
from lightning_zero_offload.lightning.precision import (
    ZeroOffloadFabricPrecision,
    as_engine_plugin,
)


class ZeroOffloadFabricStrategy(EngineOwner, DDPStrategy):
    """ZeRO-Offload for Fabric; same options as :class:`ZeroOffloadStrategy`.

    Set up the model and its one optimizer (any the engine supports) together:
    ``fabric.setup(model, opt)``.
    ``fabric.setup(model)`` alone (evaluation) just moves the module to the device. The module
    holds the device weights while training; ``fabric.save`` writes the fp32 master weights, and
    ``fabric.strategy.teardown()`` (collective) puts them back into the module at the end.

    Tensor parallelism and FSDP2 as with Fabric's ``ModelParallelStrategy``: ``parallelize_fn(
    module, device_mesh)`` (``parallelize_module`` over ``device_mesh["tensor_parallel"]``,
    ``fully_shard`` over ``device_mesh["data_parallel"]``) runs in ``fabric.setup``, over the 2-D
    mesh of ``data_parallel_size`` x ``tensor_parallel_size`` (both "auto", the default: data
    parallel only; one "auto": the rest of the processes). An optimizer built over the plain
    module is pointed at the parallelized parameters. With a ``parallelize_fn``, that strategy's
    order works too: ``model = fabric.setup(model)``, the optimizer over ``model.parameters()``,
    ``fabric.setup_optimizers(optimizer)`` (the engine starts there).
    """

    strategy_name = "zero_offload"

    def __init__(
        self,
        config: ZeroOffloadConfig | None = None,
        *,
        sharded_checkpoint: bool = False,
        async_checkpoint: bool = False,
        parallelize_fn: Callable[[Module, Any], Module] | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **config_overrides: object,
    ) -> None:
        self._init_engine_owner(config, sharded_checkpoint, config_overrides, async_checkpoint)
        self._parallelize_fn = parallelize_fn
        self._mesh_sizes = (data_parallel_size, tensor_parallel_size)
        self._device_mesh: Any = None
        self._parallelized: Module | None = None  # set up alone, for setup_optimizers to train
        if parallelize_fn is not None and self._mesh_sizes == ("auto", "auto"):
            raise ValueError("ZeroOffloadFabricStrategy: parallelize_fn needs a mesh: set "
                             "tensor_parallel_size (and data_parallel_size, or leave it 'auto')")
        self._default_precision = ZeroOffloadFabricPrecision("32-true")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=self.process_group_timeout(timeout),
            start_method=start_method,
        )
        self._backward_sync_control = _EngineBackwardSync(self)

    @property
    @override
    def precision(self) -> ZeroOffloadFabricPrecision:
        # a set _precision means "chosen by the user" to Fabric's connector: keep defaults apart
        plugin = self._precision  # the setter only stores ours or None
        return plugin if isinstance(plugin, ZeroOffloadFabricPrecision) else self._default_precision

    @precision.setter
    @override
    def precision(self, plugin: Precision | None) -> None:
        self._precision = as_engine_plugin(plugin, ZeroOffloadFabricPrecision)

    # -- setup ---------------------------------------------------------------------------------

    @property
    def device_mesh(self) -> Any:
        """The 2-D ``DeviceMesh`` (after the processes start) when a size was given, else None."""
        return self._device_mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._device_mesh = tp_mesh.mesh_for(self._mesh_sizes, self.world_size,
                                             self.root_device.type)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._device_mesh is None:
            return super().distributed_sampler_kwargs
        return tp_mesh.sampler_kwargs(self._device_mesh)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Scheduler | None = None
    ) -> tuple[Module, list[Optimizer], Scheduler | None]:
        if self._parallelize_fn is not None:
            module = tp_mesh.parallelize(self._parallelize_fn, module, self._device_mesh,
                                         *optimizers[:1])
        optimizer, engine = self._train(module, optimizers)
        if scheduler is not None:
            retarget_scheduler(scheduler, optimizer, engine.optimizer)
        return engine.module, [engine.optimizer], scheduler

    def _train(self, module: Module, optimizers: list[Optimizer]) -> tuple[Optimizer, ZeroOffload]:
        precision = self.precision.precision  # the engine starts every rank from rank 0's
        optimizer, engine = self._start_engine(module, optimizers, precision,
                                               f"Fabric(precision={precision!r})",
                                               self.root_device)
        self.precision.engine = engine
        return optimizer, engine

    @override
    def setup_module(self, module: Module) -> Module:
        """Without an optimizer there is nothing to offload: the module (parallelized, with a
        ``parallelize_fn``) just goes to the device; with a ``parallelize_fn``, a later
        ``setup_optimizers`` trains it."""
        if self._parallelize_fn is not None:
            module = tp_mesh.parallelize(self._parallelize_fn, module, self._device_mesh)
            self._parallelized = module
        return module.to(self.root_device)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Fabric's ``ModelParallelStrategy`` order (a ``parallelize_fn`` only): the engine
        starts over the module ``setup_module`` parallelized, with this optimizer over it."""
        if self._parallelized is None:
            raise NotImplementedError(self._err_msg_joint_setup_required())
        return self._train(self._parallelized, [optimizer])[1].optimizer

    @override
    def module_to_device(self, module: Module) -> None:
        """A no-op: the engine places the module itself, in the compute dtype (see setup)."""

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.ExitStack:
        """``fabric.init_module()`` builds the model on the host: the engine moves it to the
        device in the compute dtype (a fp32 model on the device would defeat the offload)."""
        stack = contextlib.ExitStack()
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(torch.device("cpu"))
        return stack

    @override
    def teardown(self) -> None:
        self._stop_engine()
        self._parallelized = None
        super().teardown()

    # -- clipping ------------------------------------------------------------------------------

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self._engine()
        norm = self.precision._clip(float(max_norm), float(norm_type))
        if error_if_nonfinite and not self.precision.skips_nonfinite_steps:
            if not torch.isfinite(norm):
                raise RuntimeError(
                    f"The total norm of order {norm_type} of the gradients is non-finite; pass "
                    "error_if_nonfinite=False to fabric.clip_gradients to skip this check"
                )
        return norm

    @override
    def clip_gradients_value(
        self, module: Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        raise norm_clipping_only("Use fabric.clip_gradients(model, optimizer, max_norm=...)")

    def _engine(self) -> ZeroOffload:
        if self.engine is None:
            raise RuntimeError("Call fabric.setup(model, optimizer) before using the optimizer")
        return self.engine

    # -- checkpoints ---------------------------------------------------------------------------

    def _owned(self, obj: object) -> bool:
        engine = self.saving_engine
        return engine is not None and (obj is engine.module or obj is engine.optimizer)

    def _owned_keys(self, state: dict[str, Any]) -> dict[str, str]:
        """The keys of a ``fabric.save``/``load`` state holding the engine's "model" or
        "optimizer"."""
        engine = self.saving_engine
        if engine is None:
            return {}
        return {key: "model" if obj is engine.module else "optimizer"
                for key, obj in state.items() if self._owned(obj)}

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        owned = self._owned_keys(state)
        if not owned:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        engine = self.saving_engine
        assert engine is not None
        if filter and set(filter) & set(owned):
            raise ValueError("fabric.save(filter=...) cannot filter the offloaded model/optimizer")
        rest = {k: v for k, v in state.items() if k not in owned}
        converted = self._convert_stateful_objects_in_state(rest, filter=filter or {})
        if self.sharded_checkpoint:
            converted[_OWNED] = owned
            ckpt.save_sharded(engine, converted, path, self)
            self.barrier("zero_offload_save")
            return
        kinds = set(owned.values())  # gather only what is saved (the weights are a third)
        full = engine.consolidated(model="model" in kinds, optimizer="optimizer" in kinds)
        entries = {"model": full.get("model")}
        if "optimizer" in full:
            entries["optimizer"] = ckpt.optimizer_entry(full)
        converted.update({key: entries[kind] for key, kind in owned.items()})
        ckpt.save_single(engine, converted, path, self, storage_options)  # collective

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        self.wait_for_save()  # the save in flight may be the file asked for
        if self._owned(state):
            raise ValueError(
                "Load the offloaded model and optimizer through a dict: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        owned = self._owned_keys(state) if isinstance(state, dict) else {}
        if ckpt.is_sharded(path):
            if not owned:
                raise ValueError("A sharded zero_offload checkpoint loads into the set-up model")
            checkpoint = ckpt.load_sharded_meta(path, weights_only)
            self._engine().load_checkpoint(checkpoint.pop(ckpt.SHARDED_KEY))
            checkpoint.pop(_OWNED, None)
        elif not isinstance(state, (dict, type(None))):
            # A module or optimizer of the user's own, from a file of its own.
            return super().load_checkpoint(path, state, strict, weights_only)
        else:  # also without the offloaded objects: the checksum is verified and removed
            load = ckpt.single_loader(self.checkpoint_io, path, weights_only, functools.partial(
                self.checkpoint_io.load_checkpoint, path, weights_only=weights_only))
            checkpoint = ckpt.load_single(path, load, owned)
            entries = {kind: checkpoint.pop(key) for key, kind in owned.items()}
            if entries and "model" not in entries:
                raise ValueError("Load the optimizer state together with its model")
            if entries:
                self._engine().load_full_state_dict(
                    ckpt.full_state(entries["model"], entries.get("optimizer"))
                )
        if not isinstance(state, dict):
            return checkpoint
        rest = {k: v for k, v in state.items() if k not in owned}
        missing = [k for k in rest if k not in checkpoint]
        if strict and missing:
            raise KeyError(
                f"The requested state contains a key {missing[0]!r} that does not exist in the "
                "loaded checkpoint. To disable strict loading, set `strict=False`."
            )
        for name, obj in rest.items():
            if name in checkpoint:
                if isinstance(obj, Module):
                    obj.load_state_dict(checkpoint.pop(name), strict=strict)
                elif isinstance(obj, _Stateful):
                    obj.load_state_dict(checkpoint.pop(name))
                else:
                    state[name] = checkpoint.pop(name)
        return checkpoint



_OWNED = "zero_offload_owned_keys"  # sharded Fabric meta: which keys held the model/optimizer


class _EngineBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients stay local until a synced backward."""

    def __init__(self, strategy: ZeroOffloadFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled or self._strategy.engine is None:
            return contextlib.nullcontext()
        return self._strategy.engine.no_sync()
