"""The device budget (``core.buckets.device_budget``): every device allocation the engine makes is
counted before it makes them, so the fraction a setup error names trains within the capacity it
was named for (the emulated device's measured peak), a run that may accumulate in a half dtype
has its fp32 sum budgeted, and a fixed fraction that leaves less than the headroom is warned of.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from _helpers import rel_err, tiny_engine, train
from _tiny_gpt import batches

from lightning_zero_offload import testing
from lightning_zero_offload.core.limits import BUCKET_BUFFERS

pytestmark = pytest.mark.usefixtures("one_thread")

ELEM = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}


def _weights(engine_or_none=None) -> int:
    """Trained elements of the tiny GPT (all of them on the device, in the compute dtype)."""
    return sum((engine_or_none or tiny_engine(precision="32-true")).layout.group_numel)


def _named_fraction(precision: str, capacity: int, **kw) -> float:
    """The fraction the setup error names for ``offload_fraction=0.0`` on this capacity."""
    with testing.emulated_async_device(seed=1, memory_bytes=capacity):
        with pytest.raises(MemoryError) as err:
            tiny_engine(precision=precision, offload_fraction=0.0, **kw)
    got = re.search(r"\(offload_fraction=([0-9.]+)\)", str(err.value))
    assert got, str(err.value)
    return float(got.group(1))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("micro", [1, 2])
def test_the_named_fraction_trains_within_the_capacity(precision, delayed, micro):
    """Each precision, with and without accumulation (``accumulate`` not declared: it may) and
    delayed update: the device never holds more than its capacity (the old count left out the
    gradient ring, and bf16's second micro-batch died on its fp32 sum inside backward)."""
    kw = {"delayed_update": True, "delayed_update_warmup": 0} if delayed else {}
    weights = _weights() * ELEM[precision] * (2 if delayed else 1)
    for extra in (50_000, 120_000):
        capacity = weights + extra
        fraction = _named_fraction(precision, capacity, **kw)
        assert 0.0 < fraction <= 1.0
        with testing.emulated_async_device(seed=1, memory_bytes=capacity) as made:
            engine = tiny_engine(precision=precision, offload_fraction=fraction, **kw)
        train(engine, batches(3), micro=micro)
        assert made[0].peak_bytes <= capacity, (fraction, made[0].peak_bytes, capacity)
        assert 0 < len(engine._buckets.device()) or fraction == 1.0
        engine.teardown()


def test_the_setup_error_lists_what_the_device_holds():
    """Too small for even the weights and the gradient ring: the error says so and what
    helps, not a fraction that cannot fit either."""
    with testing.emulated_async_device(seed=1, memory_bytes=_weights() * 4):
        with pytest.raises(MemoryError, match=r"even with all of the optimizer state on the "
                           r"host \(weights .*, gradient buckets \(3\) .*\); use a smaller "
                           r"bucket_size_mb"):
            tiny_engine(precision="32-true", offload_fraction=0.5)


def test_a_declared_no_accumulation_does_not_budget_the_fp32_sum():
    """bf16 with ``accumulate=False``: no fp32 sum can exist, so more of the state fits than
    when the run may accumulate."""
    for extra in (120_000, 200_000):
        capacity = _weights() * 2 + extra
        may = _named_fraction("bf16-mixed", capacity)
        never = _named_fraction("bf16-mixed", capacity, accumulate=False)
        assert never < may


def _ring_on_ranks(rank: int, world: int) -> tuple[int, int, int, int]:
    """Slow copies, two ranks: the peak over the weights against the ring's count."""
    with testing.emulated_async_device(seed=1 + rank, max_delay_ms=5.0,
                                       memory_bytes=1 << 30) as made:
        engine = tiny_engine(precision="bf16-mixed", offload_fraction=1.0, bucket_size_mb=0.004)
    weights = made[0].live_bytes
    train(engine, batches(2))
    bucket = max(b.numel for b in engine.layout.buckets) * 2
    shard = max(b.shard for b in engine.layout.buckets) * 2
    return made[0].peak_bytes - weights, bucket, shard, len(engine.layout.buckets)


@pytest.mark.slow
def test_reduce_scatter_outputs_are_part_of_the_ring_on_two_ranks():
    """With several ranks each ring slot also holds its shard's buffer, reused once the copy
    that reads it ends: the device never holds more than the ring's slots (the shard buffers
    were fresh allocations, as many as the copies lagged behind)."""
    from _dist import run_ranks

    for extra, bucket, shard, n in run_ranks(_ring_on_ranks, 2):
        assert n > 3 * BUCKET_BUFFERS
        assert extra <= BUCKET_BUFFERS * (bucket + shard), (extra, bucket, shard)


def test_a_fixed_fraction_inside_the_headroom_is_warned_of(caplog):
    """A fixed fraction whose device part leaves less than ``device_memory_headroom`` of the
    capacity free: a warning naming what it leaves (not an error: the user chose it); one that
    leaves more, or keeps nothing on the device, is not warned of. The run still trains."""
    caplog.set_level(logging.WARNING, logger="lightning_zero_offload.core.buckets.device_budget")
    capacity = _weights() * 4 + 120_000
    fraction = _named_fraction("32-true", capacity)
    with testing.emulated_async_device(seed=1, memory_bytes=capacity):
        engine = tiny_engine(precision="32-true", offload_fraction=fraction, max_grad_norm=1.0)
    said = [r.getMessage() for r in caplog.records if "device_memory_headroom" in r.getMessage()]
    assert len(said) == 1 and f"offload_fraction={fraction:g} leaves" in said[0], said
    left = capacity - sum(t.numel() * t.element_size() for s in engine._buckets.device()
                          for t in s.device_tensors())
    assert left > 0
    train(engine, batches(2))
    ref = tiny_engine(precision="32-true", offload_fraction=1.0, max_grad_norm=1.0)
    train(ref, batches(2))
    assert rel_err(engine.module, ref.module) < 1e-6
    caplog.clear()
    with testing.emulated_async_device(seed=1, memory_bytes=capacity * 4):
        tiny_engine(precision="32-true", offload_fraction=fraction)
    with testing.emulated_async_device(seed=1, memory_bytes=_weights() * 4 + 60_000):
        tiny_engine(precision="32-true", offload_fraction=1.0)
    assert not [r for r in caplog.records if "device_memory_headroom" in r.getMessage()]


def test_the_planner_marks_a_fraction_inside_the_headroom():
    from lightning_zero_offload.planner import plan

    kw = dict(precision="bf16-mixed", device_memory="141GiB", host_memory="128GiB",
              measure=False)
    tight = plan(16e9, offload_fraction=0.5, **kw)
    assert tight.fits and tight.device_bytes > 0.8 * 141 * 2**30
    assert any("less than --device-memory-headroom 0.2" in n for n in tight.notes)
    roomy = plan(16e9, offload_fraction=0.8, **kw)
    assert roomy.device_bytes < 0.8 * 141 * 2**30
    assert not any("headroom" in n for n in roomy.notes)


def test_the_planner_counts_the_engines_device_allocations():
    """The planner's device bytes for the tiny GPT's sizes are the engine's own count."""
    from lightning_zero_offload.core.buckets import device_budget
    from lightning_zero_offload.core.rules.adam import Adam

    engine = tiny_engine(precision="bf16-mixed", offload_fraction=1.0)
    got = device_budget.engine_parts(engine.layout, 0, torch.bfloat16, delayed=False, rule=Adam(),
                                     accumulate=False)
    bucket = max(b.numel for b in engine.layout.buckets)
    assert got == {"weights": 2 * _weights(engine), "gradient buckets (3)": 3 * 2 * bucket}


def test_twenty_random_capacities_are_never_exceeded():
    """20 seeded random (capacity, precision, accumulation, delayed update) cases on the
    emulated device: the fraction the setup error names trains with the measured peak within
    the capacity, and "auto" (its setup and its move after the first step) never exceeds it."""
    import random

    rng = random.Random(37)
    for case in range(20):
        precision = rng.choice(list(ELEM))
        micro, delayed = rng.choice([1, 2]), rng.random() < 0.4
        kw = {"delayed_update": True, "delayed_update_warmup": 0} if delayed else {}
        capacity = _weights() * ELEM[precision] * (2 if delayed else 1) + rng.randrange(
            60_000, 400_000)
        what = (case, precision, micro, delayed, capacity)
        fraction = _named_fraction(precision, capacity, **kw)  # 0.0 never fits these
        for setting in (fraction, "auto"):
            with testing.emulated_async_device(seed=case, memory_bytes=capacity) as made:
                engine = tiny_engine(precision=precision, offload_fraction=setting,
                                     max_grad_norm=1.0, **kw)
            train(engine, batches(3), micro=micro)
            assert made[0].peak_bytes <= capacity, (*what, setting, made[0].peak_bytes)
            engine.teardown()
