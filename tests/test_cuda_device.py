"""``CudaDevice`` where the CPU can show it: over fake CUDA streams and events (which stream
waits for which event, blocking events), its pinned-memory cache and warning, and the engine's
teardown order (host buffers freed before the device empties the pinned cache)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _helpers import tiny_engine, train
from _tiny_gpt import batches

from lightning_zero_offload.core import checks

# -- teardown: host buffers are freed before the pinned-memory cache is emptied ------------------
from lightning_zero_offload.core.device import device


def test_teardown_frees_host_buffers_before_the_device_closes() -> None:
    engine = tiny_engine(precision="bf16-mixed")
    train(engine, batches(1))
    seen: list[bool] = []
    close = engine._dev.close

    def recording_close() -> None:
        seen.append(bool(engine._host.master) or engine._host.staging[0] is not None)
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
