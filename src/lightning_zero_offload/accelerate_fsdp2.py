"""Accelerate's FSDP2 (``fsdp_version: 2``) under ZeRO-Offload: Accelerate shards, the engine steps.

``ZeroOffloadPlugin.prepare`` lets Accelerate prepare the model and its optimizer as it does for
FSDP2 (``fully_shard`` per block by its auto-wrap policy, then the root, with the
``MixedPrecisionPolicy`` of ``mixed_precision``; the optimizer switched to the sharded
parameters) and builds the engine over them (``core.dist.fsdp``): FSDP2 keeps each rank's weight
shards on the device in the run's half precision, the engine their fp32 master and the optimizer
state on the host. With ``fsdp_offload_params`` (FSDP2's ``CPUOffloadPolicy``) the shards live on
the host in fp32 and are the master: the engine steps them in place (``offload_weights``, set
from the plugin by :func:`engine_config`). Refused before anything is sharded, by name: FSDP1
and HSDP.

Checkpoints: Accelerate's FSDP branches of ``save_state``/``load_state`` write the model and the
optimizer through torch's distributed checkpoint, which steps an optimizer that holds no state
to create one (here an engine step). The engine's shards hold both already (master weights,
buffers, optimizer state), so those branches do not see the engine's model and optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero_offload.core import ZeroOffloadConfig

if TYPE_CHECKING:
    from accelerate import Accelerator


def check(accelerator: Accelerator) -> None:
    """What the engine cannot run with Accelerate's FSDP, refused before anything is sharded."""
    if not accelerator.is_fsdp2:
        raise ValueError("ZeRO-Offload combines with FSDP2, not FSDP1 (FullyShardedDataParallel): "
                         "set fsdp_version: 2 in the FSDP config, or launch without ZERO_OFFLOAD=1")
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and pc.dp_replicate_enabled:
        raise ValueError(f"ZeRO-Offload does not support HSDP (parallelism_config dp_replicate_"
                         f"size={pc.dp_replicate_size}): shard over one data-parallel dimension")


def engine_config(accelerator: Accelerator, config: ZeroOffloadConfig) -> ZeroOffloadConfig:
    """``config`` with ``offload_weights`` as Accelerate's plugin says: True with
    ``fsdp_offload_params`` (the engine cannot read FSDP2's policy back, and on a CPU compute
    device the shards' place does not tell it), else as ``config`` has it."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = isinstance(getattr(accelerator.state.fsdp_plugin, "cpu_offload", None),
                         CPUOffloadPolicy)
    if not offload or config.offload_weights:
        return config
    if config.offload_weights is False:
        raise ValueError("ZeRO-Offload: offload_weights=False contradicts FSDP2's "
                         "fsdp_offload_params (CPUOffloadPolicy: the weights live on the host); "
                         "drop one of them")
    return dataclasses.replace(config, offload_weights=True)


def shard(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Accelerate's own FSDP2 preparation of ``model`` and ``optimizer``: the sharded model and
    the user's optimizer over its sharded parameters (Accelerate's wrapper of it is dropped: the
    engine's takes its place)."""
    sharded, wrapper = accelerator.prepare(model, optimizer)
    accelerator._optimizers[:] = [o for o in accelerator._optimizers if o is not wrapper]
    return sharded, wrapper.optimizer


def keep_out_of_fsdp_checkpoints(accelerator: Accelerator, module: nn.Module,
                                 optimizer: torch.optim.Optimizer) -> None:
    """``accelerator.save_state``/``load_state`` without ``module`` and ``optimizer`` in
    Accelerate's lists while they run (the hooks the plugin registers save and load the engine's
    shards)."""
    for name in ("save_state", "load_state"):
        setattr(accelerator, name, _without(accelerator, module, optimizer,
                                            getattr(accelerator, name)))


def _without(accelerator: Accelerator, module: nn.Module, optimizer: torch.optim.Optimizer,
             method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        models, optimizers = list(accelerator._models), list(accelerator._optimizers)
        accelerator._models[:] = [m for m in models if m is not module]
        accelerator._optimizers[:] = [o for o in optimizers if o is not optimizer]
        try:
            return method(*args, **kwargs)
        finally:
            accelerator._models[:], accelerator._optimizers[:] = models, optimizers
    return call
