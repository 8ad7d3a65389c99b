"""Adam's kernel face: the fused AdamW (or Adam) step's argument checks, then the C++
extension or the pure-torch reference, which the tests compare the kernel against and which runs,
with a warning, where no C++ compiler exists.

``fused_adamw_`` is one AdamW (or Adam) step over flat CPU tensors in one memory pass: the gradient
is read in fp32, bf16 or fp16 and multiplied by ``grad_scale``; master weights are fp32 and updated
in place; the moments are fp32, or compact (bf16, or block-wise 8-bit with per-block scales: see
``ops.moments``) and read and written in the same pass; the new weights are optionally written,
rounded to nearest even, into a bf16 or fp16 ``out`` tensor. Every argument is checked before
anything is written. Threads: ``ops.ext``.
"""

from __future__ import annotations

import math

import torch

from lightning_zero_offload.ops import _build
from lightning_zero_offload.ops.codes import SIGNED, SQRT
from lightning_zero_offload.ops.ext import check_tensor, pool
from lightning_zero_offload.ops.moments import BLOCK, Moments, num_blocks, rng_key

# The state: torch's two moments, the second (never negative) stored as its square root in int8.
STATE = {"exp_avg": SIGNED, "exp_avg_sq": SQRT}
_FN = "fused_adamw_"
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_F32 = (torch.float32,)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)

_NAMES = ("param", "grad", "exp_avg", "exp_avg_sq", "out", "exp_avg_scales", "exp_avg_sq_scales")
_GRAD, _OUT = 1, 4
_INPLACE = ("`out` may be `grad` itself (same data_ptr, numel and dtype: the new weights are "
            "written in place over the gradient they consumed) or a buffer of its own")


def _is_grad(out: torch.Tensor, grad: torch.Tensor) -> bool:
    """`out` is exactly `grad`'s memory as the same dtype (both are contiguous, of `numel` n)."""
    return out.data_ptr() == grad.data_ptr() and out.dtype == grad.dtype


def _check_overlap(ts: tuple[torch.Tensor | None, ...], alias: bool) -> None:
    """Every buffer (``ts`` in the order of _NAMES) is its own, but for ``out`` when ``alias``
    (it is exactly ``grad``)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, t in enumerate(ts)
        if t is not None and not (alias and i == _OUT)  # then `grad` stands for both
    )
    # Sorted by start, two spans overlap only if some neighbouring pair does.
    for (_, end, i), (start, _, j) in zip(spans, spans[1:], strict=False):
        if start < end:
            a, b = sorted((i, j))
            if (a, b) == (_GRAD, _OUT):
                raise ValueError(
                    "fused_adamw_: `out` overlaps `grad` but is not exactly `grad` "
                    f"(a partial overlap, or another dtype); {_INPLACE}"
                )
            hint = f"; {_INPLACE}" if _OUT in (a, b) else ""
            raise ValueError(
                f"fused_adamw_: `{_NAMES[a]}` and `{_NAMES[b]}` overlap in memory; "
                f"each must be its own buffer{hint}"
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
    exp_avg_scales: torch.Tensor | None = None,
    exp_avg_sq_scales: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """Raise a clear error naming the first bad argument; writes nothing."""
    check_tensor("param", param, _F32, None, _FN)
    n = param.numel()
    check_tensor("grad", grad, _GRAD_DTYPES, n, _FN)
    check_tensor("exp_avg", exp_avg, _MOMENT_DTYPES, n, _FN)
    check_tensor("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n, _FN)
    if out is not None:
        check_tensor("out", out, _OUT_DTYPES, n, _FN)
    q8 = exp_avg.dtype == torch.uint8
    for name, sc in (("exp_avg_scales", exp_avg_scales), ("exp_avg_sq_scales", exp_avg_sq_scales)):
        if q8 and sc is None:
            raise ValueError(
                f"fused_adamw_: uint8 (int8 block-wise) moments need `{name}`: one float32 "
                f"scale per {BLOCK} elements (ops.Moments holds both)"
            )
        if not q8 and sc is not None:
            raise ValueError(
                f"fused_adamw_: `{name}` is only for uint8 (int8 block-wise) moments; "
                f"these are {exp_avg.dtype}"
            )
        if q8:
            check_tensor(name, sc, _F32, None, _FN)
            assert sc is not None  # check_tensor raised otherwise
            if sc.numel() != num_blocks(n):
                raise ValueError(
                    f"fused_adamw_: `{name}` has {sc.numel()} elements; {n} moment elements "
                    f"need {num_blocks(n)} (one per {BLOCK})"
                )
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"fused_adamw_: `offset` must be an int >= 0, got {offset!r}")
    if q8 and offset % BLOCK:
        raise ValueError(
            f"fused_adamw_: `offset`={offset} is not a multiple of {BLOCK}: int8 moments are "
            f"updated in whole {BLOCK}-element blocks, so chunks must start on a block boundary"
        )
    rng_key(seed, 1)  # validates seed
    if n:
        ts = (param, grad, exp_avg, exp_avg_sq, out, exp_avg_scales, exp_avg_sq_scales)
        _check_overlap(ts, out is not None and _is_grad(out, grad))
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"fused_adamw_: `step` must be an int >= 1 (1-based), got {step!r}")
    if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"fused_adamw_: `betas` must be two floats in [0, 1), got {betas!r}")
    if not lr >= 0.0:
        raise ValueError(f"fused_adamw_: `lr` must be >= 0, got {lr!r}")
    if not eps >= 0.0:
        raise ValueError(f"fused_adamw_: `eps` must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"fused_adamw_: `weight_decay` must be >= 0, got {weight_decay!r}")
    if not isinstance(grad_scale, (int, float)):
        raise TypeError(f"fused_adamw_: `grad_scale` must be a float, got {type(grad_scale)}")


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
    exp_avg_scales: torch.Tensor | None = None,
    exp_avg_sq_scales: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """One AdamW (``decoupled=True``) or Adam (L2 decay) step, in place, over flat CPU tensors.

    The moments' dtype picks their format: float32 (exact), bfloat16, or uint8 codes with
    ``exp_avg_scales``/``exp_avg_sq_scales`` (see ``ops.moments``; ``Moments.kernel_args()``
    gives all four and ``offset``). Compact moments are rounded stochastically from
    ``(seed, step, offset + i)``; ``offset`` is where this chunk starts in the whole moment
    buffer (a multiple of ``BLOCK`` for uint8), so updating a buffer chunk by chunk gives the
    bits of one call. ``num_threads`` defaults to ``torch.get_num_threads()``; results do not
    depend on it.

    In place: ``out`` may be ``grad`` itself (same ``data_ptr``, ``numel`` and dtype, bf16 or
    fp16), so one half-precision buffer carries the gradient in and the new weights out. Every
    path reads an element's gradient before it writes that element's weight and reads no other
    element's gradient after, so the results are bit-identical to a separate ``out``, and
    ``grad`` afterwards holds the new weights. Any other overlap (``out`` partly over ``grad``,
    or over the master, moments or scales) raises ``ValueError`` before anything is written.
    """
    check_args(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps,
        weight_decay=weight_decay, grad_scale=grad_scale, out=out,
        exp_avg_scales=exp_avg_scales, exp_avg_sq_scales=exp_avg_sq_scales, seed=seed,
        offset=offset,
    )
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"{_FN}: `num_threads` must be an int >= 1, got {num_threads!r}")
    key = rng_key(seed, step) if exp_avg.dtype != torch.float32 else 0
    ext = _build.load()
    if ext is None:
        fused_adamw_reference_(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=float(lr), beta1=float(betas[0]),
            beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay),
            decoupled=decoupled, grad_scale=float(grad_scale), out=out,
            exp_avg_scales=exp_avg_scales, exp_avg_sq_scales=exp_avg_sq_scales, key=key,
            offset=offset,
        )
        return
    threads, torch_pool = pool(num_threads)
    ext.fused_adamw(
        param, grad, exp_avg, exp_avg_sq, out, int(step), float(lr), float(betas[0]),
        float(betas[1]), float(eps), float(weight_decay), bool(decoupled), float(grad_scale),
        threads, exp_avg_scales, exp_avg_sq_scales, key, offset, torch_pool,
    )

# --- the pure-torch reference: the semantics the C++ kernel must match ------------------------
# Slower (several passes), but exact in intent.


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
    state = Moments(md, exp_avg, exp_avg_sq, names=STATE, scales=scales, offset=offset)
    m, v = state.to_fp32()
    _step_fp32_(param, grad, m, v, compact=True, **hp)
    state.round_from_((m, v), key)
