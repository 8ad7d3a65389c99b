"""Which device asynchrony an engine gets: CUDA, the synchronous CPU, or the emulated one.

The emulated asynchronous device lives with the test harness (``lightning_zero_offload.testing``)
and is imported only when asked for: by ``LZO_EMULATED_DEVICE_SEED`` or inside a
``testing.emulated_async_device()`` block (importing ``testing`` registers that block's chooser
here), so a production run never loads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from lightning_zero_offload.core.device.device import CudaDevice, SyncDevice

SEED_VARIABLE = "LZO_EMULATED_DEVICE_SEED"

# Chooses the device of CPU engines in tests (``testing`` registers the block's chooser); it
# returns None to leave the choice to the variable or the plain CPU device.
TestDeviceFactory = Callable[[torch.device, Any, "float | None"], "SyncDevice | None"]
_test_device: TestDeviceFactory | None = None


def register_test_device(factory: TestDeviceFactory | None) -> None:
    """Let ``factory`` choose the device of every CPU engine made from now on (None: stop)."""
    global _test_device
    _test_device = factory


def make_device(device: torch.device, process_group: object | None,
                timeout_s: float | None = None) -> SyncDevice:
    """The asynchrony implementation for an engine whose compute device is ``device``."""
    if device.type == "cuda":
        return CudaDevice(device, process_group)
    made = _test_device(device, process_group, timeout_s) if _test_device is not None else None
    if made is not None:
        return made
    seed = os.environ.get(SEED_VARIABLE, "").strip()
    if seed:  # a whole test suite on the emulated device
        from lightning_zero_offload.testing.emulated_device import from_environment

        return from_environment(device, process_group, seed, timeout_s)
    return SyncDevice(device, process_group)
