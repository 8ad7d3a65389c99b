"""The second CUDA review's engine findings (issue 18 item 3), each shown where the CPU can show
it: on the emulated asynchronous device, or on ``CudaDevice`` over fake CUDA streams/events."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _helpers import rel_err, tiny_engine, train
from _tiny_gpt import batches as _batches
from _tiny_gpt import lm_loss

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.core import checks, device
from lightning_zero_offload.core.limits import BUCKET_BUFFERS
from lightning_zero_offload.testing import emulated_async_device

VOCAB = 61
SLOW_D2H = {"d2h": 40.0}


def batches(n: int) -> list:
    return _batches(n, vocab=VOCAB)


def _engine(**kw: Any) -> ZeroOffload:
    return tiny_engine(model_kw={"d": 36, "vocab": VOCAB}, precision="bf16-mixed",
                       max_grad_norm=0.5, **kw)


def _backward(engine: ZeroOffload, x: torch.Tensor, y: torch.Tensor, micro: int = 1) -> None:
    for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
        engine.backward(lm_loss(engine.module(xs), ys) / micro)


def _result(engine: ZeroOffload) -> dict:
    full = engine.full_state_dict()
    engine.teardown()
    return full


def _assert_same(got: dict, want: dict, tol: float = 1e-6) -> None:
    for name, t in want["model"].items():
        assert rel_err(got["model"][name], t) < tol, name
    for i, st in want["optimizer"]["state"].items():
        assert rel_err(got["optimizer"]["state"][i]["exp_avg_sq"], st["exp_avg_sq"]) < tol, i


# -- teardown: host buffers are freed before the pinned-memory cache is emptied ------------------

def test_teardown_frees_host_buffers_before_the_device_closes() -> None:
    engine = _engine()
    train(engine, batches(1))
    seen: list[bool] = []
    close = engine._dev.close

    def recording_close() -> None:
        seen.append(bool(engine._host.master) or engine._host.grads.staging is not None)
        close()
    engine._dev.close = recording_close  # type: ignore[method-assign]
    engine.teardown()
    assert seen == [False]  # no host buffer was alive when the device emptied the cache


def test_cuda_device_close_empties_the_pinned_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append(1), raising=False)
    dev = device.CudaDevice(torch.device("cuda"))  # its host-task thread starts lazily
    dev.close()
    assert calls == [1]


# -- zero_grad after a backward without step() drains ----------------------------------------

@pytest.mark.parametrize("micro", [1, 2])
def test_zero_grad_without_step_equals_skipping_the_batch(micro: int) -> None:
    """A bad batch's backward (accumulating micro-batches too), zero_grad, then a good batch:
    the step equals the plain run that never saw the bad batch, under slow copies."""
    bad, good = batches(2)
    plain = _engine()
    _backward(plain, *good, micro=micro)
    plain.step()
    want = _result(plain)
    with emulated_async_device(seed=0, stream_delay_ms=SLOW_D2H) as made:
        engine = _engine()
    assert len(made) == 1
    _backward(engine, *bad, micro=micro)
    engine.zero_grad()  # no step(): the transfers of the bad batch are still in flight
    # ... and are done now: nothing in flight may still write what zero_grad dropped (on CUDA
    # the 0-d statistics go back to the allocator) or read staging the next flush overwrites
    assert all(s.idle for s in made[0]._streams)  # type: ignore[attr-defined]
    assert all(t is None or t.done() for t in engine._streamer._tasks)
    _backward(engine, *good, micro=micro)
    engine.step()
    _assert_same(_result(engine), want)


# -- the weight_copy span is filed under its own step ----------------------------------------

def test_weight_copy_span_belongs_to_its_step_after_a_skipped_step() -> None:
    with emulated_async_device(seed=0):
        engine = _engine()
    engine.step()  # step 1: no gradient, skipped (the parameters' step counts stay 0)
    assert engine.last_step_skipped
    train(engine, batches(1))  # step 2: the first real one, its runs at step count 1
    engine.synchronize()
    records = {r.step: r for r in engine.profile}
    assert records[2].weight_copy > 0
    assert all(n != "weight_copy" for r in records.values() if r.step != 2 for n, *_ in r.spans)
    engine.teardown()


# -- a bucket buffer ring: bounded, and reused only after its copy ---------------------------

def test_bucket_buffer_ring_is_bounded_and_exact_when_accumulating() -> None:
    data = batches(3)
    plain = _engine()
    train(plain, data, micro=2)
    want = _result(plain)
    with emulated_async_device(seed=1, stream_delay_ms=SLOW_D2H) as made:
        engine = _engine()
    bucket_bytes = max(b.numel for b in engine.layout.buckets) * 2
    assert len(engine.layout.buckets) > 2 * BUCKET_BUFFERS
    train(engine, data, micro=2)
    assert made[0].peak_bytes <= BUCKET_BUFFERS * bucket_bytes
    _assert_same(_result(engine), want)


# -- two ranks: the reduce-scatter has its own stream ------------------------------------------

def _ranks(rank: int, world: int) -> list:
    data = [(x[rank::world], y[rank::world]) for x, y in batches(3)]
    plain = _engine()
    train(plain, data, micro=2)
    want = _result(plain)
    with emulated_async_device(seed=2, stream_delay_ms={"d2h": 20.0, "reduce": 5.0}):
        engine = _engine()
    names = [s._thread.name for s in engine._dev._streams]  # type: ignore[attr-defined]
    train(engine, data, micro=2)
    return [names, _result(engine), want]


def test_two_ranks_reduce_on_their_own_stream_and_equal_the_cpu_path() -> None:
    for names, got, want in run_ranks(_ranks, 2, timeout=300):
        assert "lzo-emulated-reduce" in names
        _assert_same(got, want)


# -- pin_memory=False on CUDA warns once ---------------------------------------------------

def test_unpinned_cuda_staging_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "_warned_unpinned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checks.resolve_pinned(False, torch.device("cuda")) is False
        assert checks.resolve_pinned(False, torch.device("cuda")) is False
        assert checks.resolve_pinned(None, torch.device("cuda")) is True
    assert len(caught) == 1
    assert "synchronous" in str(caught[0].message) and "pin_memory" in str(caught[0].message)


# -- CudaDevice over fake streams: blocking events, the current stream at each forward ----------

class _FakeStream:
    count = 0

    def __init__(self) -> None:
        _FakeStream.count += 1
        self.cuda_stream = _FakeStream.count
        self.waited: list[object] = []

    def wait_event(self, e: object) -> None:
        self.waited.append(e)


class _FakeEvent:
    def __init__(self, **kw: object) -> None:
        self.kw = kw

    def record(self, stream: object) -> None:
        self.stream = stream


def test_cuda_device_waits_on_the_stream_current_at_each_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    current = [_FakeStream()]
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    dev = device.CudaDevice(torch.device("cuda"))
    side, default, user = _FakeStream(), current[0], _FakeStream()
    dev.compute_waits(side)  # the end of step(): the weights' copies
    assert len(default.waited) == 1 and default.waited[0].stream is side
    current[0] = user  # the user's forward under torch.cuda.stream(user)
    dev.compute_point()
    dev.compute_point()  # once per stream and push
    assert user.waited == default.waited
    assert dev.record(side).e.kw["blocking"] is True  # host waits sleep, not spin


def test_cuda_device_stream_waits_orders_two_side_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    dev = device.CudaDevice(torch.device("cuda"))
    reduce, copy = _FakeStream(), _FakeStream()
    e = dev.record(reduce)
    dev.stream_waits(copy, e)
    assert copy.waited == [e.e]  # type: ignore[attr-defined]
