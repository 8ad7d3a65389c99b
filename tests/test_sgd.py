"""The SGD rule (``core.rules.sgd``): ``torch.optim.SGD`` with momentum, dampening, Nesterov, weight
decay and ``maximize`` against plain torch at every placement and on two ranks, a checkpoint
that resumes bit for bit and loads into plain torch, compact momentum, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _helpers import (
    continues_in_plain_torch,
    rel_err,
    resumes_bit_for_bit,
    train,
    train_plain,
)
from _tiny_gpt import batches, lm_loss, make

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.core.rules.rules import rule_named

LR, STEPS = 0.05, 20


def _groups(model: torch.nn.Module) -> list[dict]:
    """Two groups: the matrices with Nesterov momentum and weight decay, the vectors with
    none (``momentum=0``: no buffer in torch), maximizing their negated loss's direction off."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            {"params": other, "momentum": 0.0, "lr": LR * 0.5}]


def _torch_sgd(model: torch.nn.Module, data, *, groups=_groups, micro: int = 2,
               clip: float = 1.0, **kw) -> torch.optim.SGD:
    opt = torch.optim.SGD(groups(model), lr=LR, **kw)
    return train_plain(model, opt, data, micro=micro, clip=clip)


def _engine(seed: int = 0, *, groups=_groups, opt_kw: dict | None = None, **cfg) -> ZeroOffload:
    model = make(seed)
    opt = torch.optim.SGD(groups(model), lr=LR, **(opt_kw or {}))
    return ZeroOffload(model, opt, max_grad_norm=1.0, bucket_size_mb=0.01, **cfg)


def _buffers(engine: ZeroOffload, opt: torch.optim.SGD) -> tuple[list, list]:
    """The engine's and torch's momentum buffers of every parameter torch keeps one for."""
    state = engine.full_state_dict()["optimizer"]["state"]
    params = [p for g in opt.param_groups for p in g["params"]]
    kept = [i for i, p in enumerate(params) if "momentum_buffer" in opt.state[p]]
    assert kept  # the Nesterov group keeps one
    return ([state[i]["momentum_buffer"] for i in kept],
            [opt.state[params[i]]["momentum_buffer"] for i in kept])


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_engine_equals_torch_sgd_at_every_fraction(fraction: float) -> None:
    """20 steps, two groups (Nesterov with decay; momentum=0), two micro-batches, clip 1.0:
    within 1e-6 of torch.optim.SGD, weights and momentum buffers."""
    data = batches(STEPS)
    ref = make(0)
    opt = _torch_sgd(ref, data)
    engine = _engine(offload_fraction=fraction, precision="32-true")
    train(engine, data, micro=2)
    assert rel_err(engine.module, ref) < 1e-6
    assert rel_err(*_buffers(engine, opt)) < 1e-6


@pytest.mark.parametrize("kw", [{"momentum": 0.8, "dampening": 0.3, "maximize": True},
                                {"momentum": 0.0, "weight_decay": 0.1}])
def test_dampening_maximize_and_no_momentum_equal_torch(kw: dict) -> None:
    """The options the two groups above leave out, on one group of every parameter."""
    def groups(model):
        return [{"params": list(model.parameters())}]
    data = batches(STEPS)
    ref = make(0)
    _torch_sgd(ref, data, groups=groups, **kw)
    engine = _engine(groups=groups, opt_kw=kw, offload_fraction=0.5, precision="32-true")
    train(engine, data, micro=2)
    assert rel_err(engine.module, ref) < 1e-6


def _ranks(rank: int, world: int, fraction: float) -> list[torch.Tensor]:
    per = 4 // world
    data = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            for x, y in batches(STEPS)]
    engine = _engine(offload_fraction=fraction, precision="32-true")
    train(engine, data, micro=2)
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_two_gloo_ranks_equal_torch_sgd(fraction: float) -> None:
    """Each rank's half of every batch as two micro-batches of its own: torch's reference takes
    the same four quarters as micro-batches of one step (the ranks' split)."""
    ref = make(0)
    data = [(x, y) for x, y in batches(STEPS)]
    _torch_sgd(ref, data, micro=4)
    for got in run_ranks(_ranks, 2, fraction):
        assert rel_err(got, list(ref.parameters())) < 1e-6


@pytest.mark.parametrize("md", ["fp32", "int8"])
@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("momentum", [True, False])
def test_checkpoint_resumes_bit_for_bit(md: str, sharded: bool, momentum: bool,
                                        tmp_path) -> None:
    groups = _groups if momentum else (lambda m: [{"params": list(m.parameters())}])
    resumes_bit_for_bit(lambda seed, **cfg: _engine(seed, groups=groups, **cfg),
                        tmp_path / "ck", moment_dtype=md, precision="32-true", sharded=sharded)


def test_consolidated_form_loads_into_a_plain_torch_sgd() -> None:
    """The full state loads into a plain model with torch.optim.SGD, which then continues as
    the engine does."""
    continues_in_plain_torch(_engine(precision="32-true"),
                             lambda model: torch.optim.SGD(_groups(model), lr=LR))


# The Adam rule's bounds for its stored first moment (tests/test_moments_engine.py: about 3x
# what each format gives there), as a share of the weights' displacement from the start.
TRACK = {"bf16": 0.015, "int8": 0.2}


@pytest.mark.parametrize("md", ["bf16", "int8"])
def test_compact_momentum_tracks_torch(md: str) -> None:
    """A compact momentum buffer (stochastically rounded as Adam's first moment) stays near fp32
    torch over 20 steps."""
    data = batches(STEPS)
    start, ref = make(0), make(0)
    _torch_sgd(ref, data)
    engine = _engine(moment_dtype=md, precision="32-true")
    train(engine, data, micro=2)
    with torch.no_grad():
        moved = torch.cat([(p - s).flatten() for p, s in zip(ref.parameters(),
                                                             start.parameters(), strict=True)])
        diff = torch.cat([(p - q).flatten() for p, q in zip(engine.module.parameters(),
                                                            ref.parameters(), strict=True)])
    err = float(diff.norm() / moved.norm())
    assert 0 < err < TRACK[md], f"{err:.4f} of the displacement"


def test_state_bytes_follow_the_optimizers_momentum() -> None:
    """momentum=0 in every group keeps no state at all; momentum anywhere keeps one buffer."""
    none = rule_named("sgd", momentum=0.0)
    some = rule_named("sgd", momentum=0.9)
    assert none.names == () and none.host_bytes(1000, "fp32") == 0
    assert some.names == ("momentum_buffer",) and some.host_bytes(1000, "fp32") == 4000
    engine = _engine(groups=lambda m: [{"params": list(m.parameters())}],
                     precision="32-true")
    train(engine, batches(2))
    state = engine.full_state_dict()["optimizer"]["state"]
    assert state and all(st.keys() == {"step"} for st in state.values())


def test_momentum_turned_on_later_is_refused_with_nothing_updated() -> None:
    engine = _engine(groups=lambda m: [{"params": list(m.parameters())}], precision="32-true")
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.optimizer.param_groups[0]["momentum"] = 0.9
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x), y))
    with pytest.raises(ValueError, match="momentum=0 in every group"):
        engine.step()
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), before,
                                                 strict=True))


def test_the_planner_plans_sgd_with_and_without_momentum() -> None:
    """``lzo-plan --optimizer sgd``: momentum adds its buffer, 4 bytes a trained parameter in
    fp32 (the rest of the host figure is the same), 1 in int8 plus its block scales."""
    from lightning_zero_offload.planner import plan

    n = 10**8
    plain = plan(n, optimizer="sgd", measure=False)
    fp32 = plan(n, optimizer="sgd", optimizer_options={"momentum": 0.9}, measure=False)
    int8 = plan(n, optimizer="sgd", optimizer_options={"momentum": 0.9}, measure=False,
                moment_dtype="int8")
    assert plain.optimizer == "sgd"
    extra = fp32.host_bytes_per_rank - plain.host_bytes_per_rank
    assert 4 * n <= extra <= 4 * n * 1.01  # bucket alignment
    assert 0 < int8.host_bytes_per_rank - plain.host_bytes_per_rank < extra / 3
