"""Step hooks (issue 44 item 6): hooks on the user's optimizer, on the engine's optimizer and
torch's global ones run once per engine step, with the optimizer they were registered on, around
the update, whichever way the step is called; not on an fp16 overflow (``GradScaler`` skips
``step()``), not per accumulation micro-step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from _helpers import tiny_engine, train
from _tiny_gpt import batches, lm_loss
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from lightning_zero_offload import ZeroOffload


def _optims() -> list[type]:
    try:
        import lion_pytorch
    except ImportError:
        return [torch.optim.AdamW]
    return [torch.optim.AdamW, lion_pytorch.Lion]


class Log:
    """Records each hook call: which hook, the optimizer it got, the weights it saw."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, torch.Tensor]] = []

    def hook(self, name: str):
        def record(optimizer, args, kwargs) -> None:
            first = optimizer.param_groups[0]["params"][0]
            self.calls.append((name, optimizer, first.detach().float().clone()))
        return record

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@contextmanager
def global_hooks(log: Log) -> Iterator[None]:
    handles = [register_optimizer_step_pre_hook(log.hook("global_pre")),
               register_optimizer_step_post_hook(log.hook("global_post"))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _hooked_engine(optim: type, log: Log, **cfg) -> ZeroOffload:
    engine = tiny_engine(0, optim=optim, **cfg)
    user = engine.inner_optimizer
    user.register_step_pre_hook(log.hook("user_pre"))
    user.register_step_post_hook(log.hook("user_post"))
    engine.optimizer.register_step_pre_hook(log.hook("facade_pre"))
    engine.optimizer.register_step_post_hook(log.hook("facade_post"))
    return engine


ONE_STEP = ["global_pre", "user_pre", "facade_pre", "user_post", "facade_post", "global_post"]


@pytest.mark.parametrize("optim", _optims(), ids=lambda c: c.__module__.split(".")[0])
@pytest.mark.parametrize("through", ["engine", "facade"])
def test_every_hook_runs_once_per_step_with_its_optimizer(optim: type, through: str) -> None:
    log = Log()
    engine = _hooked_engine(optim, log, precision="32-true")
    with global_hooks(log):
        for x, y in batches(3):
            for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):  # 2 micro-steps
                engine.backward(lm_loss(engine.module(xs), ys) / 2)
            engine.step() if through == "engine" else engine.optimizer.step()
            engine.zero_grad()
    assert log.names() == ONE_STEP * 3
    first = engine.inner_optimizer.param_groups[0]["params"][0]
    for name, optimizer, _ in log.calls:
        if name.startswith("facade"):
            assert optimizer is engine.optimizer
        else:  # the user's and the global hooks get the user's optimizer, as torch calls them
            assert optimizer is engine.inner_optimizer
    # the pre hooks see the weights before the update, the post hooks after it
    for i in range(3):
        step = log.calls[i * 6:(i + 1) * 6]
        before, after = step[0][2], step[-1][2]
        assert all(torch.equal(c[2], before) for c in step[:3])
        assert all(torch.equal(c[2], after) for c in step[3:])
        assert not torch.equal(before, after)
    assert torch.equal(log.calls[-1][2], first.detach().float())


def test_a_pre_hooks_lr_change_is_used_by_that_step() -> None:
    """As torch's step would: the hyperparameters are read after the pre hooks."""
    engine = tiny_engine(0, precision="32-true")
    def no_lr(optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.0

    engine.inner_optimizer.register_step_pre_hook(no_lr)
    engine.inner_optimizer.param_groups[0]["weight_decay"] = 0.0
    engine.inner_optimizer.param_groups[1]["weight_decay"] = 0.0
    before = [p.detach().clone() for p in engine.module.parameters()]
    train(engine, batches(1))
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


def test_no_hook_runs_on_an_fp16_overflow_step() -> None:
    log = Log()
    engine = _hooked_engine(torch.optim.AdamW, log, precision="16-mixed", max_grad_norm=1.0)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x), y) * float("inf"))
    engine.step()
    assert engine.last_step_skipped and log.calls == []
    engine.zero_grad()
    train(engine, batches(1))
    assert log.names() == [n for n in ONE_STEP if not n.startswith("global")]


def test_a_removed_hook_no_longer_runs() -> None:
    log = Log()
    engine = tiny_engine(0, precision="32-true")
    handle = engine.optimizer.register_step_post_hook(log.hook("facade_post"))
    train(engine, batches(1))
    handle.remove()
    train(engine, batches(1))
    assert log.names() == ["facade_post"]
