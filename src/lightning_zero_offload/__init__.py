"""ZeRO-Offload for PyTorch Lightning, Accelerate and the transformers Trainer.

Importing this package registers ``"zero_offload"`` with Lightning's strategy registries, so
``Trainer(strategy="zero_offload")`` and ``Fabric(strategy="zero_offload")`` work after ``import
lightning_zero_offload``; it does so without importing Lightning (at once if Lightning is already
loaded, else right after its first import), and loads the names below on first use, so the planner
and the Accelerate and transformers adapters never pay for Lightning.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from lightning_zero_offload.lightning.registry import register_when_imported

if TYPE_CHECKING:
    from lightning_zero_offload import ops
    from lightning_zero_offload.core import ZeroOffload, ZeroOffloadConfig
    from lightning_zero_offload.cpu_adam import CPUAdam
    from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy, ZeroOffloadStrategy
    from lightning_zero_offload.planner import plan

__version__ = "0.1.0.dev0"

# name -> (module, attribute of it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "core": ("lightning_zero_offload.core", None),
    "ops": ("lightning_zero_offload.ops", None),
    "CPUAdam": ("lightning_zero_offload.cpu_adam", "CPUAdam"),
    "ZeroOffload": ("lightning_zero_offload.core", "ZeroOffload"),
    "ZeroOffloadConfig": ("lightning_zero_offload.core", "ZeroOffloadConfig"),
    "ZeroOffloadFabricStrategy": ("lightning_zero_offload.lightning", "ZeroOffloadFabricStrategy"),
    "ZeroOffloadStrategy": ("lightning_zero_offload.lightning", "ZeroOffloadStrategy"),
    "plan": ("lightning_zero_offload.planner", "plan"),
}

__all__ = ["__version__", "CPUAdam", "ZeroOffload", "ZeroOffloadConfig", "ops", "plan"]
if importlib.util.find_spec("lightning") is not None:  # finds, does not import
    __all__ += ["ZeroOffloadFabricStrategy", "ZeroOffloadStrategy"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_when_imported()
