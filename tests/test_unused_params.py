"""Parameters without a gradient in a step are left untouched, as ``torch.optim.AdamW`` leaves a
parameter whose ``grad`` is None: no weight decay, no moment update, no step counted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.ops import BLOCK

# Per step, the layers the forward uses: "b" comes and goes, "c" is idle for the first steps and
# "d" is never used.
SCHEDULE = [("a", "b"), ("a",), ("a", "c"), ("a",), ("a", "b", "c"), ("a",), ("a", "b")]
HP = {"lr": 0.02, "weight_decay": 0.1}


class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use: tuple[str, ...]) -> torch.Tensor:
        for name in use:
            x = getattr(self, name)(x).tanh()
        return self.head(x)


def _data(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, step_fn, schedule=SCHEDULE, first: int = 0) -> None:
    for k, use in enumerate(schedule, start=first):
        step_fn(model(_data(k), use).square().mean())


def _torch(steps: int = len(SCHEDULE)) -> tuple[Switch, torch.optim.AdamW]:
    torch.manual_seed(0)
    ref = Switch()
    opt = torch.optim.AdamW(ref.parameters(), **HP)

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none: the unused layers' grads stay None
    _train(ref, step, SCHEDULE[:steps])
    return ref, opt


def _engine(**cfg) -> ZeroOffload:
    torch.manual_seed(0)
    model = Switch()
    return ZeroOffload(model, torch.optim.AdamW(model.parameters(), **HP),
                       **{"precision": "32-true", **cfg})


def _engine_step(engine: ZeroOffload):
    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return step


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.named_parameters()}


@pytest.mark.parametrize("bucket_size_mb", [0.0001, 25.0], ids=["bucket-per-param", "one-bucket"])
def test_matches_torch_adamw_with_parameters_that_skip_steps(bucket_size_mb):
    ref, opt = _torch()
    engine = _engine(bucket_size_mb=bucket_size_mb)
    d_before = _params(engine.module.d)
    _train(engine.module, _engine_step(engine))
    got, want = _params(engine.module), _params(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(torch.equal(v, _params(engine.module.d)[k]) for k, v in d_before.items())
    # Steps per parameter, and no state for the never-used layer, as in torch's state_dict.
    full = engine.full_state_dict()["optimizer"]["state"]
    torch_state = opt.state_dict()["state"]
    assert full.keys() == torch_state.keys()
    assert {i: float(s["step"]) for i, s in full.items()} == {
        i: float(s["step"]) for i, s in torch_state.items()}


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_checkpoint_keeps_steps_per_parameter(tmp_path, sharded):
    whole = _engine()
    _train(whole.module, _engine_step(whole))
    first = _engine()
    _train(first.module, _engine_step(first), SCHEDULE[:3])  # b: 1 step, c: 1, a/head: 3
    first.save_checkpoint(tmp_path / "ckpt", sharded=sharded)
    resumed = _engine()
    resumed.load_checkpoint(tmp_path / "ckpt")
    _train(resumed.module, _engine_step(resumed), SCHEDULE[3:], first=3)
    for k, v in _params(whole.module).items():
        assert torch.equal(v, _params(resumed.module)[k]), k


def test_loading_a_torch_adamw_state_keeps_its_steps_per_parameter():
    ref, opt = _torch(steps=3)
    engine = _engine()
    engine.load_full_state_dict({"model": ref.state_dict(), "optimizer": opt.state_dict()})

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()
    _train(ref, step, SCHEDULE[3:], first=3)
    _train(engine.module, _engine_step(engine), SCHEDULE[3:], first=3)
    for k, v in _params(ref).items():
        torch.testing.assert_close(_params(engine.module)[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_an_older_shard_without_steps_per_parameter_loads_with_its_group_count():
    engine = _engine()
    _train(engine.module, _engine_step(engine), [("a", "b", "c", "d")] * 2)
    state = copy.deepcopy(engine.state_dict())
    assert state.pop("param_steps") == [2] * 10
    state["format"] = "lightning_zero_offload.shard/2"
    other = _engine()
    other.load_state_dict(state)
    assert other.full_state_dict()["optimizer"]["state"].keys() == set(range(10))
    assert {float(s["step"]) for s in other.full_state_dict()["optimizer"]["state"].values()} == {
        2.0}


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_compact_moments_of_a_skipped_parameter_are_untouched(moment_dtype):
    engine = _engine(moment_dtype=moment_dtype, bucket_size_mb=25.0)  # one bucket: a cut run
    if moment_dtype == "int8":  # parameters start on blocks: a skip touches no shared scale
        assert all(s.offset % BLOCK == 0 for s in engine.layout.slots)
    _train(engine.module, _engine_step(engine), [("a", "b", "c")] * 2)
    before = engine.full_state_dict()
    _train(engine.module, _engine_step(engine), [("a", "c")], first=2)  # b skips this step
    after = engine.full_state_dict()
    for name, t in before["model"].items():
        assert torch.equal(t, after["model"][name]) == name.startswith(("b.", "d.")), name
    index = {n: i for i, (n, _) in enumerate(engine.module.named_parameters())}
    for name in ("b.weight", "b.bias", "a.weight", "c.bias"):
        i = index[name]
        old, new = before["optimizer"]["state"][i], after["optimizer"]["state"][i]
        same = all(torch.equal(old[k], new[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
        assert same == name.startswith("b."), name


def test_delayed_update_keeps_a_skipped_parameter_where_its_last_step_left_it():
    # The delayed update writes the spare weights; a skipped range there must be the master's,
    # not what the spare held two steps ago.
    engine = _engine(precision="bf16-mixed", delayed_update=True, delayed_update_warmup=0)
    step = _engine_step(engine)
    _train(engine.module, step, [("a", "b")] * 3)
    seen = []
    for k in range(3, 8):
        _train(engine.module, step, [("a",)], first=k)
        seen.append(engine.module.b.weight.detach().clone())
    engine.synchronize()
    seen.append(engine.module.b.weight.detach().clone())
    master = engine.full_state_dict()["model"]["b.weight"]
    for w in seen[1:]:  # the first may still show step 3's update landing
        assert torch.equal(w, seen[-1])
    assert torch.equal(seen[-1], master.bfloat16())


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


def test_a_gradient_discarded_by_a_failed_backward_does_not_count():
    engine = _engine(bucket_size_mb=25.0)  # one bucket: b arrives, then the backward fails
    module = engine.module
    b_before = _params(module.b)
    with pytest.raises(RuntimeError, match="on purpose"):
        engine.backward(module.head(module.b(_FailsBackward.apply(module.a(_data(0))))).sum())
    _train(module, _engine_step(engine), [("a",)], first=1)  # no zero_grad in between
    assert all(torch.equal(v, _params(module.b)[k]) for k, v in b_before.items())


class UnusedFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)  # registered first: last in the bucket's backward order
        self.rest = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(x)


def test_a_skipped_parameter_at_the_end_of_a_bucket_is_untouched():
    # One run of stepped parameters and skipped ones after it: the run must not be widened to
    # the whole bucket shard (the shortcut for "every parameter got a gradient").
    torch.manual_seed(0)
    model = UnusedFirst()
    ref = copy.deepcopy(model)
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters(), **HP),
                         precision="32-true", bucket_size_mb=25.0)
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    for k in range(3):
        engine.backward(engine.module(_data(k)).square().mean())
        engine.step()
        engine.zero_grad()
        ref(_data(k)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for name, want in _params(ref).items():
        torch.testing.assert_close(_params(engine.module)[name], want, rtol=1e-5, atol=1e-6,
                                   msg=name)
    assert torch.equal(_params(engine.module.first)["weight"], _params(ref.first)["weight"])
