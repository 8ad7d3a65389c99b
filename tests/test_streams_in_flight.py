"""Work in flight on the side streams, on the emulated asynchronous device: ``zero_grad`` without
a step drains it, a weight copy's span is filed under its own step, the bucket buffer ring stays
bounded, and with two ranks the reduce-scatter runs on a stream of its own; each run equals the
synchronous CPU path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_ranks
from _helpers import rel_err, tiny_engine, train
from _tiny_gpt import batches as _batches
from _tiny_gpt import lm_loss

from lightning_zero_offload import ZeroOffload
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
    weights = made[0].live_bytes  # the device weights (device memory too)
    train(engine, data, micro=2)
    assert made[0].peak_bytes - weights <= BUCKET_BUFFERS * bucket_bytes
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


