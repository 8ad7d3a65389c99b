"""Registers ``"zero_offload"`` with Lightning's Trainer and Fabric strategy registries.

Lightning 2.5.6+ no longer discovers third-party strategies, so ``import lightning_zero_offload``
calls :func:`register`; it is idempotent, so importing twice (or calling it again) is harmless.
"""

from __future__ import annotations

from lightning_zero_offload.lightning.common import NAME


def register() -> None:
    """Make ``Trainer(strategy="zero_offload")`` and ``Fabric(strategy="zero_offload")`` work."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero_offload.lightning.fabric import ZeroOffloadFabricStrategy
    from lightning_zero_offload.lightning.strategy import ZeroOffloadStrategy

    for registry, cls in (
        (StrategyRegistry, ZeroOffloadStrategy),
        (STRATEGY_REGISTRY, ZeroOffloadFabricStrategy),
    ):
        if NAME not in registry:
            cls.register_strategies(registry)
