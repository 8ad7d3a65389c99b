"""Pure-torch reference of the fused AdamW step: the semantics the C++ kernel must match.

Slower (several passes), but exact in intent: it is what the tests compare the kernel against
and what runs, with a warning, where no C++ compiler exists.
"""

from __future__ import annotations

import math

import torch

from lightning_zero_offload.ops import moments as _mom


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
    exp_avg_scales: torch.Tensor | None = None,
    exp_avg_sq_scales: torch.Tensor | None = None,
    key: int = 0,
    offset: int = 0,
) -> None:
    """Same operation order as ``torch.optim.AdamW``/``Adam`` (single-tensor path), in fp32.

    Compact moments (bf16, or uint8 codes with per-block scales; see ``ops.moments``) are
    dequantized, updated by the same fp32 step (but for sqrt(v) * float(1 / bc2) in place of
    sqrt(v) / bc2, as the compact kernel computes it) and stored back with the kernel's stochastic
    rounding (rounding key ``key``, counter ``offset + i``). Matches the C++ kernel bit for bit,
    with ``out`` a buffer of its own or ``grad`` itself.
    """
    hp = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              decoupled=decoupled, grad_scale=grad_scale, out=out)
    if exp_avg.dtype != torch.float32:
        _compact_(param, grad, exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales, key,
                  offset, **hp)
        return
    _step_fp32_(param, grad, exp_avg, exp_avg_sq, compact=False, **hp)


def _step_fp32_(param, grad, exp_avg, exp_avg_sq, *, compact: bool, step, lr, beta1, beta2, eps,
                weight_decay, decoupled, grad_scale, out) -> None:
    # compact: the compact kernel's one departure, sqrt(v) * float(1 / bc2) for sqrt(v) / bc2
    # `out` may be `grad` itself (then both are 16-bit, and grad.float() is a copy): grad is read
    # once, here, and `out` written once, last.
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
    sq = exp_avg_sq.double().sqrt().float()
    denom = (sq * (1.0 / bias_correction2_sqrt) if compact else sq / bias_correction2_sqrt)
    denom.add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if out is not None:
        out.copy_(param)


def _compact_(param, grad, exp_avg, exp_avg_sq, m_scales, v_scales, key, offset, **hp) -> None:
    # flat views: the block layout counts elements, whatever the tensors' shapes
    param, grad, exp_avg, exp_avg_sq = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))
    if hp["out"] is not None:
        hp["out"] = hp["out"].view(-1)
    md = "bf16" if exp_avg.dtype == torch.bfloat16 else "int8"
    scales = (m_scales, v_scales) if md == "int8" else ()
    state = _mom.Moments(md, exp_avg, exp_avg_sq, scales=scales, offset=offset)
    m, v = state.to_fp32()
    _step_fp32_(param, grad, m, v, compact=True, **hp)
    state.round_from_((m, v), key)
