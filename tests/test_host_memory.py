"""Host memory at the floor (issue 19): one staging slice per bucket shard carries the gradient
down and the weights up (rule 6 ``staging_reuse``), the fp32 gradient only where the run
accumulates, and the budget counts exactly that."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.testing import emulated_async_device

CPU_ONLY = ("device_weights", "device_untrained", "buckets_in_flight")


def _mlp(width: int = 256, depth: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _engine(model: nn.Module, **cfg: object) -> ZeroOffload:
    return ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                       precision="bf16-mixed", bucket_size_mb=0.05, **cfg)


def per_param(engine: ZeroOffload) -> float:
    """Host bytes per trained parameter without the terms of a CPU compute device."""
    host = sum(v for k, v in engine.host_budget.items() if k not in CPU_ONLY)
    return host / sum(engine.layout.group_numel)


@pytest.mark.parametrize("moment_dtype,floor", [("fp32", 14.4), ("bf16", 10.4), ("int8", 8.4)])
def test_bytes_per_parameter_at_the_floor(moment_dtype: str, floor: float) -> None:
    with emulated_async_device(seed=0):
        plain = _engine(_mlp(), moment_dtype=moment_dtype)
        delayed = _engine(_mlp(), moment_dtype=moment_dtype, delayed_update=True)
        acc = _engine(_mlp(), moment_dtype=moment_dtype, accumulate=True)
    assert "out" not in plain.host_budget and plain.host_budget["grad_fp32"] == 0
    assert per_param(plain) <= floor
    assert per_param(delayed) - per_param(plain) <= 2.1
    assert 3.9 <= per_param(acc) - per_param(plain) <= 4.1
    for e in (plain, delayed, acc):  # budget = allocation
        assert e._host.allocated_bytes() == sum(
            v for k, v in e.host_budget.items() if k not in (*CPU_ONLY, "frozen_exact"))
        e.teardown()


def _step(engine: ZeroOffload, x: torch.Tensor) -> None:
    engine.backward(engine.module(x).float().square().mean())


def test_accumulate_false_refuses_and_none_allocates_lazily() -> None:
    x = torch.randn(8, 256)
    with emulated_async_device(seed=0):
        never = _engine(_mlp(), accumulate=False)
        lazy = _engine(_mlp())
    _step(never, x)
    with pytest.raises(RuntimeError, match="accumulate=True"):
        _step(never, x)
    assert not lazy._host.has_fp32_grads
    _step(lazy, x)
    assert not lazy._host.has_fp32_grads  # one backward per step: no fp32 gradient
    before = lazy.host_bytes
    assert lazy.host_budget["grad_fp32"] == 0
    _step(lazy, x)
    assert lazy._host.has_fp32_grads
    # budget = allocation: the lazily allocated fp32 gradient is counted from then on
    fp32 = 4 * sum(lazy.layout.group_shard_numel)
    assert lazy.host_budget["grad_fp32"] == fp32 and lazy.host_bytes == before + fp32
    assert lazy._host.allocated_bytes() == sum(
        lazy.host_budget[k] for k in ("master", "moments", "grad_fp32", "staging"))
    never.teardown()
    lazy.teardown()


def _saved_free_run(engine: ZeroOffload, xs: list[torch.Tensor], slow: bool) -> list:
    """Step, then the backward of a graph built before the step (its gradient does not depend
    on the weights: a first layer with an input that needs no gradient), with the end-of-step
    wait skipped, so only rule 6 keeps the d2h copy off the staging the weights' copy reads."""
    lin = engine.module
    engine.backward(lin(xs[0]).float().sum())
    pending = lin(xs[1]).float().sum()
    if slow:
        dev = engine._dev
        point, dev.compute_point = dev.compute_point, lambda: None
    engine.step()
    engine.zero_grad()
    engine.backward(pending)
    if slow:
        dev.compute_point = point
    engine.step()
    engine.synchronize()
    return [p.detach().clone() for p in lin.parameters()]


def test_next_backward_copy_waits_for_the_weights_copy() -> None:
    """Slow h2d: the next backward's d2h copy into a slice waits for the weights' copy out of
    it (else the weights pushed are the new gradient, or NaN)."""
    xs = [torch.randn(16, 64) for _ in range(2)]
    ref = _saved_free_run(_engine(_mlp(64, 1)), xs, False)
    with emulated_async_device(seed=1, stream_delay_ms={"h2d": 40.0, "d2h": 0.0}):
        emu = _engine(_mlp(64, 1))
    got = _saved_free_run(emu, xs, True)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    emu.teardown()

