"""``CPUAdam``: a drop-in ``torch.optim.AdamW`` / ``Adam`` for CPU fp32 tensors on the fused kernel.

Param groups and state use torch's AdamW format (group keys such as ``decoupled_weight_decay``;
per-parameter ``step`` as a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``), so a state dict
moves between ``CPUAdam`` and ``torch.optim.AdamW`` in both directions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_zero_offload.ops import fused_adamw_

__all__ = ["CPUAdam"]


class CPUAdam(torch.optim.Optimizer):
    """AdamW (``decoupled=True``) or Adam with L2 decay (``decoupled=False``) over CPU fp32 tensors.

    Hyperparameters are read from each param group at every step, so LR schedulers work.
    ``num_threads`` (default ``torch.get_num_threads()``) does not change results.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        num_threads: int | None = None,
    ) -> None:
        _check_unsupported({"amsgrad": amsgrad, "maximize": maximize})
        if isinstance(lr, torch.Tensor):
            raise TypeError("CPUAdam: `lr` must be a Python float (tensor lr is not supported)")
        if not lr >= 0.0:
            raise ValueError(f"CPUAdam: invalid learning rate {lr!r} (must be >= 0)")
        if not eps >= 0.0:
            raise ValueError(f"CPUAdam: invalid eps {eps!r} (must be >= 0)")
        if not (len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)):
            raise ValueError(f"CPUAdam: betas must be two floats in [0, 1), got {betas!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"CPUAdam: invalid weight_decay {weight_decay!r} (must be >= 0)")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"CPUAdam: `num_threads` must be an int >= 1, got {num_threads!r}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": decoupled,
        }
        super().__init__(params, defaults)
        self.num_threads = num_threads
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Check everything first, so a bad gradient leaves every parameter as it was.
        work = []
        for group in self.param_groups:
            _check_unsupported(group)
            for p in group["params"]:
                if p.grad is not None:
                    _check_param(p)
                    _check_grad(p, p.grad)
                    work.append((group, p))
        for group, p in work:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = int(state["step"].item()) + 1
            beta1, beta2 = group["betas"]
            fused_adamw_(
                p,
                p.grad.contiguous(),
                state["exp_avg"],
                state["exp_avg_sq"],
                step=step,
                lr=float(group["lr"]),
                betas=(float(beta1), float(beta2)),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", True)),
                num_threads=self.num_threads,
            )
            state["step"].fill_(step)
        return loss


def _check_param(p: torch.Tensor) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdam: parameter is on {p.device}; CPUAdam updates CPU tensors only")
    if p.dtype != torch.float32:
        raise ValueError(
            f"CPUAdam: parameter has dtype {p.dtype}; CPUAdam keeps fp32 master weights "
            "(convert the model with `.float()`)"
        )
    if not p.is_contiguous():
        raise ValueError("CPUAdam: parameters must be contiguous")


def _check_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError("CPUAdam does not support sparse gradients")
    if grad.device.type != "cpu":
        raise RuntimeError(f"CPUAdam: gradient is on {grad.device}; it must be on CPU")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"CPUAdam: grad has dtype {grad.dtype}; expected float32, bfloat16 or float16"
        )
    if grad.shape != p.shape:
        raise ValueError(f"CPUAdam: grad has shape {tuple(grad.shape)}, param {tuple(p.shape)}")


def _check_unsupported(group: dict[str, Any]) -> None:
    for key in ("amsgrad", "maximize"):
        if group.get(key, False):
            raise ValueError(f"CPUAdam does not support {key}=True; use torch.optim.AdamW for it")
