"""Lightning adapters: the Trainer strategy, the Fabric strategy and their precision plugins.

The names load on first use, so ``lightning_zero_offload.lightning.registry`` (which ``import
lightning_zero_offload`` runs) does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_zero_offload.lightning.checkpoint import consolidate_checkpoint
    from lightning_zero_offload.lightning.fabric import ZeroOffloadFabricStrategy
    from lightning_zero_offload.lightning.precision import (
        ZeroOffloadFabricPrecision,
        ZeroOffloadPrecision,
    )
    from lightning_zero_offload.lightning.registry import register
    from lightning_zero_offload.lightning.strategy import ZeroOffloadStrategy

_LAZY = {  # name -> the module of this package that defines it
    "ZeroOffloadFabricPrecision": "precision",
    "ZeroOffloadFabricStrategy": "fabric",
    "ZeroOffloadPrecision": "precision",
    "ZeroOffloadStrategy": "strategy",
    "consolidate_checkpoint": "checkpoint",
    "register": "registry",
}

__all__ = [
    "ZeroOffloadFabricPrecision",
    "ZeroOffloadFabricStrategy",
    "ZeroOffloadPrecision",
    "ZeroOffloadStrategy",
    "consolidate_checkpoint",
    "register",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
