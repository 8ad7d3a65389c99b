"""The update rule, in one place: AdamW (decoupled weight decay) or Adam (L2 decay).

What a rule is made of, and nothing else: which optimizers and options it takes
(:func:`check_optimizer`), the per-step check of each group's hyperparameters
(:func:`check_hparams`) and their settled form (:class:`Hyper`), the names of its per-parameter
state (:data:`STATE_NAMES`, as torch's ``state_dict`` spells them) and their host bytes
(:func:`state_bytes`), and two implementations of one update with the same semantics:

- :func:`host_update`: the fused C++ kernel (or its pure-torch reference) over flat host tensors,
  moments in any ``moment_dtype``, the new half weights optionally written in the same pass;
- :func:`device_update`: torch's fused ``_fused_adamw_`` / ``_fused_adam_`` over fp32 master and
  moments wherever they live (the device; the CPU too, which is how it is tested), equal to the
  kernel to fp32 rounding.

Both take the gradient as it arrived and a ``grad_scale`` (loss-scale inverse times clip
coefficient) that multiplies it before anything else, and a 1-based ``step`` for bias correction.
Another rule (Lion, Adagrad) is another module of this shape plus its kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_zero_offload.ops import Moments, fused_adamw_, moment_bytes

STATE_NAMES = ("exp_avg", "exp_avg_sq")  # per-parameter state besides "step", torch's names
DEVICE_STATE_BYTES = 4 * len(STATE_NAMES)  # per element on the device: fp32 whatever moment_dtype

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


def _unwrapped(fn: object) -> object:
    """``fn`` without the wrappers torch puts around ``Optimizer.step`` (profiling, grad mode)."""
    while hasattr(fn, "__wrapped__"):
        fn = getattr(fn, "__wrapped__")  # noqa: B009
    return fn


def check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """The user's optimizer is one this rule implements; returns whether weight decay is
    decoupled (AdamW). ``torch.optim.AdamW`` or ``Adam``, subclasses included unless they replace
    ``step`` (the fused step runs torch's update, so another ``step`` would be silently ignored)."""
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise TypeError(
            f"ZeroOffload supports torch.optim.AdamW and torch.optim.Adam (or subclasses) only "
            f"(the fused CPU step implements them); got {type(optimizer).__name__}. Create the "
            "optimizer with torch.optim.AdamW(model.parameters(), ...)"
        )
    if _unwrapped(type(optimizer).step) is not _unwrapped(torch.optim.Adam.step):
        raise TypeError(
            f"ZeroOffload: {type(optimizer).__name__} overrides step(), which the fused CPU step "
            "would not run; use torch.optim.AdamW/Adam (or a subclass that keeps their step)"
        )
    for i, group in enumerate(optimizer.param_groups):
        for key, what in _UNSUPPORTED.items():
            if group.get(key):
                raise ValueError(
                    f"ZeroOffload: param group {i} uses {what}, which the fused CPU AdamW does "
                    f"not support; supported: AdamW/Adam with {key}=False"
                )
    return isinstance(optimizer, torch.optim.AdamW)


def check_hparams(groups: list[dict]) -> None:
    """Every group's hyperparameters, before a step changes anything: a bad value set after
    setup (a scheduler, a user edit) raises here with nothing updated, not after some buckets."""
    for i, g in enumerate(groups):
        for key, what in _UNSUPPORTED.items():
            if g.get(key):
                raise ValueError(f"ZeroOffload: param group {i} now uses {what}, which the fused "
                                 f"CPU AdamW does not support; set {key}=False")
        try:
            lr, eps, wd = float(g["lr"]), float(g["eps"]), float(g["weight_decay"])
            b1, b2 = (float(b) for b in g["betas"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ZeroOffload: param group {i} has a malformed hyperparameter "
                             f"({e!r}); lr, eps, weight_decay and betas must be numbers") from None
        bad = [f"{k}={v!r}" for k, v, ok in (
            ("lr", lr, lr >= 0 and math.isfinite(lr)), ("eps", eps, eps >= 0),
            ("weight_decay", wd, wd >= 0 and math.isfinite(wd)),
            ("betas[0]", b1, 0 <= b1 < 1), ("betas[1]", b2, 0 <= b2 < 1)) if not ok]
        if bad:
            raise ValueError(f"ZeroOffload: param group {i} has {', '.join(bad)}; torch's AdamW "
                             "needs lr >= 0, eps >= 0, weight_decay >= 0 and 0 <= betas < 1. "
                             "Nothing was updated.")


def hyper(group: dict, decoupled: bool) -> Hyper:
    """A checked group's hyperparameters (``decoupled``: the optimizer is an AdamW; an Adam
    group may still ask for it with ``decoupled_weight_decay=True``)."""
    return Hyper(float(group["lr"]), (float(group["betas"][0]), float(group["betas"][1])),
                 float(group["eps"]), float(group["weight_decay"]),
                 decoupled or bool(group.get("decoupled_weight_decay", False)))


def state_bytes(numel: int, moment_dtype: str) -> int:
    """Host bytes of the rule's state (both moments, with their scales) for ``numel`` elements."""
    return moment_bytes(numel, moment_dtype)


def host_update(master: Tensor, grad: Tensor, moments: Moments, hp: Hyper, *, step: int,
                grad_scale: float, out: Tensor | None, threads: int, seed: int) -> None:
    """One step over flat host tensors by the fused kernel; ``moments`` is the matching chunk,
    ``out`` (bf16/fp16, or None) receives the new weights rounded to nearest even."""
    fused_adamw_(master, grad, grad_scale=grad_scale, out=out, num_threads=threads, seed=seed,
                 step=step, **moments.kernel_args(), **hp.kernel_args())


def device_update(master: Tensor, grad: Tensor, state: Sequence[Tensor], hp: Hyper, *,
                  step: int, grad_scale: float) -> None:
    """The same step over fp32 tensors on one device by torch's fused ops. The gradient (any
    float dtype) is scaled in fp32 first, as the kernel does (``grad * grad_scale``, not torch's
    division by a loss scale), so both round the same way; ``grad`` itself is left as it is.
    ``state``: fp32 tensors in the order of :data:`STATE_NAMES`."""
    exp_avg, exp_avg_sq = state
    g = grad.float().mul_(grad_scale) if grad.dtype != torch.float32 else grad.mul(grad_scale)
    fused = torch.ops.aten._fused_adamw_ if hp.decoupled else torch.ops.aten._fused_adam_
    fused([master], [g], [exp_avg], [exp_avg_sq], [],
          [torch.tensor(float(step), device=master.device)], lr=hp.lr, beta1=hp.betas[0],
          beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False,
          maximize=False)
