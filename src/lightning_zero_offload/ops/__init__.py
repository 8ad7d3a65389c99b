"""The kernel's Python face: argument checks, then the C++ extension or the pure-torch reference.

``fused_adamw_`` is one AdamW (or Adam) step over flat CPU tensors in one memory pass: the gradient
is read in fp32, bf16 or fp16 and multiplied by ``grad_scale``; master weights and moments are fp32
and updated in place; the new weights are optionally written, rounded to nearest even, into a bf16
or fp16 ``out`` tensor. Every argument is checked before anything is written.
"""

from __future__ import annotations

import torch

from lightning_zero_offload.ops import _build
from lightning_zero_offload.ops._reference import fused_adamw_reference_

__all__ = ["fused_adamw_", "fused_adamw_reference_", "backend"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)


def backend() -> str:
    """``"cpp"`` when the compiled kernel is in use, ``"reference"`` otherwise."""
    return "cpp" if _build.load() is not None else "reference"


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fused_adamw_: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"fused_adamw_: `{name}` is on {t.device}; the CPU optimizer needs host tensors "
            f"(move it with `.cpu()`)"
        )
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"fused_adamw_: `{name}` has dtype {t.dtype}; expected one of: {names}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"fused_adamw_: `{name}` must be a dense (strided) tensor")
    if not t.is_contiguous():
        raise ValueError(f"fused_adamw_: `{name}` must be contiguous (call `.contiguous()`)")
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"fused_adamw_: `{name}` has {t.numel()} elements but `param` has {numel}"
        )


def check_args(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    grad_scale: float,
    out: torch.Tensor | None,
) -> None:
    """Raise a clear error naming the first bad argument; writes nothing."""
    _check_tensor("param", param, (torch.float32,), None)
    n = param.numel()
    _check_tensor("grad", grad, _GRAD_DTYPES, n)
    _check_tensor("exp_avg", exp_avg, (torch.float32,), n)
    _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if out is not None:
        _check_tensor("out", out, _OUT_DTYPES, n)
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([out] if out is not None else [])
    names = ["param", "grad", "exp_avg", "exp_avg_sq", "out"]
    for i in range(len(tensors)):
        for j in range(i + 1, len(tensors)):
            if n and tensors[i].data_ptr() == tensors[j].data_ptr():
                raise ValueError(f"fused_adamw_: `{names[i]}` and `{names[j]}` share memory")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"fused_adamw_: `step` must be an int >= 1 (the 1-based step), got {step!r}")
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"fused_adamw_: `betas` must be two floats in [0, 1), got {betas!r}")
    if not lr >= 0.0:
        raise ValueError(f"fused_adamw_: `lr` must be >= 0, got {lr!r}")
    if not eps >= 0.0:
        raise ValueError(f"fused_adamw_: `eps` must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"fused_adamw_: `weight_decay` must be >= 0, got {weight_decay!r}")
    if not isinstance(grad_scale, (int, float)):
        raise TypeError(f"fused_adamw_: `grad_scale` must be a Python float, got {type(grad_scale)}")


def fused_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One AdamW (``decoupled=True``) or Adam (L2 decay) step, in place, over flat CPU tensors.

    ``num_threads`` defaults to ``torch.get_num_threads()``; results do not depend on it.
    """
    check_args(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
        weight_decay=weight_decay, grad_scale=grad_scale, out=out,
    )
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"fused_adamw_: `num_threads` must be an int >= 1, got {num_threads!r}")
    ext = _build.load()
    if ext is None:
        fused_adamw_reference_(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=float(lr), beta1=float(betas[0]),
            beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay),
            decoupled=decoupled, grad_scale=float(grad_scale), out=out,
        )
        return
    ext.fused_adamw(
        param, grad, exp_avg, exp_avg_sq, out, int(step), float(lr), float(betas[0]),
        float(betas[1]), float(eps), float(weight_decay), bool(decoupled), float(grad_scale),
        int(num_threads or torch.get_num_threads()),
    )
