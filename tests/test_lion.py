"""The Lion rule (``core.rules.lion``): the fused kernel and the device rule against
``lion_pytorch.Lion``, the engine at every placement and on two ranks, compact moments,
checkpoints, and what it refuses."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from _dist import run_ranks
from _helpers import (
    bits,
    continues_in_plain_torch,
    rel_err,
    resumes_bit_for_bit,
    tiny_engine,
    total_rel_err,
    train,
    train_plain,
)
from _tiny_gpt import batches, lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload, ops
from lightning_zero_offload.core.checkpoint.formats import CheckpointError
from lightning_zero_offload.core.rules.lion import Hyper, Lion
from lightning_zero_offload.core.rules.rules import RULES, rule_for

lion_pytorch = pytest.importorskip("lion_pytorch")
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.99)


def _hp(lr: float = 1e-2, wd: float = 0.1, betas=(0.9, 0.99)) -> Hyper:
    return Lion().hyper({"lr": lr, "weight_decay": wd, "betas": betas})


def fused_lion_(p, g, state, hp: Hyper, **kw) -> None:
    """The kernel (``ops.fused_lion_``) on a ``Moments`` chunk and a group's ``Hyper``."""
    ops.fused_lion_(p, g, **state.kernel_args(), **hp.kernel_args(), **kw)


def _reference_(p, g, state, hp: Hyper, **kw) -> None:
    """The kernel's pure-torch reference (``ops.fused_lion_reference_``), as ``fused_lion_``."""
    ops.fused_lion_reference_(p, g, **state.kernel_args(), **hp.kernel_args(), **kw)


def _torch_lion(model: torch.nn.Module, data, *, micro: int = 2, clip: float = 1.0,
                **kw) -> lion_pytorch.Lion:
    """The tiny GPT under lion_pytorch.Lion (two groups), ``micro`` micro-batches, clip."""
    opt = lion_pytorch.Lion(param_groups(model, lr=LR, wd=WD), lr=LR, betas=BETAS, **kw)
    return train_plain(model, opt, data, micro=micro, clip=clip)


def _engine(seed: int = 0, **cfg) -> ZeroOffload:
    return tiny_engine(seed, optim=lion_pytorch.Lion, lr=LR, opt_kw={"betas": BETAS},
                       max_grad_norm=1.0, **cfg)


# --- the kernel and the device rule ---------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_kernel_equals_lion_pytorch_bit_for_bit(scale: float) -> None:
    """fp32, five steps with weight decay and a gradient scale: the kernel's bits are
    lion_pytorch's on the scaled gradient (n = 4099: vector bodies and a scalar tail)."""
    n, gen = 4099, torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    ours, state = p.detach().clone(), Lion().zeros(n, "fp32")
    opt = lion_pytorch.Lion([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    rule = rule_for(opt)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        p.grad = g * scale
        opt.step()
        fused_lion_(ours, g, state, rule.hyper(opt.param_groups[0]), step=step,
                    grad_scale=scale)
    assert torch.equal(bits(ours), bits(p.detach()))
    assert torch.equal(bits(state.exp_avg), bits(opt.state[p]["exp_avg"]))


def test_decoupled_weight_decay_divides_by_the_initial_lr() -> None:
    n = 300
    p = torch.nn.Parameter(torch.randn(n))
    opt = lion_pytorch.Lion([p], lr=1e-2, weight_decay=1e-3, decoupled_weight_decay=True)
    opt.param_groups[0]["lr"] = 5e-3  # a scheduler moved it: wd still divides by 1e-2
    ours, state = p.detach().clone(), Lion().zeros(n, "fp32")
    g = torch.randn(n)
    p.grad = g.clone()
    opt.step()
    fused_lion_(ours, g, state, rule_for(opt).hyper(opt.param_groups[0]), step=1)
    assert torch.equal(ours, p.detach())
    assert rule_for(opt).hyper(opt.param_groups[0]).decay == 1 - 5e-3 * (1e-3 / 1e-2)


@pytest.mark.parametrize("md", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, None),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16)])
def test_every_simd_path_and_the_reference_give_the_same_bits(md, grad_dtype, out_dtype) -> None:
    """Three steps, chunked at a block boundary, with weights out: scalar, AVX2 and AVX-512
    paths and the pure-torch reference agree bit for bit, moments included."""
    n, gen = 4099, torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(3)]
    hp = _hp()

    def run(call) -> list[torch.Tensor]:
        p, state = p0.clone(), Lion().zeros(n, md)
        out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        for step, g in enumerate(grads, start=1):
            for a, b in ((0, 2048), (2048, n)):  # the second chunk starts at offset 2048
                call(p[a:b], g[a:b], state.chunk(a, b - a), step,
                     None if out is None else out[a:b])
        return [p, *state.fields().values(), *([] if out is None else [out])]

    def kernel(p, g, st, step, out):
        fused_lion_(p, g, st, hp, step=step, grad_scale=0.5, out=out, seed=3)

    def reference(p, g, st, step, out):
        key = ops.rng_key(3, step) if md != "fp32" else 0
        _reference_(p, g, st, hp, grad_scale=0.5, out=out, key=key)

    want = run(reference)
    if not ops.available_isas():
        pytest.skip("the C++ kernel is not in use (no compiler, or LZO_KERNEL=reference)")
    for isa in ops.available_isas():
        with ops.force_isa(isa):
            got = run(kernel)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(bits(a), bits(b)), isa


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_stays_in_its_element_at_int8(bad: float) -> None:
    """As lion_pytorch and the fp32 moment: one non-finite gradient element makes only its own
    moment (and weight, where lion_pytorch's would be) non-finite, on every SIMD path and the
    reference, the same bits; the rest of its block is the run with that gradient zeroed."""
    n, at = 3 * ops.BLOCK, ops.BLOCK + 7
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    zeroed = g.clone()
    zeroed[at] = 0.0
    g[at] = bad
    hp = _hp()

    def run(grad: torch.Tensor, md: str, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        p, state = torch.linspace(-1, 1, n), Lion().zeros(n, md)
        for step in (1, 2):  # the second step reads the stored non-finite moment back
            if isa is None:
                _reference_(p, grad if step == 1 else zeroed, state, hp, grad_scale=1.0,
                            out=None, key=ops.rng_key(0, step) if md != "fp32" else 0)
            else:
                with ops.force_isa(isa):
                    fused_lion_(p, grad if step == 1 else zeroed, state, hp, step=step)
        return p, state.to_fp32()[0]

    p32, m32 = run(g, "fp32", None)
    ref = run(g, "int8", None)
    ref0 = run(zeroed, "int8", None)
    others = torch.arange(n) != at
    for isa in [None, *ops.available_isas()]:
        p, m = run(g, "int8", isa)
        assert torch.equal(bits(p), bits(ref[0])) and torch.equal(bits(m), bits(ref[1])), isa
        for got, want in ((p, p32), (m, m32)):  # non-finite exactly where fp32's is
            assert torch.equal(torch.isnan(got), torch.isnan(want)), isa
            assert torch.equal(torch.isposinf(got), torch.isposinf(want)), isa
            assert torch.equal(torch.isneginf(got), torch.isneginf(want)), isa
        assert (~torch.isfinite(m)).nonzero().flatten().tolist() == [at]
        # one step in, the other weights are the zeroed run's; their moments as close as the
        # code keeps them (a step of E4M3 relative, the subnormal step of the block's top)
        torch.testing.assert_close(p[others], ref0[0][others], rtol=0, atol=2.5 * hp.lr)
        top = float(m32[others].abs().max())
        torch.testing.assert_close(m[others], m32[others], rtol=2**-3, atol=top * 2**-16)


def test_device_rule_equals_the_kernel() -> None:
    """The device part's torch ops (on the CPU here) and the host kernel: same bits, and the
    gradient is left as it was."""
    n, gen = 4099, torch.Generator().manual_seed(2)
    p0 = torch.randn(n, generator=gen)
    host_p, dev_p, host_m, dev_m = p0.clone(), p0.clone(), Lion().zeros(n, "fp32"), torch.zeros(n)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        kept = g.clone()
        Lion().host_update(host_p, g, host_m, _hp(), step=step, grad_scale=0.25, out=None,
                           threads=1, seed=0)
        Lion().device_update(dev_p, g, (dev_m,), _hp(), step=step, grad_scale=0.25)
        assert torch.equal(g, kept)
    assert torch.equal(dev_p, host_p) and torch.equal(dev_m, host_m.exp_avg)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_rule_on_cuda_tracks_the_kernel() -> None:
    """The device part's torch ops on CUDA against the host kernel, 1M elements, 3 steps: within
    a few sign flips (CUDA may round ``c`` differently; a sign flips only where ``c`` is within
    rounding of zero, and each flip moves one weight by 2 lr); a wrong formula is far off."""
    n, gen = 1 << 20, torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    host_p, host_m = p0.clone(), Lion().zeros(n, "fp32")
    dev_p, dev_m = p0.cuda(), torch.zeros(n, device="cuda")
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        Lion().host_update(host_p, g, host_m, _hp(), step=step, grad_scale=0.25, out=None,
                           threads=1, seed=0)
        Lion().device_update(dev_p, g.cuda(), (dev_m,), _hp(), step=step, grad_scale=0.25)
    assert rel_err(dev_p.cpu(), host_p) < 1e-4
    assert rel_err(dev_m.cpu(), host_m.exp_avg) < 1e-6


# --- the engine -------------------------------------------------------------------------------

STEPS = 20


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_engine_equals_lion_pytorch_at_every_fraction(fraction: float) -> None:
    """20 steps, two groups, two micro-batches, clip 1.0: within 1e-6 of lion_pytorch."""
    data = batches(STEPS)
    ref = make(0)
    opt = _torch_lion(ref, data)
    engine = _engine(offload_fraction=fraction, precision="32-true")
    train(engine, data, micro=2)
    assert rel_err(engine.module, ref) < 1e-6
    state = engine.full_state_dict()["optimizer"]["state"]
    params = [p for g in opt.param_groups for p in g["params"]]
    assert rel_err([state[i]["exp_avg"] for i in range(len(params))],
                   [opt.state[p]["exp_avg"] for p in params]) < 1e-6


def _ranks(rank: int, world: int) -> list[torch.Tensor]:
    per = 4 // world
    data = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            for x, y in batches(STEPS)]
    engine = _engine(precision="32-true")
    train(engine, data, micro=2)
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.slow
def test_two_gloo_ranks_equal_lion_pytorch() -> None:
    ref = make(0)
    _torch_lion(ref, batches(STEPS))
    for got in run_ranks(_ranks, 2):
        assert rel_err(got, list(ref.parameters())) < 1e-6


def test_bf16_mixed_tracks_lion_pytorch() -> None:
    """bf16 weights and gradients against lion_pytorch in fp32, within the Adam rule's
    bf16-mixed bound (3e-2, tests/test_engine.py) taken over the whole model as one vector: per
    tensor it does not hold for Lion, whose zero-initialized biases move by lr a step and a
    sign flipped by bf16 noise moves one by 2 lr (0.28 measured; Adam's 0.06-0.11)."""
    data = batches(STEPS)
    ref = make(0)
    _torch_lion(ref, data)
    engine = _engine(precision="bf16-mixed")
    train(engine, data, micro=2, gather=True)
    master = engine.full_state_dict(optimizer=False)["model"]
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, master[name].to(torch.bfloat16))  # device copy = rounded master
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert total_rel_err(master, want) < 3e-2


def _displacement_err(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    return ((got - want).norm() / (want - start).norm()).item()


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in params])


@pytest.mark.parametrize("md", ["bf16", "int8"])
def test_compact_moments_track_lion_pytorch(md: str) -> None:
    """60 steps, as a share of the displacement from the start. int8: within the Adam rule's
    bound (0.2, tests/test_moments_engine.py; 0.14 measured). bf16: Adam's (0.015) does not
    hold for Lion, whose sign amplifies the moment's rounding: lion_pytorch itself with its
    moment rounded to bf16 after every step is 0.048 off; the engine must be as close."""
    data = batches(60, batch=8)
    start = _flat(make(0).parameters())
    ref = make(0)
    _torch_lion(ref, data, micro=1)
    want = _flat(ref.parameters())
    engine = _engine(moment_dtype=md, precision="32-true")
    train(engine, data, gather=True)
    err = _displacement_err(_flat(engine.module.parameters()), want, start)
    if md == "int8":
        assert err < 0.2, f"{err:.4f} of the displacement"
    else:
        rounded = make(0)
        opt = lion_pytorch.Lion(param_groups(rounded, lr=LR, wd=WD), lr=LR, betas=BETAS)
        for x, y in data:
            lm_loss(rounded(x), y).backward()
            torch.nn.utils.clip_grad_norm_(rounded.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            for st in opt.state.values():
                st["exp_avg"].copy_(st["exp_avg"].bfloat16())
        floor = _displacement_err(_flat(rounded.parameters()), want, start)
        assert err < 1.5 * floor, f"{err:.4f} of the displacement; bf16 itself {floor:.4f}"
    shard = engine.state_dict()
    assert shard["rule"] == "lion" and set(shard["groups"][0]) == {
        "step", "master", "exp_avg", *(["exp_avg_scales"] if md == "int8" else [])}


@pytest.mark.parametrize("md", ["fp32", "int8"])
@pytest.mark.parametrize("sharded", [True, False])
def test_checkpoint_resumes_bit_for_bit(md: str, sharded: bool, tmp_path) -> None:
    resumes_bit_for_bit(lambda seed, **cfg: _engine(seed, **cfg), tmp_path / "ck",
                        moment_dtype=md, precision="32-true", sharded=sharded)


def test_consolidated_form_loads_into_a_plain_lion() -> None:
    """The full state loads into a plain model with lion_pytorch.Lion, which then continues
    as the engine does."""
    continues_in_plain_torch(_engine(precision="32-true"), lambda model: lion_pytorch.Lion(
        param_groups(model, lr=LR, wd=WD), lr=LR, betas=BETAS))


@pytest.mark.parametrize("sharded", [True, False])
def test_another_rules_checkpoint_is_refused_naming_both(sharded: bool, tmp_path) -> None:
    adam = tiny_engine(precision="32-true")
    lion = _engine(precision="32-true")
    for e in (adam, lion):
        train(e, batches(2))
    adam.save_checkpoint(tmp_path / "adam", sharded=sharded)
    lion.save_checkpoint(tmp_path / "lion", sharded=sharded)
    before = [p.detach().clone() for p in lion.module.parameters()]
    with pytest.raises(CheckpointError, match=r"Adam/AdamW's \(exp_avg, exp_avg_sq\).*Lion"):
        lion.load_checkpoint(tmp_path / "adam")
    with pytest.raises(CheckpointError, match=r"Lion's \(exp_avg\).*Adam/AdamW"):
        adam.load_checkpoint(tmp_path / "lion")
    with pytest.raises(CheckpointError, match="Lion's"):
        adam.load_state_dict(lion.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, lion.module.parameters(), strict=True))


# --- what it refuses ------------------------------------------------------------------------


def test_a_subclass_that_replaces_step_or_the_update_is_refused() -> None:
    class OwnStep(lion_pytorch.Lion):
        def step(self, closure=None):
            return None

    model = make(0)
    with pytest.raises(TypeError, match="OwnStep overrides step"):
        ZeroOffload(model, OwnStep(model.parameters()))
    opt = lion_pytorch.Lion(model.parameters())
    opt.update_fn = lambda *a: None
    with pytest.raises(TypeError, match="Lion's update_fn is not lion_pytorch's own"):
        ZeroOffload(model, opt)


class _Clamped(lion_pytorch.Lion):
    """A clamp around lion_pytorch's update_fn, functools.wraps keeping its name and module."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        inner = self.update_fn

        @functools.wraps(inner)
        def update_fn(p, grad, *rest):
            return inner(p, grad.clamp(-1e-3, 1e-3), *rest)

        self.update_fn = update_fn


class _WrappedStep(lion_pytorch.Lion):
    """A step that wraps Lion's (functools.wraps: it looks like lion_pytorch's)."""

    @functools.wraps(lion_pytorch.Lion.step)
    def step(self, closure=None):
        return lion_pytorch.Lion.step(self, closure)


class _KeepsAll(lion_pytorch.Lion):
    """Changes nothing of the update: accepted."""


def _stand_in(module: str) -> type[torch.optim.Optimizer]:
    """A class ``Lion`` in ``module`` that is not lion_pytorch.Lion (as cautious_lion's)."""
    return type("Lion", (torch.optim.RMSprop,), {"__module__": module})


@pytest.mark.parametrize("case", ["wrapped_update", "wrapped_step"])
def test_a_subclass_that_wraps_the_update_is_refused_by_module(case: str) -> None:
    model = make(0)
    cls, what = {"wrapped_update": (_Clamped, "update_fn is not lion_pytorch's own"),
                 "wrapped_step": (_WrappedStep, "overrides step")}[case]
    with pytest.raises(TypeError, match=f"test_lion.{cls.__name__}('s)? {what}.*lion_pytorch.Lion"):
        ZeroOffload(model, cls(model.parameters()))
    ZeroOffload(model, _KeepsAll(model.parameters()))


def _lion_variants() -> list[type]:
    variants = [_stand_in("lion_pytorch.cautious_lion"), _stand_in("my_lib.cautious_lion")]
    try:
        from lion_pytorch.foreach import Lion as ForeachLion
    except ImportError:
        return variants
    return [ForeachLion, *variants]


@pytest.mark.parametrize("cls", _lion_variants(), ids=lambda c: c.__module__)
def test_another_lion_is_refused_naming_it_and_the_supported_lion(cls: type) -> None:
    model = make(0)
    with pytest.raises(TypeError) as e:
        ZeroOffload(model, cls(model.parameters(), lr=1e-4))
    message = str(e.value)
    assert f"got {cls.__module__}.Lion." in message
    assert "Create the optimizer with lion_pytorch.Lion(" in message
    assert "AdamW(" not in message  # not advised to a Lion user
    for rule in RULES:  # every supported optimizer is named
        assert rule.OPTIMIZERS in message


def test_another_optimizer_is_told_every_supported_one() -> None:
    model = make(0)
    with pytest.raises(TypeError, match=r"got torch\.optim\.rmsprop\.RMSprop\. Create the "
                       r"optimizer with torch\.optim\.AdamW\(.*\) or lion_pytorch\.Lion\(.*\) or "
                       r"torch\.optim\.SGD\("):
        ZeroOffload(model, torch.optim.RMSprop(model.parameters(), lr=0.1))


def test_bad_hyperparameters_are_refused_before_any_update() -> None:
    engine = _engine(precision="32-true")
    train(engine, batches(1))
    engine.inner_optimizer.param_groups[1]["betas"] = (0.9, 1.5)
    before = [p.detach().clone() for p in engine.module.parameters()]
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x), y))
    with pytest.raises(ValueError, match=r"param group 1 has betas\[1\]=1\.5"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
