"""Pure-torch reference of the fused AdamW step: the semantics the C++ kernel must match.

Slower (several passes), but exact in intent: it is what the tests compare the kernel against
and what runs, with a warning, where no C++ compiler exists.
"""

from __future__ import annotations

import math

import torch


def fused_adamw_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float,
    out: torch.Tensor | None,
) -> None:
    """Same operation order as ``torch.optim.AdamW``/``Adam`` (single-tensor path), in fp32.

    Matches the C++ kernel bit for bit.
    """
    g = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
    if weight_decay != 0.0:
        if decoupled:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    # torch's vectorized float sqrt is not always correctly rounded; the kernel's is (IEEE), and
    # a float64 sqrt rounded to float32 is too, so the two agree bit for bit.
    denom = (exp_avg_sq.double().sqrt().float() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if out is not None:
        out.copy_(param)
