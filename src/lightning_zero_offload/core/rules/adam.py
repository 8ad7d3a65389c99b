"""The Adam rule: AdamW (decoupled weight decay) or Adam (L2 decay), ``torch.optim``'s.

Its state is torch's two moments, ``exp_avg`` and ``exp_avg_sq``, kept on the host in any
``moment_dtype`` (``ops.moments``). The host update is the fused C++ kernel (its face:
``ops.adamw``); the device update is torch's fused ``_fused_adamw_`` / ``_fused_adam_``,
equal to the kernel to fp32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.rules.rule import Rule, check_keeps_step
from lightning_zero_offload.ops import Moments, adamw

_UNSUPPORTED = {
    "amsgrad": "amsgrad=True",
    "maximize": "maximize=True",
    "capturable": "capturable=True (CUDA-graph capture of the step)",
    "differentiable": "differentiable=True",
}


@dataclass(frozen=True)
class Hyper:
    """One group's hyperparameters for one step, as plain numbers."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW; False: Adam's L2 decay added to the gradient

    def kernel_args(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay, "decoupled": self.decoupled}


def _check_options(groups: list[dict], now: bool) -> None:
    for i, group in enumerate(groups):
        for key, what in _UNSUPPORTED.items():
            if group.get(key):
                fix = f"set {key}=False" if now else f"supported: AdamW/Adam with {key}=False"
                raise ValueError(f"ZeroOffload: param group {i} {'now ' if now else ''}uses "
                                 f"{what}, which the fused CPU AdamW does not support; {fix}")


class Adam(Rule):
    NAME = "Adam/AdamW"
    KEY = "adamw"
    CODES = adamw.STATE
    STATE = tuple(CODES)
    OPTIMIZERS = "torch.optim.AdamW and torch.optim.Adam"
    FAMILY = "adam"
    EXAMPLE = "torch.optim.AdamW(model.parameters(), ...)"
    DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

    def __init__(self, decoupled: bool = True) -> None:
        self.decoupled = decoupled  # AdamW's decay; an Adam group may still ask for it (hyper)

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> Adam:
        check_keeps_step(optimizer, torch.optim.Adam, "torch.optim.AdamW/Adam")
        _check_options(optimizer.param_groups, now=False)
        return cls(isinstance(optimizer, torch.optim.AdamW))

    @classmethod
    def from_options(cls, **options: Any) -> Adam:
        """``torch.optim.AdamW(params, **options)``'s rule (``decoupled_weight_decay=False``:
        Adam's L2 decay)."""
        _check_options([options], now=False)
        return cls(bool(options.get("decoupled_weight_decay", True)))

    @classmethod
    def accepts(cls, optimizer: torch.optim.Optimizer) -> bool:
        return isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam))

    def check_hparams(self, groups: list[dict]) -> None:
        _check_options(groups, now=True)
        for i, g in enumerate(groups):
            try:
                lr, eps, wd = float(g["lr"]), float(g["eps"]), float(g["weight_decay"])
                b1, b2 = (float(b) for b in g["betas"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"ZeroOffload: param group {i} has a malformed hyperparameter "
                                 f"({e!r}); lr, eps, weight_decay and betas must be numbers"
                                 ) from None
            bad = [f"{k}={v!r}" for k, v, ok in (
                ("lr", lr, lr >= 0 and math.isfinite(lr)), ("eps", eps, eps >= 0),
                ("weight_decay", wd, wd >= 0 and math.isfinite(wd)),
                ("betas[0]", b1, 0 <= b1 < 1), ("betas[1]", b2, 0 <= b2 < 1)) if not ok]
            if bad:
                raise ValueError(f"ZeroOffload: param group {i} has {', '.join(bad)}; torch's "
                                 "AdamW needs lr >= 0, eps >= 0, weight_decay >= 0 and "
                                 "0 <= betas < 1. Nothing was updated.")

    def hyper(self, group: dict) -> Hyper:
        return Hyper(float(group["lr"]), (float(group["betas"][0]), float(group["betas"][1])),
                     float(group["eps"]), float(group["weight_decay"]),
                     self.decoupled or bool(group.get("decoupled_weight_decay", False)))

    def host_update(self, master: Tensor, grad: Tensor, state: Moments, hp: Hyper, *, step: int,
                    grad_scale: float, out: Tensor | None, threads: int, seed: int) -> None:
        adamw.fused_adamw_(master, grad, grad_scale=grad_scale, out=out, num_threads=threads,
                           seed=seed, step=step, **state.kernel_args(), **hp.kernel_args())

    def device_update(self, master: Tensor, grad: Tensor, state: Sequence[Tensor], hp: Hyper, *,
                      step: int, grad_scale: float) -> None:
        # The gradient (any float dtype) is scaled in fp32 first, as the kernel does (grad *
        # grad_scale, not torch's division by a loss scale), so both round the same way.
        exp_avg, exp_avg_sq = state
        g = grad.float().mul_(grad_scale) if grad.dtype != torch.float32 else grad.mul(grad_scale)
        fused = torch.ops.aten._fused_adamw_ if hp.decoupled else torch.ops.aten._fused_adam_
        fused([master], [g], [exp_avg], [exp_avg_sq], [],
              [torch.tensor(float(step), device=master.device)], lr=hp.lr, beta1=hp.betas[0],
              beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False,
              maximize=False)
