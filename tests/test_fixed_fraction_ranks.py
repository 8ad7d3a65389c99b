"""A fixed ``offload_fraction`` on ranks whose devices differ: the ranks agree on the split with
the most on the host that any rank's device needs, and each host is checked at that split, not
only at its own choice (every rank raises, naming the short one)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _helpers import tiny_engine

from lightning_zero_offload import testing
from lightning_zero_offload.core.buckets import device_budget, placement
from lightning_zero_offload.core.rules.adam import Adam

K = 5  # the nearest split's device buckets; a rank one byte short of it takes K - 1


def _fraction_and_need() -> tuple[float, float, int, int]:
    """A fraction just above the split of ``K`` device buckets (nearest to it), the host share
    at ``K - 1``, the engine's device bytes at ``K`` and this rank's host bytes at ``K``."""
    with testing.emulated_async_device(seed=1, memory_bytes=1 << 30):
        probe = tiny_engine(precision="32-true", max_grad_norm=1.0, offload_fraction=1.0)
    layout = probe.layout
    shards = [b.shard for b in layout.buckets]
    low, high = placement.host_share(shards, K), placement.host_share(shards, K - 1)
    fraction = round(low + (high - low) / 4, 4)
    assert placement.candidates(shards, fraction) == [K, K - 1]
    need = sum(device_budget.engine_parts(layout, K, torch.float32, delayed=False,
                                          accumulate=True, rule=Adam()).values())
    probe.teardown()
    with testing.emulated_async_device(seed=1, memory_bytes=1 << 30):
        at_k = tiny_engine(precision="32-true", max_grad_norm=1.0, offload_fraction=fraction)
    assert at_k.offload_fraction == pytest.approx(low)
    host = at_k.host_bytes
    at_k.teardown()
    return fraction, high, need, host


def _ranks(rank: int, world: int, host_short_on_0: bool) -> tuple[str, float, float]:
    import psutil

    fraction, high, need, host_at_k = _fraction_and_need()
    if host_short_on_0 and rank == 0:  # exactly room for its own choice (K), not for K - 1
        real = psutil.virtual_memory()
        psutil.virtual_memory = lambda: real._replace(available=host_at_k)  # type: ignore
    capacity = need if rank == 0 else need - 1  # rank 1's device cannot keep K buckets
    try:
        with testing.emulated_async_device(seed=1 + rank, memory_bytes=capacity):
            engine = tiny_engine(precision="32-true", max_grad_norm=1.0,
                                 offload_fraction=fraction)
    except MemoryError as e:
        return str(e), -1.0, high
    return "", engine.offload_fraction, high


@pytest.mark.slow
def test_ranks_agree_on_the_split_the_smallest_device_needs():
    got = run_ranks(_ranks, 2, False)
    assert [e for e, _, _ in got] == ["", ""]
    assert got[0][1] == got[1][1] == pytest.approx(got[0][2])  # both at K - 1 device buckets


@pytest.mark.slow
def test_a_host_short_at_the_agreed_split_fails_setup_on_every_rank():
    got = run_ranks(_ranks, 2, True)
    assert got[0][0].startswith("ZeroOffload: rank 0 needs "), got
    assert got[1][0].startswith("ZeroOffload: rank 0's host cannot hold its optimizer shard at "
                                "the split the ranks agreed on"), got
