"""The step profile recorder: fields sum their spans, steps stay apart across threads."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from lightning_zero_offload.core.device.profile import FIELDS, ProfileRecorder, summarize


def test_fields_sum_spans_and_only_closed_steps_are_reported() -> None:
    rec = ProfileRecorder()
    rec.add("fwd_bwd", 1, 0.0, 0.5)
    rec.add("cpu_step", 1, 0.5, 0.75)
    rec.add("cpu_step", 1, 1.0, 1.25)
    rec.add("grad_transfer", 1, 0.1, 0.2)  # drawn, not a summed field
    rec.add("fwd_bwd", 2, 1.0, 2.0)
    assert rec.records == []
    rec.close(1)
    (r,) = rec.records
    assert (r.step, r.fwd_bwd, r.cpu_step, r.grad_wait, r.stall) == (1, 0.5, 0.5, 0.0, 0.0)
    assert ("grad_transfer", 0.1, 0.2) in r.spans and len(r.spans) == 4
    rec.close(2)
    assert [r.step for r in rec.records] == [1, 2]


def test_span_begin_end_and_device_span_of_the_sync_device() -> None:
    from lightning_zero_offload.core.device.device import SyncDevice

    rec, dev = ProfileRecorder(), SyncDevice(torch.device("cpu"))
    rec.begin("fwd_bwd", 3)
    rec.begin("fwd_bwd", 3)  # a second forward (accumulation) keeps the first start
    with rec.span("stall", 3):
        pass
    host, start = rec.now(), dev.record(None)
    rec.add_device("weight_copy", 3, host, start, dev.record(None))
    rec.end("fwd_bwd", 3)
    rec.end("fwd_bwd", 3)  # nothing open: ignored
    rec.close(3)
    (r,) = rec.records
    names = [s[0] for s in r.spans]
    assert sorted(names) == ["fwd_bwd", "stall", "weight_copy"]
    for name, start, end in r.spans:
        assert 0.0 <= start <= end and getattr(r, name) == pytest.approx(end - start)
    fwd = next(s for s in r.spans if s[0] == "fwd_bwd")
    assert all(fwd[1] <= s[1] and s[2] <= fwd[2] for s in r.spans)


def test_worker_thread_spans_land_in_their_own_step() -> None:
    """Delayed update: the CPU step of step i is recorded while step i+1 runs on the main thread."""
    rec = ProfileRecorder()

    def worker(step: int) -> None:
        for _ in range(200):
            rec.add("cpu_step", step, 0.0, 0.001)

    t = threading.Thread(target=worker, args=(1,))
    t.start()
    for _ in range(200):
        rec.add("fwd_bwd", 2, 0.0, 0.001)
    t.join()
    rec.close(1)
    rec.close(2)
    r1, r2 = rec.records
    assert r1.cpu_step == pytest.approx(0.2) and r1.fwd_bwd == 0.0
    assert r2.fwd_bwd == pytest.approx(0.2) and r2.cpu_step == 0.0


def test_keep_drops_oldest_and_disabled_records_nothing() -> None:
    rec = ProfileRecorder(keep=3)
    for s in range(1, 6):
        rec.add("cpu_step", s, 0.0, 1.0)
        rec.close(s)
    assert [r.step for r in rec.records] == [3, 4, 5]
    off = ProfileRecorder(enabled=False)
    off.add("cpu_step", 1, 0.0, 1.0)
    off.close(1)
    assert off.records == []


def test_unknown_span_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown profile span 'cpu'"):
        ProfileRecorder().add("cpu", 1, 0.0, 1.0)


def test_dump_and_summarize(tmp_path) -> None:
    rec = ProfileRecorder()
    for s, t in ((1, 1.0), (2, 3.0)):
        rec.add("cpu_step", s, 0.0, t)
        rec.close(s)
    path = tmp_path / "p.json"
    rec.dump(str(path))
    data = json.loads(path.read_text())
    assert [r["step"] for r in data["records"]] == [1, 2]
    assert data["records"][1]["spans"] == [["cpu_step", 0.0, 3.0]]
    mean = summarize(rec.records)
    assert set(mean) == set(FIELDS) and mean["cpu_step"] == 2.0 and mean["stall"] == 0.0
    assert summarize([]) == {}


class _Event:
    """Stands in for a ``core.device.device.Event``: ``done`` until ``query``/``wait``."""

    def __init__(self, done: bool, ms: float = 0.0) -> None:
        self.done, self.ms, self.waited = done, ms, False

    def query(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited = not self.done
        self.done = True

    def seconds_since(self, start: _Event) -> float:
        return self.ms / 1000.0


def test_finished_never_waits_for_device_spans() -> None:
    rec = ProfileRecorder()
    running = _Event(False, ms=5.0)
    rec.add("cpu_step", 1, 0.0, 1.0)
    rec.add_device("weight_copy", 1, 1.0, _Event(True), running)
    rec.close(1)
    rec.add_device("weight_copy", 2, 2.0, _Event(True), _Event(True, ms=2.0))  # still open
    assert rec.finished() == [] and not running.waited  # its copy still runs: left for later
    running.done = True
    (r,) = rec.finished()
    assert (r.step, r.cpu_step, r.weight_copy) == (1, 1.0, pytest.approx(0.005))
    rec.add_device("weight_copy", 3, 3.0, _Event(True), slow := _Event(False, ms=1.0))
    rec.close(2)
    rec.close(3)
    assert [r.step for r in rec.finished()] == [1, 2]
    assert [r.step for r in rec.records] == [1, 2, 3] and slow.waited  # records waits
    assert rec.records[2].weight_copy == pytest.approx(0.001)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_span_measures_device_time() -> None:
    from lightning_zero_offload.core.device.device import CudaDevice

    rec, dev = ProfileRecorder(), CudaDevice(torch.device("cuda", torch.cuda.current_device()))
    stream = dev.side_stream("test")
    a = torch.randn(4096, 4096, device="cuda")
    dev.stream_waits_compute(stream)  # `a` is written on the compute stream
    host, start = rec.now(), dev.record(stream)

    def work() -> None:
        b = a
        for _ in range(5):
            b = b @ b.T / 64.0
    dev.run(stream, work)
    rec.add_device("weight_copy", 1, host, start, dev.record(stream))
    rec.close(1)
    (r,) = rec.records  # reading waits for the events
    assert r.weight_copy > 0.0 and r.spans[0][0] == "weight_copy"
    dev.close()


def test_spans_show_in_torch_profiler_traces() -> None:
    from _tiny_gpt import batches, lm_loss, make

    from lightning_zero_offload import ZeroOffload

    model = make()
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()), precision="32-true")
    x, y = batches(1)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.backward(lm_loss(engine.module(x), y))
        engine.step()
    names = {e.name for e in prof.events()}
    assert {"zero_offload/grad_wait", "zero_offload/cpu_step", "zero_offload/stall"} <= names
