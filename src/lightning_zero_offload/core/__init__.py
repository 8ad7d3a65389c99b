"""The offload engine (layer 3): framework independent, driven by a plain loop or an adapter."""

from lightning_zero_offload.core.checkpoint import CheckpointError
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.engine import ZeroOffload

__all__ = ["ZeroOffload", "ZeroOffloadConfig", "CheckpointError"]
