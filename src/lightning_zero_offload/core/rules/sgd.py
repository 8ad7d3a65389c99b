"""The SGD rule: ``torch.optim.SGD`` with its momentum, dampening, Nesterov momentum, weight
decay and ``maximize``, per parameter group, as torch computes them::

    d = -g if maximize else g;  d += wd * p
    b = d at the first step, else momentum * b + (1 - dampening) * d   (momentum != 0 only)
    d = d + momentum * b if nesterov else b;  p -= lr * d

Its state is torch's ``momentum_buffer``, kept only where the optimizer was made with a
non-zero ``momentum`` in some group (``momentum=0`` everywhere keeps no state at all); it may
be stored compact (``moment_dtype``) as Adam's first moment is. SGD has no fused kernel: the
host update is torch's ops over the bucket's flat host views, the device update the same ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.rules.rule import Rule, check_keeps_step
from lightning_zero_offload.ops import SIGNED, Moments, rng_key

_BUFFER = "momentum_buffer"


@dataclass(frozen=True)
class Hyper:
    """One group's hyperparameters for one step, as plain numbers."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


class SGD(Rule):
    NAME = "SGD"
    KEY = "sgd"
    CODES = {_BUFFER: SIGNED}
    STATE = (_BUFFER,)
    OPTIMIZERS = "torch.optim.SGD"
    FAMILY = "sgd"
    EXAMPLE = "torch.optim.SGD(model.parameters(), lr=..., momentum=...)"
    DEFAULTS = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                "nesterov": False, "maximize": False}

    def __init__(self, momentum: bool = True) -> None:
        # Whether any group was made with momentum: the buffer is kept. ``SGD()`` keeps it (the
        # state torch's SGD with momentum holds); ``from_options()`` follows torch's default.
        self.momentum = momentum

    @classmethod
    def accepts(cls, optimizer: torch.optim.Optimizer) -> bool:
        return isinstance(optimizer, torch.optim.SGD)

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> SGD:
        check_keeps_step(optimizer, torch.optim.SGD, "torch.optim.SGD")
        if any(g.get("differentiable") for g in optimizer.param_groups):
            raise ValueError("ZeroOffload: torch.optim.SGD with differentiable=True is not "
                             "supported (the step runs outside autograd); set "
                             "differentiable=False")
        return cls(any(float(g["momentum"]) != 0 for g in optimizer.param_groups))

    @classmethod
    def from_options(cls, **options: Any) -> SGD:
        """``torch.optim.SGD(params, **options)``'s rule: its state only with momentum."""
        return cls(float(options.get("momentum", 0.0)) != 0)

    @property
    def state(self) -> dict[str, str]:
        return dict(self.CODES) if self.momentum else {}

    @property
    def options(self) -> dict[str, Any]:
        return {"momentum": 1.0} if self.momentum else {}

    def check_hparams(self, groups: list[dict]) -> None:
        for i, g in enumerate(groups):
            try:
                lr, mom = float(g["lr"]), float(g["momentum"])
                damp, wd = float(g["dampening"]), float(g["weight_decay"])
                nesterov = bool(g["nesterov"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"ZeroOffload: param group {i} has a malformed hyperparameter "
                                 f"({e!r}); lr, momentum, dampening and weight_decay must be "
                                 "numbers") from None
            bad = [f"{k}={v!r}" for k, v, ok in (
                ("lr", lr, lr >= 0 and math.isfinite(lr)),
                ("momentum", mom, mom >= 0 and math.isfinite(mom)),
                ("dampening", damp, math.isfinite(damp)),
                ("weight_decay", wd, wd >= 0 and math.isfinite(wd))) if not ok]
            if nesterov and (mom <= 0 or damp != 0):
                bad.append(f"nesterov=True with momentum={mom!r}, dampening={damp!r}")
            if bad:
                raise ValueError(f"ZeroOffload: param group {i} has {', '.join(bad)}; torch's "
                                 "SGD needs lr >= 0, momentum >= 0, weight_decay >= 0, and "
                                 "nesterov only with momentum > 0 and dampening = 0. Nothing "
                                 "was updated.")
            if mom != 0 and not self.momentum:
                raise ValueError(
                    f"ZeroOffload: param group {i} now has momentum={mom!r}, but the optimizer "
                    "was made with momentum=0 in every group, so no momentum buffer is kept; "
                    "make the optimizer with its momentum from the start. Nothing was updated.")

    def hyper(self, group: dict) -> Hyper:
        return Hyper(float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                     float(group["weight_decay"]), bool(group["nesterov"]),
                     bool(group.get("maximize", False)))

    def host_update(self, master: Tensor, grad: Tensor, state: Moments, hp: Hyper, *, step: int,
                    grad_scale: float, out: Tensor | None, threads: int, seed: int) -> None:
        # No kernel: torch's ops over the flat views, a compact buffer read to fp32 and stored
        # back with the kernels' stochastic rounding. ``out`` may be ``grad``: ``grad`` is
        # read first.
        g = grad.float() * grad_scale
        compact = bool(state.names) and state.moment_dtype != "fp32"
        bufs = state.to_fp32() if compact else tuple(state.arrays.values())
        _sgd_(master, g, bufs[0] if bufs else None, hp, first=step == 1)
        if compact:
            state.round_from_(bufs, rng_key(seed, step))
        if out is not None:
            out.copy_(master)

    def device_update(self, master: Tensor, grad: Tensor, state: Sequence[Tensor], hp: Hyper, *,
                      step: int, grad_scale: float) -> None:
        g = grad.float().mul_(grad_scale) if grad.dtype != torch.float32 else grad.mul(grad_scale)
        _sgd_(master, g, state[0] if state else None, hp, first=step == 1)


def _sgd_(p: Tensor, g: Tensor, buf: Tensor | None, hp: Hyper, *, first: bool) -> None:
    """torch.optim.SGD's update of one group in torch ops (fp32; ``g`` scaled, overwritten)."""
    d = g.neg_() if hp.maximize else g
    if hp.weight_decay != 0:
        d = d.add_(p, alpha=hp.weight_decay)
    if hp.momentum != 0:
        assert buf is not None
        if first:
            buf.copy_(d)
        else:
            buf.mul_(hp.momentum).add_(d, alpha=1 - hp.dampening)
        d = d.add_(buf, alpha=hp.momentum) if hp.nesterov else buf
    p.add_(d, alpha=-hp.lr)
