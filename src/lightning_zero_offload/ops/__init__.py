"""The kernel's Python face: argument checks, then the C++ extension or the pure-torch reference.

``fused_adamw_`` is one AdamW (or Adam) step over flat CPU tensors in one memory pass: the gradient
is read in fp32, bf16 or fp16 and multiplied by ``grad_scale``; master weights are fp32 and updated
in place; the moments are fp32, or compact (bf16, or block-wise 8-bit with per-block scales: see
``ops.moments``) and read and written in the same pass; the new weights are optionally written,
rounded to nearest even, into a bf16 or fp16 ``out`` tensor. Every argument is checked before
anything is written.

Threads: called from the main thread with torch's thread count, the kernel runs on torch's own
intra-op pool (whose workers are still spinning after the last torch op, so waking other threads
would only compete with them); from any other thread (the delayed-update worker) it uses its own
pool. Results are bit-identical either way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

from lightning_zero_offload.ops import _build
from lightning_zero_offload.ops._reference import fused_adamw_reference_
from lightning_zero_offload.ops.moments import (
    ADAM,
    BLOCK,
    MOMENT_DTYPES,
    Moments,
    array_bytes,
    moment_bytes,
    num_blocks,
    rng_key,
)

__all__ = [
    "fused_adamw_", "fused_adamw_reference_", "backend", "available_isas", "get_isa", "force_isa",
    "check_tensor", "kernel", "pool",
    "ADAM", "BLOCK", "MOMENT_DTYPES", "Moments", "array_bytes", "moment_bytes", "num_blocks",
    "rng_key",
]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_F32 = (torch.float32,)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def backend() -> str:
    """``"cpp"`` when the compiled kernel is in use, ``"reference"`` otherwise."""
    return "cpp" if _build.load() is not None else "reference"


def available_isas() -> list[str]:
    """SIMD paths of the compiled kernel on this CPU, best first (empty with the reference)."""
    ext = _build.load()
    return [] if ext is None else list(ext.available_isas())


def get_isa() -> str:
    """The SIMD path in use: ``"avx512"``, ``"avx2"``, ``"scalar"`` or ``"reference"``."""
    ext = _build.load()
    return "reference" if ext is None else ext.get_isa()


@contextlib.contextmanager
def force_isa(name: str) -> Iterator[None]:
    """Use one SIMD path inside the block (process-wide; for tests and benchmarks).

    All paths give bit-identical results; this exists to prove that and to measure them. For a
    whole process (CI runs the numeric tests on each path), set ``LZO_KERNEL_ISA`` instead.
    """
    ext = _build.load()
    if ext is None:
        raise RuntimeError("force_isa: the C++ kernel is not in use (pure-torch reference backend)")
    previous = ext.get_isa()
    ext.set_isa(name)  # RuntimeError naming the available paths if this CPU lacks `name`
    try:
        yield
    finally:
        ext.set_isa(previous)


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None,
                 fn: str = "fused_adamw_") -> None:
    """``t`` (argument ``name`` of kernel ``fn``) is a dense contiguous CPU tensor of one of
    ``dtypes`` (and ``numel`` elements); else a clear error naming the fix."""
    # Ordered cheapest-first: this runs once per tensor per call, and calls come chunk by chunk.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(
            f"{fn}: `{name}` is on {t.device}; the CPU optimizer needs host tensors "
            f"(move it with `.cpu()`)"
        )
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: `{name}` has dtype {t.dtype}; expected one of: {names}")
    if t.layout is not torch.strided:
        raise ValueError(f"{fn}: `{name}` must be a dense (strided) tensor")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: `{name}` must be contiguous (call `.contiguous()`)")
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"{fn}: `{name}` has {t.numel()} elements but `param` has {numel}"
        )


def kernel() -> ModuleType | None:
    """The compiled extension, or None where the pure-torch reference is in use."""
    return _build.load()


def pool(num_threads: int | None) -> tuple[int, bool]:
    """``(threads, on torch's pool)`` of a kernel call: ``num_threads`` (default torch's), and
    whether the chunks may run on torch's intra-op pool (torch's count, the main thread)."""
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"`num_threads` must be an int >= 1, got {num_threads!r}")
    torch_threads = torch.get_num_threads()
    threads = int(num_threads or torch_threads)
    return threads, (threads == torch_threads
                     and threading.current_thread() is threading.main_thread())


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
    check_tensor("param", param, _F32, None)
    n = param.numel()
    check_tensor("grad", grad, _GRAD_DTYPES, n)
    check_tensor("exp_avg", exp_avg, _MOMENT_DTYPES, n)
    check_tensor("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n)
    if out is not None:
        check_tensor("out", out, _OUT_DTYPES, n)
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
            check_tensor(name, sc, _F32, None)
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
        raise ValueError(f"fused_adamw_: `num_threads` must be an int >= 1, got {num_threads!r}")
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
