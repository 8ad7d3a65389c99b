"""The device path's ordering, on the CPU: the emulated asynchronous device must give exactly what
the synchronous CPU path gives (a missing wait shows up as a different result)."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _helpers import rel_err, tiny_engine, train
from _tiny_gpt import batches as _batches
from _tiny_gpt import lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.core.limits import MAX_IN_FLIGHT
from lightning_zero_offload.testing import emulated_async_device

SEEDS = (0, 1, 2)
VOCAB = 61  # with d=36: parameter sizes off the 16-element alignment, so buckets have padding
CASES = [(p, d) for p in ("32-true", "bf16-mixed") for d in (False, True)]
STEPS = 6


def batches(n: int) -> list:
    return _batches(n, vocab=VOCAB)


def _engine(precision: str, delayed: bool, **kw: Any) -> ZeroOffload:
    return tiny_engine(model_kw={"d": 36, "vocab": VOCAB}, precision=precision, max_grad_norm=0.5,
                       delayed_update=delayed, delayed_update_warmup=2, **kw)


def _train(engine: ZeroOffload, data: list, micro: int = 2, gather: bool = True) -> list[float]:
    """Two micro-batches a step, each synchronizing, and the weights gathered at the end."""
    return train(engine, data, micro=micro, gather=gather).losses


def _run(precision: str, delayed: bool, seed: int | None, data: list, micro: int = 2) -> dict:
    if seed is None:
        engine = _engine(precision, delayed)
        losses = _train(engine, data, micro)
    else:
        with emulated_async_device(seed=seed, max_delay_ms=3.0) as made:
            engine = _engine(precision, delayed)
        assert len(made) == 1  # the engine really runs on the emulated device
        losses = _train(engine, data, micro)
    out = {"losses": losses, "full": engine.full_state_dict()}
    engine.teardown()
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    for name, t in want["full"]["model"].items():
        assert rel_err(got["full"]["model"][name], t) < 1e-6, name
    for i, st in want["full"]["optimizer"]["state"].items():
        assert rel_err(got["full"]["optimizer"]["state"][i]["exp_avg_sq"], st["exp_avg_sq"]) < 1e-6


@pytest.mark.parametrize("micro", [1, 2])  # accumulation off (no fp32 host gradient) and on
@pytest.mark.parametrize(("precision", "delayed"), CASES)
def test_emulated_device_equals_the_cpu_path(precision: str, delayed: bool, micro: int) -> None:
    data = batches(STEPS)
    want = _run(precision, delayed, None, data, micro)
    for seed in SEEDS:
        _assert_same(_run(precision, delayed, seed, data, micro), want)


def test_slow_weight_copies_equal_the_cpu_path() -> None:
    """Copies slower than a step: under delayed update the worker's next kernel must wait for
    the previous step's copies to have read the output buffers it rewrites."""
    data = batches(STEPS)
    engine = _engine("bf16-mixed", True)
    want = {"losses": _train(engine, data, micro=1), "full": engine.full_state_dict()}
    with emulated_async_device(seed=0, max_delay_ms=0.5, stream_delay_ms={"h2d": 40.0}):
        engine = _engine("bf16-mixed", True)
    got = {"losses": _train(engine, data, micro=1), "full": engine.full_state_dict()}
    engine.teardown()
    _assert_same(got, want)


def test_one_bucket_accumulating_equals_the_cpu_path() -> None:
    """One bucket: no later bucket's in-flight bound waits for its copies, so only the host
    task's own wait orders a flush after the previous one."""
    data = batches(4)

    def run(seed: int | None) -> dict:
        model = make()
        with emulated_async_device(seed=seed or 0) if seed is not None else _nothing():
            engine = ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 precision="bf16-mixed", max_grad_norm=0.5, bucket_size_mb=64)
        assert len(engine.layout.buckets) == 1
        out = {"losses": _train(engine, data, micro=3), "full": engine.full_state_dict()}
        engine.teardown()
        return out

    want = run(None)
    for seed in SEEDS:
        _assert_same(run(seed), want)


def _ranks_emulated(rank: int, world: int) -> list:
    data = [(x[rank::world], y[rank::world]) for x, y in batches(STEPS)]
    out = []
    for precision, delayed in CASES:
        want = _run(precision, delayed, None, data)
        out.append([(_run(precision, delayed, seed, data), want) for seed in SEEDS])
    return out


@pytest.mark.slow
def test_emulated_device_equals_the_cpu_path_on_two_ranks() -> None:
    for per_rank in run_ranks(_ranks_emulated, 2, timeout=600):
        for case in per_rank:
            for got, want in case:
                _assert_same(got, want)


def test_gradient_buckets_in_flight_are_bounded() -> None:
    """F6: with slow copies, a new bucket waits for the oldest instead of piling up."""
    with emulated_async_device(seed=0, max_delay_ms=20.0) as made:
        engine = _engine("bf16-mixed", False)
    bucket_bytes = max(b.numel for b in engine.layout.buckets) * 2
    assert len(engine.layout.buckets) > 4 * MAX_IN_FLIGHT
    weights = made[0].live_bytes  # the device weights, counted since they are device memory
    _train(engine, batches(2), micro=1)
    assert made[0].peak_bytes - weights <= (MAX_IN_FLIGHT + 1) * bucket_bytes
    engine.teardown()


def _live_storages() -> dict[int, int]:
    """Every CPU tensor storage alive now: data pointer -> bytes."""
    gc.collect()
    out = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        if not t.is_meta and t.device.type == "cpu":
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_every_host_buffer_is_in_the_preflight_budget(emulated: bool, precision: str) -> None:
    """Everything the engine holds after training with accumulation and delayed update (so the
    fp32 gradients, spare sets and staging all exist) fits in what the preflight check
    budgeted, and the budget is not padded beyond what can exist."""
    data = batches(5)
    before = _live_storages()
    with emulated_async_device(seed=0) if emulated else _nothing():
        model = make(d=64)
        engine = ZeroOffload(model, torch.optim.AdamW(param_groups(model)), precision=precision,
                             bucket_size_mb=0.05, delayed_update=True, delayed_update_warmup=1,
                             accumulate=True)  # None would budget the run without fp32 grads
    del model
    _train(engine, data)
    engine.synchronize()
    held = sum(n for p, n in _live_storages().items() if p not in before and n >= 1024)
    assert held <= engine.host_bytes
    assert held >= 0.8 * engine.host_bytes  # the budget counts what exists, not a guess
    engine.teardown()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _ranks_rank0_state_dict(rank: int, world: int, alone: bool) -> list:
    engine = _engine("32-true", True)
    data = [(x[rank::world], y[rank::world]) for x, y in batches(STEPS)]
    _train(engine, data[:4], gather=False)  # past the warm-up: step 4's update is pending
    if alone and rank == 0:
        shard = engine.state_dict()  # rank 0 only, as logging or a custom save would
        assert shard["groups"][0]["step"] == 4
    _train(engine, data[4:])
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.slow
def test_state_dict_on_rank_zero_alone_does_not_hang() -> None:
    """F2: joining the delayed step is local; the gather waits for the next collective call."""
    got = run_ranks(_ranks_rank0_state_dict, 2, True, timeout=120)
    want = run_ranks(_ranks_rank0_state_dict, 2, False, timeout=120)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_accumulation_moves_gradients_off_the_autograd_thread(monkeypatch) -> None:
    """F5 and F1: from the second micro-batch on, the previous flush is moved into the fp32
    gradient by a host task, not on the thread running backward; the fp32 gradient itself is
    allocated before autograd starts, never inside a hook."""
    import threading

    from lightning_zero_offload.core.buckets.host import HostBuffers
    from lightning_zero_offload.core.buckets.stage import HostGradSide

    calls: list[tuple[str, bool]] = []
    grad, alloc = HostGradSide.fp32_grad, HostBuffers.allocate_fp32

    def spy_grad(self: HostGradSide) -> torch.Tensor:
        calls.append((threading.current_thread().name, in_backward[0]))
        return grad(self)

    def spy_alloc(self: HostBuffers) -> None:
        if not self.has_fp32_grads:  # a real allocation, not the no-op of a later call
            allocs.append(torch._C._current_autograd_node() is None)
        alloc(self)

    in_backward, allocs = [False], []
    monkeypatch.setattr(HostGradSide, "fp32_grad", spy_grad)
    monkeypatch.setattr(HostBuffers, "allocate_fp32", spy_alloc)
    with emulated_async_device(seed=0):
        engine = _engine("bf16-mixed", False)
    x, y = batches(1)[0]
    for xs, ys in zip(x.chunk(3), y.chunk(3), strict=True):
        in_backward[0] = True
        engine.backward(lm_loss(engine.module(xs), ys))
        in_backward[0] = False
    engine.step()
    main = threading.main_thread().name
    during = [name for name, bwd in calls if bwd]
    assert during and main not in during  # moved by the host task while backward ran
    assert allocs and all(allocs)  # allocated outside autograd
    engine.teardown()


def _fail_once(monkeypatch, at: int) -> None:
    import lightning_zero_offload.ops.adamw as step_mod

    real, count = step_mod.fused_adamw_, [0]

    def flaky(*a: object, **k: object) -> None:
        count[0] += 1
        if count[0] == at:
            raise RuntimeError("injected kernel failure")
        real(*a, **k)
    monkeypatch.setattr(step_mod, "fused_adamw_", flaky)


def test_a_failed_push_leaves_no_stale_copy_span(monkeypatch) -> None:
    """F3: an exception in the middle of the kernel's copies does not leave the push open, so
    the next step's weight_copy span starts with its own copies."""
    import time

    with emulated_async_device(seed=0):
        engine = _engine("bf16-mixed", False)
    data = batches(3)
    _train(engine, data[:1], micro=1)
    n = len(engine.layout.buckets)
    _fail_once(monkeypatch, at=n // 2 + 1)  # half-way through the next step's buckets
    x, y = data[1]
    engine.backward(lm_loss(engine.module(x), y))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.zero_grad()
    time.sleep(0.5)
    _train(engine, data[2:], micro=1)
    last = engine.profile[-1]
    assert 0.0 < last.weight_copy < 0.4
    engine.teardown()


def test_delayed_weight_copy_span_ends_with_its_copies() -> None:
    """F4: under delayed update the span does not run on into the next forward/backward."""
    import time

    with emulated_async_device(seed=0):
        engine = _engine("bf16-mixed", True)
    for x, y in batches(6):
        engine.backward(lm_loss(engine.module(x), y))
        engine.step()
        engine.zero_grad()
        time.sleep(0.3)  # the next forward starts late
    engine.synchronize()
    delayed = [r for r in engine.profile if r.step > 2]
    assert delayed and all(0.0 < r.weight_copy < 0.25 for r in delayed)
    engine.teardown()


def test_the_seed_variable_puts_a_cpu_engine_on_the_emulated_device(monkeypatch) -> None:
    """``LZO_EMULATED_DEVICE_SEED`` alone (no block) chooses the emulated device; unset, the plain
    CPU one. (``import lightning_zero_offload`` does not load it: tests/test_imports.py.)"""
    from lightning_zero_offload.core.device.device import SyncDevice
    from lightning_zero_offload.testing import EmulatedDevice

    monkeypatch.setenv("LZO_EMULATED_DEVICE_SEED", "1")
    engine = tiny_engine()
    assert isinstance(engine._dev, EmulatedDevice)
    engine.teardown()
    monkeypatch.delenv("LZO_EMULATED_DEVICE_SEED")
    engine = tiny_engine()
    assert type(engine._dev) is SyncDevice
    engine.teardown()


def test_a_seed_variable_that_is_not_an_integer_is_refused_naming_it(monkeypatch) -> None:
    monkeypatch.setenv("LZO_EMULATED_DEVICE_SEED", "yes")
    with pytest.raises(ValueError, match="LZO_EMULATED_DEVICE_SEED='yes' is not an integer"):
        tiny_engine()
