"""Argument checks of the engine: the device, the optimizer, the module and the inputs' dtype;
every bad input gets a clear error that says what to do. (The hyperparameters' checks at each
step are the update rule's, ``core.rules.rule``; a checkpoint's are
``core.checkpoint.validation``'s.)"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.optimizer import OffloadOptimizer
from lightning_zero_offload.core.rules import rules
from lightning_zero_offload.core.rules.rule import Rule


def engine_config(config: ZeroOffloadConfig | None, overrides: dict) -> ZeroOffloadConfig:
    """The engine's config: ``config`` (default ``ZeroOffloadConfig()``) with ``overrides``,
    its precision resolved."""
    config = config if config is not None else ZeroOffloadConfig()
    if not isinstance(config, ZeroOffloadConfig):
        raise TypeError(f"ZeroOffload: config must be a ZeroOffloadConfig, got {type(config)}")
    # a copy, validated again: a field changed after construction is checked here too
    return config.replace(**overrides).resolve_precision()


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"ZeroOffload: device={device} but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu":
        # "cpu:0" (Accelerate's CPU device) is the same memory; keeping the index would make
        # `module.to` copy the parameters away from the flat buffer they must stay views of.
        device = torch.device("cpu")
    else:
        raise ValueError(f"ZeroOffload: device must be a CUDA device or the CPU, got {device}")
    return device


_warned_unpinned = False  # once per process


def resolve_pinned(pin_memory: bool | None, device: torch.device) -> bool:
    """Pinned host staging: by default exactly when the compute device is a GPU."""
    global _warned_unpinned
    if pin_memory and device.type != "cuda":
        raise ValueError("ZeroOffload: pin_memory=True needs a CUDA compute device")
    if pin_memory is False and device.type == "cuda" and not _warned_unpinned:
        _warned_unpinned = True
        warnings.warn(
            "ZeroOffload: pin_memory=False on CUDA makes every gradient and weight copy "
            "synchronous (pageable host memory): backward and the next forward wait for each "
            "transfer instead of overlapping it, and copies run at a fraction of the PCIe "
            "bandwidth; leave pin_memory at its default unless pinned memory cannot be had",
            stacklevel=3)
    return device.type == "cuda" if pin_memory is None else pin_memory


def current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` is the current CUDA device inside (nothing to do elsewhere)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_open(closed: bool) -> None:
    """An engine's call after ``teardown()`` is a clear error."""
    if closed:
        raise RuntimeError(
            "ZeroOffload: this engine was torn down (teardown(), or the end of a framework's "
            "fit), so its optimizer state is gone; save before teardown, or create a new "
            "engine (the module holds the trained fp32 weights)")


def rank_and_world(group: object | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)  # type: ignore[arg-type]
    return 0, 1


def check_optimizer(optimizer: torch.optim.Optimizer) -> Rule:
    """Validate the user's optimizer; return its update rule. The one optimizer check of the
    engine and every adapter (which optimizers the rules take: ``core.rules.rules``)."""
    if isinstance(optimizer, OffloadOptimizer):
        raise TypeError("ZeroOffload: this optimizer already belongs to a ZeroOffload engine")
    return rules.rule_for(optimizer)


def check_params(module: nn.Module, optimizer: torch.optim.Optimizer
                 ) -> tuple[list[list[bool]], dict[int, int], dict[int, str]]:
    """Trainable flags per group slot, registration order and first name of each parameter."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"ZeroOffload: module must be an nn.Module, got {type(module).__name__}")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ValueError(
                f"ZeroOffload: {name or 'module'} produces sparse gradients (sparse=True), which "
                "are not supported; use sparse=False"
            )
    named = list(module.named_parameters())
    order = {id(p): i for i, (_, p) in enumerate(named)}
    names = {id(p): n for n, p in named}
    in_opt = set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in order:
                raise ValueError(
                    f"ZeroOffload: optimizer param group {gi} holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of the module; build the optimizer "
                    "from this module's parameters"
                )
            if p.layout != torch.strided:
                raise ValueError(f"ZeroOffload: parameter {names[id(p)]!r} is sparse; use dense")
            if not p.is_floating_point():
                raise TypeError(f"ZeroOffload: parameter {names[id(p)]!r} is not floating point")
            if p.is_meta:
                raise ValueError(
                    f"ZeroOffload: parameter {names[id(p)]!r} is on the meta device (no data); "
                    "materialize the model first (model.to_empty(device='cpu') and initialize "
                    "or load its weights) and build the optimizer from the result")
            if id(p) in in_opt:
                raise ValueError(
                    f"ZeroOffload: parameter {names[id(p)]!r} appears twice in the optimizer's "
                    "param groups; list every parameter once")
            in_opt.add(id(p))
    left_out = [n for n, p in named if p.requires_grad and id(p) not in in_opt]
    if left_out:
        warnings.warn(
            f"ZeroOffload: {len(left_out)} parameter(s) require grad but are in no optimizer group "
            f"(e.g. {left_out[0]!r}); they are not trained. Set requires_grad=False on them.",
            stacklevel=3,
        )
    trainable = [[p.requires_grad for p in g["params"]] for g in optimizer.param_groups]
    return trainable, order, names


def check_unchanged(groups: list[dict], setup_groups: list[list], module: nn.Module,
                    num_params: int) -> None:
    """The optimizer's groups and the module's parameters are still those of setup."""
    if len(groups) != len(setup_groups) or any(
        len(g["params"]) != len(ref)
        or any(p is not q for p, q in zip(g["params"], ref, strict=True))
        for g, ref in zip(groups, setup_groups, strict=True)
    ):
        raise RuntimeError(
            "ZeroOffload: the optimizer's parameters changed after setup (added, removed or "
            "replaced); create the optimizer with all parameters before ZeroOffload")
    if len(list(module.parameters())) != num_params:
        raise RuntimeError(
            "ZeroOffload: the module gained or lost parameters after setup; add all "
            "submodules before creating ZeroOffload")


def cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in (nested tuples/lists/dicts of) ``x`` cast to ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple):
        items = [cast_floats(v, dtype) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [cast_floats(v, dtype) for v in x]
    if isinstance(x, dict):
        return {k: cast_floats(v, dtype) for k, v in x.items()}
    return x
