"""``Trainer(strategy="zero_offload")``: the Lightning strategy around the ZeroOffload engine.

It subclasses ``DDPStrategy`` for the launcher, process-group setup, barrier and reduce, but never
wraps the model in DDP: the engine reduces (and partitions) the gradients itself while streaming
them to the host. The engine is built in ``setup`` right after ``configure_optimizers``, takes over
the optimizer, and its facade (whose ``param_groups`` are the user's group dicts, so LR schedulers
and ``LearningRateMonitor`` act on the live values) becomes the Trainer's optimizer."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_zero_offload.core import ZeroOffloadConfig
from lightning_zero_offload.core.device.profile import FIELDS
from lightning_zero_offload.core.dist import collectives
from lightning_zero_offload.core.dist.fsdp import Fsdp
from lightning_zero_offload.lightning import checkpoint as ckpt
from lightning_zero_offload.lightning import mesh as tp_mesh
from lightning_zero_offload.lightning.common import (
    EngineOwner,
    broadcast_start_weights,
    check_clip_algorithm,
    retarget_scheduler,
    with_config_fields,
)
from lightning_zero_offload.lightning.precision import ZeroOffloadPrecision, as_engine_plugin


def accumulate_steps(trainer: Trainer) -> int:
    """The most backward passes per optimizer step this fit will run: ``accumulate_grad_batches``
    or, with a ``GradientAccumulationScheduler`` (which sets it epoch by epoch), its largest
    factor; the engine then allocates the fp32 gradient at setup, not mid-run."""
    factors = [int(trainer.accumulate_grad_batches)]
    callbacks = getattr(trainer, "callbacks", [])  # a property pyright does not see
    factors += [max(cb.scheduling.values()) for cb in callbacks
                if isinstance(cb, GradientAccumulationScheduler)]
    return max(factors)


class ZeroOffloadStrategy(EngineOwner, DDPStrategy):
    """ZeRO-Offload for the Lightning Trainer: fp32 masters and Adam moments on the host.

    Args:
        config: engine options (:class:`~lightning_zero_offload.ZeroOffloadConfig`); its fields
            may also be passed as keyword shortcuts, e.g. ``ZeroOffloadStrategy(cpu_threads=8)``.
            The precision comes from ``Trainer(precision=...)``: ``"32-true"``,
            ``"bf16-mixed"`` or ``"16-mixed"`` (a config whose ``precision`` is set must agree).
        sharded_checkpoint: a checkpoint is a directory of one file per rank (its partition of
            the master weights and Adam state), not one consolidated file (fp32 master weights
            under ``"state_dict"``: ``load_from_checkpoint`` works without this strategy).
        async_checkpoint: a save returns once the state is copied to host memory (where it
            fits; else it blocks, with a warning), a thread writes it; ``AsyncCheckpointIO``: no.
            Loads wait for it; ``strategy.wait_for_save()`` waits explicitly.
        data_parallel_size, tensor_parallel_size: as in Lightning's ``ModelParallelStrategy``: a
            2-D ``DeviceMesh`` ("data_parallel", "tensor_parallel") that ``configure_model`` gets
            as ``self.device_mesh`` to parallelize itself (``parallelize_module`` over
            ``["tensor_parallel"]``; the engine partitions each rank's local shards over the
            data-parallel group) and/or shard itself (``fully_shard`` over
            ``["data_parallel"]``: FSDP2 shards the weights, the engine steps each rank's
            shards). One "auto" is the rest of the processes; both "auto" (the default): data
            parallel only, no mesh (``lightning_zero_offload.lightning.mesh``).
        timeout: of the process group the strategy starts (the framework's own collectives,
            such as Lightning's per-batch broadcast): default ``config.collective_timeout_s``,
            so a failed rank ends its peers within that time, not the usual 30 minutes.

    Remaining arguments are ``DDPStrategy``'s (launcher, cluster environment, process group).
    After each optimizer step that updated the weights, the strategy logs (on step, to the
    loggers, not the progress bar) the pre-clip global gradient norm as ``zero_offload/grad_norm``
    (also ``strategy.grad_norm``) and the engine's step profile in milliseconds:
    ``zero_offload/fwd_bwd_ms``, ``grad_wait_ms``, ``cpu_step_ms``, ``weight_copy_ms`` (CUDA
    only) and ``stall_ms`` (see ``core.device.profile.StepProfile``). The profile is the newest step
    whose timings are all in: with delayed update, or while weight copies still run on CUDA, it
    is an earlier step's. Gradients never stay on the device, so ``param.grad`` is ``None`` in
    hooks such as ``on_before_optimizer_step``.
    """

    strategy_name = "zero_offload"

    @with_config_fields
    def __init__(
        self,
        config: ZeroOffloadConfig | None = None,
        *,
        sharded_checkpoint: bool = False,
        async_checkpoint: bool = False,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **config_overrides: object,
    ) -> None:
        self._init_engine_owner(config, sharded_checkpoint, config_overrides, async_checkpoint)
        self._logged_profile = 0  # the engine step whose profile was logged last
        self._mesh_sizes = (data_parallel_size, tensor_parallel_size)
        self._device_mesh: Any = None
        self._default_precision = ZeroOffloadPrecision("32-true")
        self._failure: BaseException | None = None  # the error ending this fit (on_exception)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.process_group_timeout(timeout),
            start_method=start_method,
        )

    # -- precision: every plugin Lightning picks becomes ours, or a clear error --------------

    @property
    @override
    def precision_plugin(self) -> ZeroOffloadPrecision:
        # the default is kept apart: a set _precision_plugin means "chosen by the user" to
        # Lightning's connector, which would then ignore Trainer(precision=...)
        plugin = self._precision_plugin  # the setter only stores ours or None
        return plugin if isinstance(plugin, ZeroOffloadPrecision) else self._default_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = as_engine_plugin(plugin, ZeroOffloadPrecision)

    # -- behaviour switches --------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the built engine: the fp32 masters live there."""
        return True

    @property
    def grad_norm(self) -> Tensor | None:
        """The last pre-clip global gradient norm (all ranks, kept after ``fit()``), else None."""
        return self.precision_plugin.grad_norm

    # -- setup / teardown ----------------------------------------------------------------------

    @property
    def device_mesh(self) -> Any:
        """The 2-D ``DeviceMesh`` (after the processes start) when a size was given, else None."""
        return self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._device_mesh is None:
            return super().distributed_sampler_kwargs
        return tp_mesh.sampler_kwargs(self._device_mesh)

    @override
    def setup_distributed(self) -> None:
        # DDP re-seeds every process here (and so does the mesh's hand-off); with one process the
        # default strategy does not, so keep the random state (same shuffle, dropout and data
        # order as without offload).
        states = _collect_rng_states() if self.keeps_user_sampler else None
        super().setup_distributed()
        self._device_mesh = tp_mesh.hand_over(self, self._mesh_sizes)  # configure_model's
        if states is not None:
            _set_rng_states(states)

    @property
    def keeps_user_sampler(self) -> bool:
        """With one process the DataLoader keeps its own sampler (Lightning would wrap it in a
        shuffling DistributedSampler because this strategy is DDP-based, changing the data
        order from the default strategy's); several processes get the distributed one."""
        return self.num_nodes * self.num_processes == 1  # known before the ranks are set

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._failure = None  # a run whose teardown never came does not fail this one
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.keeps_user_sampler:  # one process: the same batches as the default strategy
            trainer._accelerator_connector.use_distributed_sampler = False
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        if not fitting:  # evaluation: the fp32 module on the device, nothing to offload
            self.model_to_device()  # (when fitting, the engine starts every rank from rank 0's)
            broadcast_start_weights(self.model, self.root_device)
        if fitting:
            self.setup_optimizers(trainer)
            self._build_engine(trainer)
        self.setup_precision_plugin()

    def _build_engine(self, trainer: Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if trainer.gradient_clip_val:
            check_clip_algorithm(trainer.gradient_clip_algorithm)
        if self.config.max_grad_norm is not None and trainer.gradient_clip_val:
            raise ValueError(
                "Set clipping once: either Trainer(gradient_clip_val=...) or "
                "ZeroOffloadStrategy(max_grad_norm=...), not both"
            )
        precision = self.precision_plugin.precision
        optimizer, engine = self._start_engine(module, self.optimizers, precision,
                                               f"Trainer(precision={precision!r})",
                                               self.root_device, accumulate_steps(trainer))
        for lr_config in self.lr_scheduler_configs:
            retarget_scheduler(lr_config.scheduler, optimizer, engine.optimizer)
        self.optimizers = [engine.optimizer]
        self.precision_plugin.engine = engine
        self._logged_profile = 0

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None:
            return super().training_step(*args, **kwargs)
        # under tensor parallelism the forward runs DTensor's collectives: a lost peer is named
        with collectives.reported("forward of the training step",
                                  engine.tp.group if engine.tp is not None else None):
            return super().training_step(*args, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.engine is None:  # during fit the engine places the module (in the compute dtype)
            self.model.to(self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning's handler of a fit's error calls this, then teardown. Not sys.exc_info() in
        # teardown: a fit called inside the user's own `except` block would look failed.
        self._failure = exception
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        # That error must surface as itself (moving DTensor parameters with .cpu() fails while
        # its traceback holds a graph)
        failure, first, self._failure = self._failure, None, None
        for step in (functools.partial(self._stop_engine, failure), super().teardown):
            try:
                step()
            except Exception as e:
                if first is not None:  # logged; the first error is the news
                    collectives.raise_unless_failing(e, first)
                first = first or e
        collectives.raise_unless_failing(first, failure)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()`` builds the model on the host: the engine moves it to the
        device in the compute dtype (a fp32 model on the device would defeat the offload)."""
        with _EmptyInit(enabled=bool(empty_init)), torch.device("cpu"):
            yield

    @override
    def on_validation_start(self) -> None:
        if self.engine is not None:  # validate on up-to-date device weights
            self.engine.synchronize()

    # -- per-step logging ----------------------------------------------------------------------

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
        model: LightningModule | Module | None = None, **kwargs: Any
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_step()
        return output

    def _log_step(self) -> None:
        """The grad norm and the newest finished step profile, after a step that happened."""
        engine, module = self.engine, self.lightning_module
        # Lightning runs the step in its optimizer_step hook, or in training_step when manual
        if engine is None or engine.last_step_skipped or module is None or (
            module._current_fx_name not in ("optimizer_step", "training_step")
        ):
            return
        metrics = {}
        if engine.last_grad_norm is not None:
            metrics["zero_offload/grad_norm"] = engine.last_grad_norm
        prof = engine.finished_profile()  # never waits for the device
        if prof is not None and prof.step > self._logged_profile and prof.cpu_step > 0:
            self._logged_profile = prof.step
            metrics.update({f"zero_offload/{k}_ms": 1e3 * getattr(prof, k) for k in FIELDS})
        if metrics:  # host tensors: a Python float would be copied to the device, synchronously
            module.log_dict(
                {k: torch.tensor(v) for k, v in metrics.items()}, on_step=True, on_epoch=False,
                prog_bar=False, logger=bool(module.trainer.loggers),
            )

    # -- backward sync for accumulation --------------------------------------------------------

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of an accumulation keep their gradients local. Under FSDP2
        each is reduced, as under ``ModelParallelStrategy`` (kept, they would be the whole
        model's unsharded gradients on every device); the engine adds them up on the host."""
        if self.engine is None or isinstance(self.engine.tp, Fsdp):
            yield
            return
        with self.engine.no_sync():
            yield

    # -- checkpoints ---------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        engine = self.saving_engine
        if engine is None:
            return super().lightning_module_state_dict()
        if self.sharded_checkpoint:
            return {}  # every rank writes its partition in save_checkpoint
        # collective: every rank takes part; the weights only (a weights-only checkpoint never
        # asks for the optimizer state, which optimizer_state gathers)
        return engine.consolidated(optimizer=False)["model"]  # made as save_checkpoint writes

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        engine = self.saving_engine
        if engine is None:
            return super().optimizer_state(optimizer)
        if self.sharded_checkpoint:
            return {}
        return ckpt.optimizer_entry(engine.consolidated(model=False))  # collective when written

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        engine = self.saving_engine
        if engine is not None and self.sharded_checkpoint:
            ckpt.save_sharded(engine, checkpoint, filepath, self)
            self.barrier("zero_offload_save")
            return
        if engine is not None:  # collective: the stand-ins are made as rank 0 writes them
            ckpt.save_single(engine, checkpoint, filepath, self, storage_options)
            return
        if self.is_global_zero:  # the rank that writes it
            checkpoint = ckpt.with_checksum(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        self.wait_for_save()  # the save in flight may be the file asked for
        if ckpt.is_sharded(checkpoint_path):
            return ckpt.load_sharded_meta(checkpoint_path, weights_only)
        load = functools.partial(super().load_checkpoint, checkpoint_path,
                                 weights_only=weights_only)
        load = ckpt.single_loader(self.checkpoint_io, checkpoint_path, weights_only, load)
        return ckpt.load_single(checkpoint_path, load, ["state_dict"])

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            if ckpt.SHARDED_KEY in checkpoint:
                raise RuntimeError(
                    "A sharded zero_offload checkpoint loads when resuming fit; for evaluation, "
                    "consolidate it first: lightning_zero_offload.lightning."
                    "consolidate_checkpoint(directory, 'model.ckpt')"
                )
            assert self.lightning_module is not None
            ckpt.load_weights(self.lightning_module, checkpoint["state_dict"], strict)
        # with an engine, the weights load together with the optimizer state (below), since
        # load_full_state_dict needs both

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.engine is not None
        if ckpt.SHARDED_KEY in checkpoint:
            self.engine.load_checkpoint(checkpoint[ckpt.SHARDED_KEY])
            return
        (optimizer_state,) = checkpoint["optimizer_states"]
        self.engine.load_full_state_dict(ckpt.full_state(checkpoint["state_dict"], optimizer_state))

    # -- registration --------------------------------------------------------------------------

