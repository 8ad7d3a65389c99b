"""The Lion rule: ``lion_pytorch.Lion`` (Chen et al., "Symbolic Discovery of Optimization
Algorithms", 2023), its subclasses that keep its ``step`` and ``update_fn`` included.

Lion keeps one moment, ``exp_avg`` (in any ``moment_dtype``: stored as Adam's first moment is),
and steps every weight by the learning rate times the sign of an interpolation of the moment and
the gradient::

    p *= 1 - lr * wd;  p -= lr * sign(beta1 * m + (1 - beta1) * g);  m = beta2 * m + (1 - beta2) * g

``wd`` is the group's ``weight_decay``, divided by the optimizer's initial ``lr`` when it was made
with ``decoupled_weight_decay=True``, as lion_pytorch does. The host update is the fused C++
kernel (its face: ``ops.lion``), the device update torch's ops in the same order
(``ops.lion.lion_torch_``); both follow lion_pytorch's fp32 arithmetic. ``lion_pytorch`` is
needed only by the user who builds the optimizer: this module never imports it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero_offload.core.rules.rule import Rule, check_keeps_step, qualified
from lightning_zero_offload.ops import Moments, lion


@dataclass(frozen=True)
class Hyper:
    """One group's hyperparameters for one step, as plain numbers."""

    lr: float
    betas: tuple[float, float]
    decay: float  # 1 - lr * wd, in double as lion_pytorch computes it

    def kernel_args(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "decay": self.decay}


def _lion_class() -> type | None:
    module = sys.modules.get("lion_pytorch")  # imported by whoever made a Lion optimizer
    return getattr(module, "Lion", None)


class Lion(Rule):
    NAME = "Lion"
    KEY = "lion"
    CODES = lion.STATE
    STATE = tuple(CODES)
    OPTIMIZERS = "lion_pytorch.Lion"
    FAMILY = "lion"
    EXAMPLE = "lion_pytorch.Lion(model.parameters(), ...)"
    DEFAULTS = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}

    def __init__(self, wd_divisor: float = 1.0) -> None:
        self.wd_divisor = wd_divisor  # the initial lr with decoupled_weight_decay=True, else 1

    @classmethod
    def accepts(cls, optimizer: torch.optim.Optimizer) -> bool:
        lion = _lion_class()
        return lion is not None and isinstance(optimizer, lion)

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> Lion:
        lion = _lion_class()
        assert lion is not None
        check_keeps_step(optimizer, lion, "lion_pytorch.Lion")
        # The very function lion_pytorch.Lion sets (or its triton twin, same update): a wrapper
        # around it carries its name and module (functools.wraps) but would never run.
        update = getattr(optimizer, "update_fn", None)
        known = [getattr(sys.modules.get(m), "update_fn", None)
                 for m in ("lion_pytorch.lion_pytorch", "lion_pytorch.triton")]
        if update is None or not any(update is fn for fn in known):
            raise TypeError(f"ZeroOffload: {qualified(type(optimizer))}'s update_fn is not "
                            "lion_pytorch's own (it is replaced or wrapped), and the fused CPU "
                            "step would not run it; use lion_pytorch.Lion (or a subclass that "
                            "keeps its step and update_fn)")
        init_lr = float(getattr(optimizer, "_init_lr", 1.0))
        return cls(init_lr if getattr(optimizer, "decoupled_wd", False) else 1.0)

    @classmethod
    def from_options(cls, **options: Any) -> Lion:
        """``lion_pytorch.Lion(params, **options)``'s rule."""
        lr = float(options.get("lr", cls.DEFAULTS["lr"]))
        return cls(lr if options.get("decoupled_weight_decay", False) else 1.0)

    def check_hparams(self, groups: list[dict]) -> None:
        for i, g in enumerate(groups):
            try:
                lr, wd = float(g["lr"]), float(g["weight_decay"])
                b1, b2 = (float(b) for b in g["betas"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"ZeroOffload: param group {i} has a malformed hyperparameter "
                                 f"({e!r}); lr, weight_decay and betas must be numbers") from None
            bad = [f"{k}={v!r}" for k, v, ok in (
                ("lr", lr, lr >= 0 and math.isfinite(lr)),
                ("weight_decay", wd, wd >= 0 and math.isfinite(wd)),
                ("betas[0]", b1, 0 <= b1 <= 1), ("betas[1]", b2, 0 <= b2 <= 1)) if not ok]
            if bad:
                raise ValueError(f"ZeroOffload: param group {i} has {', '.join(bad)}; Lion "
                                 "needs lr >= 0, weight_decay >= 0 and 0 <= betas <= 1. "
                                 "Nothing was updated.")

    def hyper(self, group: dict) -> Hyper:
        lr = float(group["lr"])
        wd = float(group["weight_decay"]) / self.wd_divisor
        return Hyper(lr, (float(group["betas"][0]), float(group["betas"][1])), 1.0 - lr * wd)

    def host_update(self, master: Tensor, grad: Tensor, state: Moments, hp: Hyper, *, step: int,
                    grad_scale: float, out: Tensor | None, threads: int, seed: int) -> None:
        lion.fused_lion_(master, grad, step=step, grad_scale=grad_scale, out=out,
                         num_threads=threads, seed=seed, **state.kernel_args(), **hp.kernel_args())

    def device_update(self, master: Tensor, grad: Tensor, state: Sequence[Tensor], hp: Hyper, *,
                      step: int, grad_scale: float) -> None:
        (exp_avg,) = state
        g = grad.float().mul_(grad_scale) if grad.dtype != torch.float32 else grad.mul(grad_scale)
        lion.lion_torch_(master, g, exp_avg, **hp.kernel_args())

