"""Lightning adapters: the Trainer strategy, the Fabric strategy and their precision plugins."""

from lightning_zero_offload.lightning.checkpoint import consolidate_checkpoint
from lightning_zero_offload.lightning.fabric import ZeroOffloadFabricStrategy
from lightning_zero_offload.lightning.precision import (
    ZeroOffloadFabricPrecision,
    ZeroOffloadPrecision,
)
from lightning_zero_offload.lightning.registry import register
from lightning_zero_offload.lightning.strategy import ZeroOffloadStrategy

__all__ = [
    "ZeroOffloadFabricPrecision",
    "ZeroOffloadFabricStrategy",
    "ZeroOffloadPrecision",
    "ZeroOffloadStrategy",
    "consolidate_checkpoint",
    "register",
]
