"""Lion's kernel face: the fused Lion step's argument checks, then the C++ extension
(``src/kernels/lion.h``) or the pure-torch reference with the same semantics.

``fused_lion_`` is one ``lion_pytorch.Lion`` step over flat CPU tensors in one memory pass::

    p *= decay;  p -= lr * sign(beta1 * m + (1 - beta1) * g);  m = beta2 * m + (1 - beta2) * g

the gradient read in fp32, bf16 or fp16 and multiplied by ``grad_scale`` first, the moment fp32
or compact (``ops.moments``), the new weights optionally written, rounded to nearest even, into a
bf16 or fp16 ``out`` (which may be ``grad`` itself). Every argument is checked before anything is
written. Threads: ``ops.ext``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero_offload.ops.codes import SIGNED
from lightning_zero_offload.ops.ext import check_tensor, kernel, pool
from lightning_zero_offload.ops.moments import BLOCK, Moments, num_blocks, rng_key

# The state: one moment, stored as Adam's first moment is.
STATE = {"exp_avg": SIGNED}
_FN = "fused_lion_"
_GRAD = (torch.float32, torch.bfloat16, torch.float16)
_STORED = (torch.float32, torch.bfloat16, torch.uint8)


def fused_lion_(param: Tensor, grad: Tensor, exp_avg: Tensor, *, step: int, lr: float,
                betas: tuple[float, float], decay: float, grad_scale: float = 1.0,
                out: Tensor | None = None, num_threads: int | None = None,
                exp_avg_scales: Tensor | None = None, seed: int = 0, offset: int = 0) -> None:
    """One Lion step in place over flat CPU tensors by the fused kernel (the pure-torch
    reference where it is not built). ``exp_avg`` (and ``exp_avg_scales`` for uint8 codes;
    ``Moments.kernel_args()`` gives both and ``offset``) is the moment chunk starting at
    ``offset`` of the whole buffer; a compact one is rounded stochastically from
    ``(seed, step, offset + i)``. ``decay`` is ``1 - lr * weight_decay``. ``out`` (bf16/fp16,
    or ``grad`` itself) receives the new weights rounded to nearest even."""
    check_tensor("param", param, (torch.float32,), None, _FN)
    n = param.numel()
    check_tensor("grad", grad, _GRAD, n, _FN)
    check_tensor("exp_avg", exp_avg, _STORED, n, _FN)
    q8 = exp_avg.dtype == torch.uint8
    if q8 != (exp_avg_scales is not None):
        raise ValueError(f"{_FN}: `exp_avg_scales` (one float32 scale per {BLOCK} elements) "
                         "goes with uint8 (int8 block-wise) moments, and only with them")
    if exp_avg_scales is not None:
        check_tensor("exp_avg_scales", exp_avg_scales, (torch.float32,), num_blocks(n), _FN)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or (
            q8 and offset % BLOCK):
        raise ValueError(f"{_FN}: `offset` must be an int >= 0 (a multiple of {BLOCK} for "
                         f"int8 moments), got {offset!r}")
    if out is not None:
        check_tensor("out", out, _GRAD[1:], n, _FN)
        if out.data_ptr() != grad.data_ptr() and n and (
                out.data_ptr() < grad.data_ptr() + grad.nbytes
                and grad.data_ptr() < out.data_ptr() + out.nbytes):
            raise ValueError(f"{_FN}: `out` overlaps `grad` but is not exactly `grad`")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{_FN}: `step` must be an int >= 1 (1-based), got {step!r}")
    key = rng_key(seed, step) if exp_avg.dtype != torch.float32 else 0
    threads, torch_pool = pool(num_threads)
    ext = kernel()
    if ext is None:
        fused_lion_reference_(param, grad, exp_avg, lr=lr, betas=betas, decay=decay,
                              grad_scale=grad_scale, out=out, exp_avg_scales=exp_avg_scales,
                              key=key, offset=offset)
        return
    ext.fused_lion(param, grad, exp_avg, out, float(lr), float(betas[0]), float(betas[1]),
                   float(decay), float(grad_scale), threads, exp_avg_scales, key, offset,
                   torch_pool)


def lion_torch_(p: Tensor, g: Tensor, m: Tensor, *, lr: float, betas: tuple[float, float],
                decay: float) -> None:
    """lion_pytorch's update in torch ops (fp32 tensors, ``g`` already scaled)."""
    b1, b2 = betas
    p.mul_(decay)
    p.add_(m.mul(b1).add_(g, alpha=1.0 - b1).sign_(), alpha=-lr)
    m.mul_(b2).add_(g, alpha=1.0 - b2)


def fused_lion_reference_(param: Tensor, grad: Tensor, exp_avg: Tensor, *, lr: float,
                          betas: tuple[float, float], decay: float, grad_scale: float,
                          out: Tensor | None, exp_avg_scales: Tensor | None = None,
                          key: int = 0, offset: int = 0) -> None:
    """The kernel's semantics in torch: lion_pytorch's fp32 update on the dequantized moment,
    stored back with the kernels' stochastic rounding (key ``key``, counter ``offset + i``).
    ``out`` may be ``grad`` itself: ``grad`` is read first."""
    md = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}[exp_avg.dtype]
    scales = (exp_avg_scales,) if exp_avg_scales is not None else ()
    state = Moments(md, exp_avg, names=STATE, scales=scales, offset=offset)
    g = grad.float() * grad_scale
    (m,) = state.to_fp32()
    lion_torch_(param, g, m, lr=lr, betas=betas, decay=decay)
    state.round_from_((m,), key)
    if out is not None:
        out.copy_(param)
