"""`out` aliasing `grad`: the new weights written in place over the gradient they consumed.

On every SIMD path this CPU runs, every moment format, several thread counts and the pure-torch
reference, a step with ``out=grad`` must give the bits of a step with a separate ``out``: a path
that read an element's gradient after writing its weight would read a weight as a gradient. Any
other overlap of ``out`` is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from lightning_zero_offload import ops
from lightning_zero_offload.ops import _build
from lightning_zero_offload.ops import moments as M
from lightning_zero_offload.ops.adamw import STATE as ADAM
from lightning_zero_offload.ops.adamw import fused_adamw_reference_


def from_fp32(*args):
    """Adam's state from fp32 arrays (``Moments.from_fp32`` with its names and codes)."""
    return M.Moments.from_fp32(*args, names=ADAM)

HALF = [pytest.param(torch.bfloat16, id="gbf16"), pytest.param(torch.float16, id="gf16")]
# vector widths 8 and 16, the 8-bit block (256), thread chunks (65536) all cut by these
SMALL = [1, 7, 15, 16, 17, 63, 255, 257, 4099]
LARGE = 1_000_003
PATHS = ["scalar", "avx2", "avx512", "avx512bf16", "reference"]
HPARAMS = [  # every loop instantiation: decay decoupled / L2 / none, both lerp formulas
    dict(weight_decay=0.1, decoupled=True, grad_scale=1.0),
    dict(weight_decay=0.0, grad_scale=0.5),
    dict(weight_decay=0.1, decoupled=False, grad_scale=2.0, betas=(0.3, 0.99)),
]


def _reference(p, g, *, step, seed=0, exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales,
               offset, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True,
               grad_scale=1.0, out=None, num_threads=None):
    key = M.rng_key(seed, step) if exp_avg.dtype != torch.float32 else 0
    fused_adamw_reference_(p, g, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=betas[0],
                           beta2=betas[1], eps=eps, weight_decay=weight_decay,
                           decoupled=decoupled, grad_scale=grad_scale, out=out,
                           exp_avg_scales=exp_avg_scales, exp_avg_sq_scales=exp_avg_sq_scales,
                           key=key, offset=offset)


def _path(name: str):
    """(step function, context) for one path; skips what this machine cannot run."""
    if name == "reference":
        return _reference, None
    ext = _build.load()
    if ext is None:
        pytest.skip("the C++ kernel is not in use (no compiler, or LZO_KERNEL=reference)")
    if name not in ext.available_isas():
        pytest.skip(f"this CPU has no {name} (available: {ext.available_isas()})")
    return ops.fused_adamw_, name


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    names = ("param", "exp_avg", "exp_avg_sq", "out", "exp_avg_scales", "exp_avg_sq_scales")
    assert len(got) == len(want)
    for name, x, y in zip(names, got, want, strict=False):
        assert x.dtype == y.dtype and x.shape == y.shape
        diff = (_bits(x) != _bits(y)).nonzero().flatten()
        assert diff.numel() == 0, (
            f"{what}: {name} differs in {diff.numel()} of {x.numel()} elements, first at "
            f"{diff[:5].tolist()}")


@functools.lru_cache(maxsize=4)
def _state(n: int, md: str, steps: int) -> tuple[torch.Tensor, M.Moments, list[torch.Tensor]]:
    """A seeded master, moments and fp32 gradients (built once: the 8-bit encoding is slow)."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    # moments over 8 decades, so the 8-bit codes' small values are used
    spread = torch.exp(torch.empty(n).uniform_(-9, 0, generator=gen))
    mom = from_fp32(torch.randn(n, generator=gen) * spread,
                              torch.rand(n, generator=gen) * spread**2, md)
    grads = [torch.randn(n, generator=gen) * 3 * spread.sqrt() for _ in range(steps)]
    return p, mom, grads


def _run(fn, isa: str | None, n: int, md: str, grad_dtype: torch.dtype, *, inplace: bool,
         steps: int = 2, **kw) -> list[torch.Tensor]:
    """`steps` updates from a seeded state with fresh gradients; with `inplace` each gradient is
    loaded into the one half buffer that also receives the weights (as the engine does).
    Returns [param, exp_avg, exp_avg_sq, out, scales...]."""
    p0, mom0, grads = _state(n, md, steps)
    p = p0.clone()
    mom = M.Moments.zeros(n, md, names=ADAM)
    mom.copy_(mom0)
    buf = torch.empty(n, dtype=grad_dtype)  # the in-place buffer: gradient in, weights out
    out = buf if inplace else torch.empty(n, dtype=grad_dtype)
    hp = dict(lr=1e-2, seed=5)
    hp.update(kw)
    for step, g32 in enumerate(grads, start=1):
        g = g32.to(grad_dtype)
        grad = buf.copy_(g) if inplace else g
        with ops.force_isa(isa) if isa else contextlib.nullcontext():
            fn(p, grad, step=step, out=out, **mom.kernel_args(), **hp)
    ts = [p, mom.exp_avg, mom.exp_avg_sq, out]
    if md == "int8":
        assert mom.exp_avg_scales is not None and mom.exp_avg_sq_scales is not None
        ts += [mom.exp_avg_scales, mom.exp_avg_sq_scales]
    return ts


@pytest.mark.parametrize("md", M.MOMENT_DTYPES)
@pytest.mark.parametrize("grad_dtype", HALF)
@pytest.mark.parametrize("path", PATHS)
def test_inplace_equals_separate_out_small(path: str, grad_dtype: torch.dtype, md: str) -> None:
    fn, isa = _path(path)
    for n in SMALL:
        for kw in HPARAMS:
            want = _run(fn, isa, n, md, grad_dtype, inplace=False, **kw)
            got = _run(fn, isa, n, md, grad_dtype, inplace=True, **kw)
            _assert_same(got, want, f"{path} n={n} {kw}")


@pytest.mark.parametrize("md", M.MOMENT_DTYPES)
@pytest.mark.parametrize("grad_dtype", HALF)
@pytest.mark.parametrize("path", PATHS)
def test_inplace_equals_separate_out_threads(path: str, grad_dtype: torch.dtype, md: str) -> None:
    # several 65536-element thread chunks, a partial last one and a partial last 8-bit block;
    # None: torch's intra-op pool (main thread, torch's count), 3: the kernel's own pool
    fn, isa = _path(path)
    kw = dict(HPARAMS[0], grad_scale=2.0)
    want = _run(fn, isa, LARGE, md, grad_dtype, inplace=False, num_threads=1, **kw)
    for threads in [None] if path == "reference" else [1, 2, 3, None]:
        got = _run(fn, isa, LARGE, md, grad_dtype, inplace=True, num_threads=threads, **kw)
        _assert_same(got, want, f"{path} threads={threads}")


# --- what is refused ---------------------------------------------------------------------------


def _args(n: int = 300) -> dict:
    mom = M.Moments.zeros(n, "bf16", names=ADAM)
    return dict(param=torch.randn(n), grad=torch.randn(n).bfloat16(), **mom.kernel_args())


def _overlaps() -> dict:
    n = 300

    def shifted() -> dict:  # grad and out one element apart in one buffer
        a = _args(n)
        buf = torch.randn(n + 1).bfloat16()
        a["grad"], a["out"] = buf[:n], buf[1:]
        return a

    def other_dtype() -> dict:  # the very memory of grad, read as another dtype
        a = _args(n)
        a["out"] = a["grad"].view(torch.float16)
        return a

    def over_param() -> dict:
        a = _args(n)
        a["out"] = a["param"].view(torch.bfloat16)[:n]
        return a

    def over_exp_avg() -> dict:
        a = _args(n)
        a["out"] = a["exp_avg"]
        return a

    def grad_over_exp_avg() -> dict:  # out is exactly grad, and grad overlaps a moment
        a = _args(n)
        a["grad"] = a["out"] = a["exp_avg_sq"]
        return a

    partial = "`out` overlaps `grad` but is not exactly `grad`.*may be `grad` itself"
    return {
        "shifted": (shifted, partial),
        "other_dtype": (other_dtype, partial),
        "over_param": (over_param, "`param` and `out` overlap.*may be `grad` itself"),
        "over_exp_avg": (over_exp_avg, "`exp_avg` and `out` overlap.*may be `grad` itself"),
        "grad_over_exp_avg": (grad_over_exp_avg, "`grad` and `exp_avg_sq` overlap"),
    }


OVERLAPS = _overlaps()


@pytest.mark.parametrize("case", list(OVERLAPS))
def test_any_other_overlap_raises_and_writes_nothing(case: str) -> None:
    make, match = OVERLAPS[case]
    a = make()
    tensors = [a[k] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "out")]
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=match):
        ops.fused_adamw_(a.pop("param"), a.pop("grad"), step=1, lr=1e-2, **a)
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(_bits(t), _bits(old))


def test_inplace_output_is_the_new_weights() -> None:
    # after the step the one buffer holds the weights, exactly as a separate out would
    n = 1000
    p, buf = torch.randn(n), torch.randn(n).bfloat16()
    mom = M.Moments.zeros(n, "fp32", names=ADAM)
    p2, g2 = p.clone(), buf.clone()
    ops.fused_adamw_(p, buf, step=1, lr=1e-2, out=buf, **mom.kernel_args())
    fresh = M.Moments.zeros(n, "fp32", names=ADAM)
    ops.fused_adamw_(p2, g2, step=1, lr=1e-2, **fresh.kernel_args())
    assert torch.equal(p, p2)
    assert torch.equal(buf, p2.bfloat16())
