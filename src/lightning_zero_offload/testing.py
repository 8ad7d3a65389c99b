"""Test hooks for users and for this project's own tests.

Importing this module (the package does) registers the emulated device with
``core.device.make_device``, so ``LZO_EMULATED_DEVICE_SEED`` turns the emulation on for every CPU
engine of a process without the production factory knowing of it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from lightning_zero_offload.core.device import SyncDevice, register_test_device
from lightning_zero_offload.core.emulated import EmulatedDevice

__all__ = ["EmulatedDevice", "emulated_async_device"]

_active: dict | None = None  # the innermost emulated_async_device block


def _choose(device: torch.device, process_group: Any, timeout_s: float | None
            ) -> SyncDevice | None:
    """The device of a CPU engine: emulated inside a block or with the variable set."""
    if _active is not None:
        emu = EmulatedDevice(device, process_group, seed=_active["seed"],
                             max_delay_ms=_active["max_delay_ms"], timeout_s=timeout_s,
                             stream_delay_ms=_active["stream_delay_ms"])
        _active["made"].append(emu)
        return emu
    seed = os.environ.get("LZO_EMULATED_DEVICE_SEED")
    if seed:  # a whole test suite on the emulated device
        return EmulatedDevice(device, process_group, seed=int(seed), timeout_s=timeout_s)
    return None


register_test_device(_choose)


@contextlib.contextmanager
def emulated_async_device(seed: int = 0, max_delay_ms: float = 3.0, *,
                          stream_delay_ms: dict[str, float] | None = None) -> Iterator[list]:
    """Engines created on the CPU inside the block run their device-to-host gradient copies,
    reduce-scatters, host-to-device weight copies and all-gathers on emulated side streams:
    worker threads that run their queues in order after seeded random delays of up to
    ``max_delay_ms`` each, with events, waits and NaN-poisoned buffer reuse, as
    ``core.device`` describes. A run that passes on the plain CPU must give the
    same result here; a missing wait shows up as a different one. ``stream_delay_ms`` sets
    another maximum for named streams (``"d2h"``: gradients, ``"h2d"``: weights), to make one
    direction the slow one. Yields the list of emulated devices created (for inspection, e.g.
    ``peak_bytes``).

    The environment variable ``LZO_EMULATED_DEVICE_SEED=N`` does the same for every CPU engine
    of a process (e.g. a whole test run: ``LZO_EMULATED_DEVICE_SEED=1 pytest tests/``).

    What it cannot catch: the compute stream is the main thread itself, so a side stream that
    does not wait for the compute stream before reading what it wrote only fails on a GPU.
    """
    global _active
    previous, made = _active, []
    _active = {"seed": seed, "max_delay_ms": max_delay_ms, "made": made,
               "stream_delay_ms": stream_delay_ms}
    try:
        yield made
    finally:
        _active = previous
