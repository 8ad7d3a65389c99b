"""Test hooks for users and for this project's own tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from lightning_zero_offload.core.device import emulate
from lightning_zero_offload.core.emulated import EmulatedDevice

__all__ = ["EmulatedDevice", "emulated_async_device"]


@contextlib.contextmanager
def emulated_async_device(seed: int = 0, max_delay_ms: float = 3.0, *,
                          stream_delay_ms: dict[str, float] | None = None) -> Iterator[list]:
    """Engines created on the CPU inside the block run their device-to-host gradient copies,
    reduce-scatters, host-to-device weight copies and all-gathers on emulated side streams:
    worker threads that run their queues in order after seeded random delays of up to
    ``max_delay_ms`` each, with events, waits and NaN-poisoned buffer reuse, as
    ``core.device.EmulatedDevice`` describes. A run that passes on the plain CPU must give the
    same result here; a missing wait shows up as a different one. ``stream_delay_ms`` sets
    another maximum for named streams (``"d2h"``: gradients, ``"h2d"``: weights), to make one
    direction the slow one. Yields the list of emulated devices created (for inspection, e.g.
    ``peak_bytes``).

    The environment variable ``LZO_EMULATED_DEVICE_SEED=N`` does the same for every CPU engine
    of a process (e.g. a whole test run: ``LZO_EMULATED_DEVICE_SEED=1 pytest tests/``).

    What it cannot catch: the compute stream is the main thread itself, so a side stream that
    does not wait for the compute stream before reading what it wrote only fails on a GPU.
    """
    with emulate(seed, max_delay_ms, stream_delay_ms) as made:
        yield made
