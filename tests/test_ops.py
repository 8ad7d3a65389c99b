"""The fused AdamW op: against torch.optim.AdamW/Adam, a float64 reference, the pure-torch
reference, across SIMD paths and thread counts, the bf16/fp16 output cast, and every bad input."""

from __future__ import annotations

import math
import platform

import pytest
import torch
from _helpers import assert_bits_equal, force_isa

from lightning_zero_offload import ops
from lightning_zero_offload.ops import fused_adamw_reference_

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
SIZES = [0, 1, 15, 17, 1_000_003]
HALF = (torch.bfloat16, torch.float16)


def make_state(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
            torch.rand(n, generator=g) * 0.01]


def run_steps(fn, n: int, *, steps: int = 3, grad_dtype=torch.float32, out_dtype=None,
              seed: int = 0, **kw) -> list[torch.Tensor]:
    """`steps` updates with fresh random gradients; returns [param, exp_avg, exp_avg_sq, out]."""
    p, m, v = make_state(n, seed)
    out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
    gen = torch.Generator().manual_seed(seed + 1)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True)
    hp.update(kw)
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
        fn(p, grad, m, v, step=step, out=out, **hp)
    return [p, m, v] + ([out] if out is not None else [])


def reference(p, g, m, v, *, step, lr, betas, eps, weight_decay, decoupled, out=None,
              grad_scale=1.0, num_threads=None):
    fused_adamw_reference_(p, g, m, v, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                           weight_decay=weight_decay, decoupled=decoupled,
                           grad_scale=grad_scale, out=out)


def isa_param(name: str):
    return pytest.param(name, id=name)


ISAS = [isa_param(n) for n in ("scalar", "avx2", "avx512")]


# --- semantics against torch -------------------------------------------------------------------


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_matches_torch_optimizer_fp32(decoupled: bool) -> None:
    n, steps = 10_007, 10
    p0, _, _ = make_state(n)
    ours = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    theirs = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([theirs], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        ops.fused_adamw_(ours, g, m, v, step=step, lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                         weight_decay=0.05, decoupled=decoupled)
        theirs.grad = g.clone()
        opt.step()
    rel = ((ours - theirs.detach()).abs().max() / theirs.detach().abs().max()).item()
    assert rel < 1e-6
    state = opt.state[theirs]
    assert ((m - state["exp_avg"]).abs().max() / state["exp_avg"].abs().max()).item() < 1e-6
    assert ((v - state["exp_avg_sq"]).abs().max() / state["exp_avg_sq"].abs().max()).item() < 1e-6


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_close_to_float64_reference(decoupled: bool) -> None:
    """Our fp32 result is as close to exact (float64) arithmetic as torch's own fp32 AdamW."""
    n, steps, lr, b1, b2, eps, wd = 4096, 10, 1e-2, 0.9, 0.999, 1e-8, 0.1
    p0, _, _ = make_state(n, seed=5)
    p64, m64, v64 = p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(
        n, dtype=torch.float64)
    ours, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    theirs = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([theirs], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    gen = torch.Generator().manual_seed(6)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        ops.fused_adamw_(ours, g, m, v, step=step, lr=lr, betas=(b1, b2), eps=eps,
                         weight_decay=wd, decoupled=decoupled)
        theirs.grad = g.clone()
        opt.step()
        g64 = g.double()
        if decoupled:
            p64 = p64 * (1 - lr * wd)
        else:
            g64 = g64 + wd * p64
        m64 = b1 * m64 + (1 - b1) * g64
        v64 = b2 * v64 + (1 - b2) * g64 * g64
        denom = (v64 / (1 - b2**step)).sqrt() + eps
        p64 = p64 - lr / (1 - b1**step) * m64 / denom
    err_ours = (ours.double() - p64).abs().max().item()
    err_torch = (theirs.detach().double() - p64).abs().max().item()
    assert err_ours <= 1.5 * err_torch + 1e-7
    assert err_ours / p64.abs().max().item() < 1e-6


# --- the kernel against the pure-torch reference, SIMD paths, threads ---------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, *HALF], ids=["g32", "gbf16", "gf16"])
def test_kernel_equals_reference_bitwise(ext, n: int, grad_dtype: torch.dtype) -> None:
    for out_dtype, decoupled in ((None, True), (torch.bfloat16, False), (torch.float16, True)):
        kw = dict(grad_dtype=grad_dtype, out_dtype=out_dtype, decoupled=decoupled)
        ours = run_steps(ops.fused_adamw_, n, **kw)
        ref = run_steps(reference, n, **kw)
        for a, b in zip(ours, ref, strict=True):
            assert_bits_equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", SIZES)
def test_every_simd_path_bit_identical(ext, isa: str, n: int) -> None:
    for grad_dtype, out_dtype, decoupled in ((torch.float32, torch.bfloat16, True),
                                             (torch.bfloat16, torch.float16, False),
                                             (torch.float16, torch.bfloat16, True)):
        kw = dict(grad_dtype=grad_dtype, out_dtype=out_dtype, decoupled=decoupled)
        with force_isa("scalar"):
            expected = run_steps(ops.fused_adamw_, n, **kw)
        with force_isa(isa):
            got = run_steps(ops.fused_adamw_, n, **kw)
        for a, b in zip(got, expected, strict=True):
            assert_bits_equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
def test_simd_paths_on_every_fp16_and_bf16_pattern(ext, isa: str) -> None:
    """All 65536 bit patterns as gradients (NaN payloads, inf, subnormals) give the same bits."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dtype in HALF:
        grad = patterns.view(dtype)
        results = {}
        for name in ("scalar", isa):
            p, m, v = make_state(grad.numel())
            out = torch.empty(grad.numel(), dtype=dtype)
            with force_isa(name):
                ops.fused_adamw_(p, grad, m, v, step=2, lr=1e-3, weight_decay=0.01, out=out,
                                 grad_scale=0.5)
            results[name] = (p, m, v, out)
        for a, b in zip(results["scalar"], results[isa], strict=True):
            assert_bits_equal(a, b)


def test_thread_count_does_not_change_results(ext) -> None:
    n = 1_000_003
    runs = [run_steps(ops.fused_adamw_, n, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                      num_threads=t) for t in (1, 2, 3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert_bits_equal(a, b)


def test_reference_backend_env(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = dict(grad_dtype=torch.float16, out_dtype=torch.float16, decoupled=False)
    kernel = run_steps(ops.fused_adamw_, 1000, **kw)
    assert ops.backend() == "cpp"
    monkeypatch.setenv("LZO_KERNEL", "reference")
    assert ops.backend() == "reference" and ops.get_isa() == "reference"
    with pytest.raises(RuntimeError, match="reference"):
        with ops.force_isa("scalar"):
            pass
    ref = run_steps(ops.fused_adamw_, 1000, **kw)
    for a, b in zip(kernel, ref, strict=True):
        assert_bits_equal(a, b)


def test_force_isa_unknown_and_restores(ext) -> None:
    before = ops.get_isa()
    with pytest.raises(RuntimeError, match="available"):
        with ops.force_isa("neon512"):
            pass
    assert ops.get_isa() == before
    with ops.force_isa("scalar"):
        assert ops.get_isa() == "scalar"
    assert ops.get_isa() == before == ops.available_isas()[0]


# --- grad dtypes and grad_scale ------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", HALF)
def test_half_gradients_match_torch_on_upcast(grad_dtype: torch.dtype) -> None:
    n = 5000
    p0, _, _ = make_state(n)
    ours, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    theirs = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(9)
    for step in range(1, 11):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        ops.fused_adamw_(ours, g, m, v, step=step, lr=1e-2, weight_decay=0.1)
        theirs.grad = g.float()
        opt.step()
    assert ((ours - theirs.detach()).abs().max() / theirs.detach().abs().max()).item() < 1e-6


@pytest.mark.parametrize("grad_dtype", [torch.float32, *HALF])
def test_grad_scale_equals_prescaled_gradient(grad_dtype: torch.dtype) -> None:
    n, scale = 1001, 0.37
    g = (torch.randn(n) * 100).to(grad_dtype)
    a, b = make_state(n), make_state(n)
    ops.fused_adamw_(a[0], g, a[1], a[2], step=4, lr=1e-2, grad_scale=scale)
    ops.fused_adamw_(b[0], g.float() * scale, b[1], b[2], step=4, lr=1e-2)
    for x, y in zip(a, b, strict=True):
        assert_bits_equal(x, y)
    c = make_state(n)
    ops.fused_adamw_(c[0], g, c[1], c[2], step=4, lr=1e-2)
    assert not torch.equal(a[1], c[1])  # the scale was applied


# --- the output cast -----------------------------------------------------------------------------


def _special_values() -> torch.Tensor:
    ints = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFC12345, 0x7FBFFFFF,  # NaNs, payloads
            0x00000001, 0x80000001, 0x007FFFFF]  # float32 subnormals
    as_float = torch.tensor(ints, dtype=torch.int64).to(torch.int32).view(torch.float32).tolist()
    vals = as_float + [
        0.0, -0.0, math.inf, -math.inf, 1.0, -1.0,
        1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20,  # bf16 ties to even, above the tie
        1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11),  # fp16 ties
        65504.0, 65519.0, 65520.0, 65536.0, 1e6, -1e6, 3.4e38,  # fp16 max / overflow to inf
        2**-24, 2**-25, 3 * 2**-25, 2**-26, 6e-8, 1e-7, -2**-24, 2**-14, 2**-14 - 2**-25,
        1e-40, 1e-45, 3.3895314e38, 1 / 3, 2 / 3, math.pi,
    ]
    gen = torch.Generator().manual_seed(11)
    return torch.cat([torch.tensor(vals, dtype=torch.float32),
                      torch.randn(3000, generator=gen) * 10.0 ** torch.randint(-9, 9, (3000,),
                                                                               generator=gen)])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", HALF)
def test_out_is_bitwise_cast(ext, isa: str, out_dtype: torch.dtype) -> None:
    values = _special_values()
    n = values.numel()
    p = values.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    with force_isa(isa):  # lr=0 and zero gradients leave every value (and its sign) as is
        ops.fused_adamw_(p, torch.zeros(n), m, v, step=1, lr=0.0, out=out)
    keep = ~values.isnan()
    assert_bits_equal(p[keep], values[keep])  # NaNs stay NaN (signalling ones become quiet)
    assert p[~keep].isnan().all()
    expected = p.to(out_dtype)
    if X86:
        assert_bits_equal(out, expected)
    else:  # torch's NaN encoding is platform-specific; every other value must match exactly
        finite = ~p.isnan()
        assert_bits_equal(out[finite], expected[finite])
        assert out[~finite].isnan().all()


def test_out_after_real_update_is_cast_of_param() -> None:
    for out_dtype in HALF:
        p, m, v, out = run_steps(ops.fused_adamw_, 100_003, out_dtype=out_dtype)
        assert_bits_equal(out, p.to(out_dtype))


def test_nan_and_inf_propagate() -> None:
    p, m, v = make_state(64)
    g = torch.randn(64)
    g[3], g[5] = math.nan, math.inf
    p[7] = math.nan
    ops.fused_adamw_(p, g, m, v, step=1, lr=1e-3)
    assert p[3].isnan() and m[3].isnan() and v[3].isnan()
    assert p[5].isnan() and m[5].isinf() and v[5].isinf()  # inf/inf in the update
    assert p[7].isnan()
    assert torch.isfinite(p[[0, 1, 2, 4, 6, 8]]).all()


# --- bad inputs ----------------------------------------------------------------------------------


def _bad_cases():
    n = 33

    def base():
        return dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n),
                    exp_avg_sq=torch.zeros(n), out=torch.empty(n, dtype=torch.bfloat16),
                    step=1, lr=1e-3)

    def with_(**kw):
        def make():
            args = base()
            for key, fn in kw.items():
                args[key] = fn(args)
            return args
        return make

    return {
        "param_fp64": (with_(param=lambda a: a["param"].double()), TypeError, "param"),
        "param_bf16": (with_(param=lambda a: a["param"].bfloat16()), TypeError, "param"),
        "grad_int": (with_(grad=lambda a: a["grad"].int()), TypeError, "grad"),
        "grad_fp64": (with_(grad=lambda a: a["grad"].double()), TypeError, "grad"),
        "exp_avg_bf16": (with_(exp_avg=lambda a: a["exp_avg"].bfloat16()), TypeError, "exp_avg"),
        "exp_avg_sq_fp16": (with_(exp_avg_sq=lambda a: a["exp_avg_sq"].half()), TypeError,
                            "exp_avg_sq"),
        "out_fp32": (with_(out=lambda a: torch.empty(n)), TypeError, "out"),
        "grad_meta": (with_(grad=lambda a: torch.empty(n, device="meta")), ValueError, "grad"),
        "out_meta": (with_(out=lambda a: torch.empty(n, device="meta", dtype=torch.bfloat16)),
                     ValueError, "out"),
        "grad_not_contiguous": (with_(grad=lambda a: torch.randn(2 * n)[::2]), ValueError,
                                "contiguous"),
        "exp_avg_not_contiguous": (with_(exp_avg=lambda a: torch.zeros(n, 2)[:, 0]), ValueError,
                                   "contiguous"),
        "grad_numel": (with_(grad=lambda a: torch.randn(n + 1)), ValueError, "elements"),
        "out_numel": (with_(out=lambda a: torch.empty(n - 1, dtype=torch.bfloat16)), ValueError,
                      "elements"),
        "grad_sparse": (with_(grad=lambda a: a["grad"].to_sparse()), (TypeError, ValueError),
                        "grad"),
        "step_0": (with_(step=lambda a: 0), ValueError, "step"),
        "step_float": (with_(step=lambda a: 1.0), ValueError, "step"),
        "lr_negative": (with_(lr=lambda a: -1.0), ValueError, "lr"),
        "lr_nan": (with_(lr=lambda a: math.nan), ValueError, "lr"),
        "alias_grad_param": (with_(grad=lambda a: a["param"]), ValueError, "overlap"),
        "alias_moments": (with_(exp_avg_sq=lambda a: a["exp_avg"]), ValueError, "overlap"),
        "alias_out_in_exp_avg": (with_(out=lambda a: a["exp_avg"].view(torch.bfloat16)[:n]),
                                 ValueError, "overlap"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_and_writes_nothing(case: str) -> None:
    make, exc, match = BAD[case]
    args = make()
    before = {k: t.clone() for k, t in args.items()
              if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse}
    tensors = [args.pop(k) for k in ("param", "grad", "exp_avg", "exp_avg_sq")]
    with pytest.raises(exc, match=match):
        ops.fused_adamw_(*tensors, **args)
    after = dict(zip(("param", "grad", "exp_avg", "exp_avg_sq"), tensors, strict=True))
    after["out"] = args["out"]
    for key, old in before.items():
        assert_bits_equal(after[key], old)


@pytest.mark.parametrize("kw", [dict(betas=(1.0, 0.9)), dict(eps=-1.0), dict(weight_decay=-0.1),
                                dict(num_threads=0), dict(grad_scale="2")])
def test_bad_hyperparameters_raise(kw: dict) -> None:
    p, m, v = make_state(8)
    before = [t.clone() for t in (p, m, v)]
    with pytest.raises((TypeError, ValueError)):
        ops.fused_adamw_(p, torch.randn(8), m, v, step=1, lr=1e-3, **kw)
    for a, b in zip((p, m, v), before, strict=True):
        assert_bits_equal(a, b)
