"""Ranks given different settings that shape the buckets, the device part or the collectives
(``core.ranks.SHARED``): every rank refuses at setup, naming both values, within the timeout
(they used to settle on another split silently, run out of device memory on one rank, or wait
in mismatched collectives and blame each other)."""

from __future__ import annotations

import time

import pytest
from _helpers import tiny_engine

from lightning_zero_offload import testing

CASES = {
    "fractions": ({"offload_fraction": 0.3}, {"offload_fraction": 0.7}, 1 << 30),
    "all on one rank's small device": ({"offload_fraction": 0.0}, {"offload_fraction": 1.0},
                                       200_000),
    "auto and a number": ({"offload_fraction": "auto"}, {"offload_fraction": 0.5}, 1 << 30),
    "headroom": ({"device_memory_headroom": 0.1}, {"device_memory_headroom": 0.2}, 1 << 30),
    "moment dtype": ({"moment_dtype": "fp32"}, {"moment_dtype": "bf16"}, 1 << 30),
}


def _setup(rank: int, world: int, case: str) -> tuple[str, str, float]:
    mine = CASES[case][rank]
    t0 = time.monotonic()
    try:
        with testing.emulated_async_device(seed=1 + rank, memory_bytes=CASES[case][2]):
            tiny_engine(precision="32-true", collective_timeout_s=60, **mine)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "none", "", time.monotonic() - t0


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_with_different_settings_refuse_at_setup(case):
    from _dist import run_ranks

    name = next(iter(CASES[case][0]))
    values = [CASES[case][r][name] for r in (0, 1)]
    got = run_ranks(_setup, 2, case, timeout=120)
    for kind, message, took in got:
        assert kind == "ValueError", message
        assert "the ranks were given different settings" in message
        assert f"rank 1 has {name}={values[1]!r} where rank 0 has {name}={values[0]!r}" in (
            message), message
        assert took < 30
