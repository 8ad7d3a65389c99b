"""The emulated device's race detector (``testing.race_detector``): a missing wait of any kind
raises ``StreamOrderError``, naming the streams, the buffer's role and the rule; without skips the
run is clean and unchanged."""

from __future__ import annotations

import contextlib
import re
import threading

import pytest
import torch
from _dist import run_ranks
from _helpers import tiny_engine, train
from _tiny_gpt import batches, lm_loss

from lightning_zero_offload.testing import StreamOrderError, emulated_async_device
from lightning_zero_offload.testing.emulated_device import EmulatedDevice


def _loop(skip: set[str], delayed: bool = False) -> list[float]:
    with emulated_async_device(seed=1, skip_waits=skip):
        engine = tiny_engine(precision="bf16-mixed", delayed_update=delayed)
        try:
            return train(engine, batches(3)).losses
        finally:  # a race stops the loop mid-backward: no stream thread outlives the test
            with contextlib.suppress(Exception):
                engine.teardown(copy_weights_to_module=False)


def test_skipping_stream_waits_compute_raises() -> None:
    with pytest.raises(StreamOrderError, match=r"bucket buffer on the d2h stream.*rule 3"):
        _loop({"stream_waits_compute"})


# wait kind -> what the message names (the mutation table; "synchronize" is redundant after
# drain + land, so nothing can catch it)
CAUGHT = {
    "stream_waits_compute:d2h": r"bucket buffer on the d2h stream.*compute stream.*rule 3",
    "compute_waits": r"device weights.*h2d stream.*compute stream",
    # the host's read, or (the host having run ahead) the h2d copy of the weights written over it
    "event_wait": r"staging slice on the (host|h2d) stream.*d2h stream.*rule 1",
}
# "release" (record_stream) is not in the table: bucket buffers now live in a fixed ring
# (core.transfer.ring) reused after compute_waits_event, so in this loop release only returns
# buffers the ring never hands out again; a loop that overflows the ring would be needed to show it.


@pytest.mark.parametrize("kind", sorted(CAUGHT))
def test_each_skipped_wait_kind_is_caught(kind: str) -> None:
    with pytest.raises(StreamOrderError, match=CAUGHT[kind]):
        _loop({kind})


def test_skipping_the_device_parts_wait_for_its_gradient_is_caught() -> None:
    """Partial offload: the device part's step reads the gradient the d2h stream wrote into its
    stage; without ``device_stage_filled`` the compute stream reads it unordered."""
    with emulated_async_device(seed=1, skip_waits={"device_stage_filled"}):
        engine = tiny_engine(precision="bf16-mixed", offload_fraction=0.0)
        try:
            # seen from whichever access comes second: the step's read, or the next copy in
            with pytest.raises(StreamOrderError, match=r"device-resident gradient on the "
                                                       r"(compute|d2h) stream.*(d2h|compute) "
                                                       r"stream"):
                train(engine, batches(3))
        finally:
            with contextlib.suppress(Exception):
                engine.teardown(copy_weights_to_module=False)
    with emulated_async_device(seed=1):  # and with it, the same loop is clean
        train(tiny_engine(precision="bf16-mixed", offload_fraction=0.0), batches(3))


def _loop_reading_weights_before_step(rank: int, world: int, skip: set[str]) -> str:
    """The 3-step loop with a no-grad forward (metrics on the batch) between backward and step:
    a compute read of the weights after the last flush, which only the h2d stream's own
    ``stream_waits_compute`` orders before the step's weight copies."""
    with emulated_async_device(seed=1 + rank, skip_waits=skip):
        engine = tiny_engine(precision="bf16-mixed")
        try:
            for x, y in batches(3):
                per = x.shape[0] // world
                part = slice(rank * per, (rank + 1) * per)
                engine.backward(lm_loss(engine.module(x[part]), y[part]))
                with torch.no_grad():
                    engine.module(x[part])
                engine.step()
                engine.zero_grad()
            engine.synchronize()
        finally:  # a race stops the loop: no stream thread outlives the test
            with contextlib.suppress(Exception):
                engine.teardown()
    return "clean"


def test_skipping_the_h2d_wait_for_compute_is_caught_when_compute_reads_the_weights() -> None:
    assert _loop_reading_weights_before_step(0, 1, set()) == "clean"
    with pytest.raises(StreamOrderError, match=r"write of the device weights on the h2d stream"
                                               r".*compute stream.*rule 3"):
        _loop_reading_weights_before_step(0, 1, {"stream_waits_compute:h2d"})


def _ring_reuse_race(rank: int, world: int) -> str:
    try:
        _loop({"compute_waits_event"})
    except StreamOrderError as e:
        return str(e)
    return "no race"


def test_skipping_the_ring_reuse_wait_is_caught() -> None:
    # In a spawned process: the race is raised inside backward (at the buffer's reuse); before
    # teardown closed the device after a failed step, stream threads outlived it, and the
    # interpreter's exit could abort in one (rc 134). The same race, seen from whichever access
    # comes second.
    [message] = run_ranks(_ring_reuse_race, 1)
    assert re.search(r"of the bucket buffer on the (compute|d2h) stream.*(d2h|compute) stream"
                     r".*rule 2", message), message


def test_teardown_after_a_race_closes_the_streams_then_raises_it() -> None:
    """A race inside backward leaves a failed step pending: teardown still releases everything
    (no stream thread outlives the engine: a daemon thread inside a torch op at interpreter exit
    can abort the process) and then raises the race."""
    before = set(threading.enumerate())
    with emulated_async_device(seed=1, skip_waits={"compute_waits_event"}):
        engine = tiny_engine(precision="bf16-mixed")
        with pytest.raises(StreamOrderError):
            train(engine, batches(3))
        with pytest.raises(StreamOrderError):
            engine.teardown(copy_weights_to_module=False)
    assert engine.torn_down
    assert not [t.name for t in set(threading.enumerate()) - before
                if t.name.startswith("lzo-emulated")]


@pytest.mark.slow
def test_skipping_the_copy_wait_for_the_reduce_scatter_is_caught_on_two_ranks() -> None:
    """Two ranks: the d2h copy of a reduced shard waits for the reduce stream's event
    (``stream_waits``), through which it is also ordered after compute's write of the bucket;
    dropped, the d2h stream reads unordered."""
    assert run_ranks(_loop_reading_weights_before_step, 2, set()) == ["clean", "clean"]
    with pytest.raises(Exception, match=r"StreamOrderError: read of the bucket buffer on the "
                                        r"d2h stream"):
        run_ranks(_loop_reading_weights_before_step, 2, {"stream_waits"})


def test_without_skips_the_detector_is_silent_and_the_losses_equal_the_cpu_path() -> None:
    plain = train(tiny_engine(precision="bf16-mixed"), batches(3)).losses
    assert _loop(set()) == plain


def test_unknown_wait_kind_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="stream_waits_compute"), \
            emulated_async_device(skip_waits={"no_such_wait"}):
        pass


@pytest.mark.parametrize("wait", [False, True])
def test_two_streams_write_without_wait_raises(wait: bool) -> None:
    dev = EmulatedDevice(torch.device("cpu"), max_delay_ms=0.0)
    try:
        s = dev.side_stream("a")
        t = dev.empty(8, torch.float32)
        t.fill_(1.0)  # the compute stream (main thread) writes
        if wait:
            dev.stream_waits_compute(s)
        dev.run(s, lambda: t.add_(1.0))
        end = dev.record(s)
        if wait:
            end.wait()
            assert t.tolist() == [2.0] * 8
        else:
            with pytest.raises(StreamOrderError, match=r"bucket buffer on the a stream.*compute"):
                end.wait()
    finally:
        dev.close()
