"""Test hooks for users and for this project's own tests: the emulated asynchronous device
(``emulated_device``) and its race detector (``race_detector``).

``import lightning_zero_offload`` does not load this package; importing it registers the
:func:`emulated_async_device` block's chooser with ``core.device.device_factory.make_device``, which
also loads the emulated device by itself when ``LZO_EMULATED_DEVICE_SEED`` is set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lightning_zero_offload.core.device.device import WAIT_KINDS, SyncDevice, check_skip_waits
from lightning_zero_offload.core.device.device_factory import register_test_device
from lightning_zero_offload.testing.emulated_device import EmulatedDevice, detector_default
from lightning_zero_offload.testing.race_detector import StreamOrderError

__all__ = ["WAIT_KINDS", "EmulatedDevice", "StreamOrderError", "emulated_async_device"]

_active: dict | None = None  # the innermost emulated_async_device block


def _choose(device: torch.device, process_group: Any, timeout_s: float | None
            ) -> SyncDevice | None:
    """The device of a CPU engine made inside a block (None outside: the factory decides)."""
    if _active is None:
        return None
    emu = EmulatedDevice(device, process_group, seed=_active["seed"],
                         max_delay_ms=_active["max_delay_ms"], timeout_s=timeout_s,
                         stream_delay_ms=_active["stream_delay_ms"],
                         race_detector=_active["race_detector"],
                         skip_waits=_active["skip_waits"],
                         memory_bytes=_active["memory_bytes"])
    _active["made"].append(emu)
    return emu


register_test_device(_choose)


@contextlib.contextmanager
def emulated_async_device(seed: int = 0, max_delay_ms: float = 3.0, *,
                          stream_delay_ms: dict[str, float] | None = None,
                          race_detector: bool | None = None,
                          skip_waits: Iterable[str] = (),
                          memory_bytes: int | None = None) -> Iterator[list]:
    """Engines created on the CPU inside the block run their device-to-host gradient copies,
    reduce-scatters, host-to-device weight copies and all-gathers on emulated side streams:
    worker threads that run their queues in order after seeded random delays of up to
    ``max_delay_ms`` each, with events, waits and NaN-poisoned buffer reuse, as
    ``core.device.device`` describes. A run that passes on the plain CPU must give the
    same result here; a missing wait shows up as a different one. ``stream_delay_ms`` sets
    another maximum for named streams (``"d2h"``: gradients, ``"h2d"``: weights), to make one
    direction the slow one. Yields the list of emulated devices created (for inspection, e.g.
    ``peak_bytes``).

    The environment variable ``LZO_EMULATED_DEVICE_SEED=N`` does the same for every CPU engine
    of a process (e.g. a whole test run: ``LZO_EMULATED_DEVICE_SEED=1 pytest tests/``).

    The race detector (``race_detector``, default on unless ``LZO_RACE_DETECTOR=0``) records the
    block's torch ops on this thread as the compute stream's and each side stream's work as that
    stream's, and raises :class:`StreamOrderError` at an access that no wait orders after another
    stream's conflicting one: this catches what the results cannot show, e.g. a side stream that
    reads what the compute stream wrote without ``stream_waits_compute`` (on the CPU the compute
    stream is always finished). ``skip_waits`` drops every wait of the named kinds
    (``WAIT_KINDS``), for mutation tests; an unknown name is a ValueError.

    ``memory_bytes`` gives the device a capacity: its bucket buffers, weights and the optimizer
    state kept on it count against it, an allocation beyond it raises ``torch.OutOfMemoryError``,
    and ``memory()`` reports the peak and the capacity as ``torch.cuda`` does (so
    ``offload_fraction="auto"`` is tested on the CPU). Without one it has no memory of its own.
    """
    global _active
    skip = check_skip_waits(skip_waits)
    detector = detector_default() if race_detector is None else race_detector
    previous, made = _active, []
    _active = {"seed": seed, "max_delay_ms": max_delay_ms, "made": made,
               "stream_delay_ms": stream_delay_ms, "race_detector": detector,
               "skip_waits": skip, "memory_bytes": memory_bytes}
    try:
        yield made
    finally:
        _active = previous
