"""Registers ``"zero_offload"`` with Lightning's Trainer and Fabric strategy registries.

Lightning 2.5.6+ no longer discovers third-party strategies, so ``import lightning_zero_offload``
calls :func:`register_when_imported`: it registers at once when Lightning is already imported,
and otherwise right after Lightning's first import (a finder on ``sys.meta_path`` that wraps the
loader of the ``lightning`` package), so importing this package never imports Lightning itself
and ``Trainer(strategy="zero_offload")`` works in either import order. :func:`register` is
idempotent, so importing twice (or calling it again) is harmless. What it registers are factories
that import the strategies when Lightning resolves the name: registering imports nothing of ours,
so it cannot run into an adapter module that is itself importing Lightning.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

NAME = "zero_offload"  # the strategies' name in Lightning's registries
DESCRIPTION = "ZeRO-Offload: fp32 master weights and optimizer state on the host"
# Lightning's package __init__ imports lightning.fabric and lightning.pytorch whole, so once it
# has run, both registries and everything the strategies import are ready.
_PACKAGE = "lightning"


def register() -> None:
    """Make ``Trainer(strategy="zero_offload")`` and ``Fabric(strategy="zero_offload")`` work."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for registry, factory in ((StrategyRegistry, _trainer_strategy),
                              (STRATEGY_REGISTRY, _fabric_strategy)):
        if NAME not in registry:
            registry.register(NAME, factory, description=DESCRIPTION)


def _trainer_strategy(**kwargs: Any) -> Any:
    """``ZeroOffloadStrategy(**kwargs)``: what ``Trainer(strategy="zero_offload")`` gets."""
    from lightning_zero_offload.lightning.strategy import ZeroOffloadStrategy

    return ZeroOffloadStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    """``ZeroOffloadFabricStrategy(**kwargs)``: what ``Fabric(strategy="zero_offload")`` gets."""
    from lightning_zero_offload.lightning.fabric import ZeroOffloadFabricStrategy

    return ZeroOffloadFabricStrategy(**kwargs)


def register_when_imported() -> None:
    """:func:`register` now if Lightning is imported, else just after it is (without importing
    it here)."""
    if _PACKAGE in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` through the other finders and runs :func:`register` after it loads."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname != _PACKAGE:
            return None
        # Stays until Lightning loads (``importlib.util.find_spec("lightning")``, an "is it
        # installed?" check, loads nothing); the search below skips this finder.
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None and finder is not self else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterLoad(spec.loader)
                return spec
        return None  # not installed: the import fails as it would without us


class _RegisterAfterLoad(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Lightning's module keeps its own loader (for inspect, importlib.resources, reloads).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for finder in [f for f in sys.meta_path if isinstance(f, _RegisterAfterImport)]:
            sys.meta_path.remove(finder)  # Lightning is loaded: nothing left to wait for
        try:
            register()
        except Exception as e:  # the user's `import lightning` must not fail because of us
            warnings.warn(f"lightning_zero_offload: could not register strategy='zero_offload' "
                          f"with Lightning ({type(e).__name__}: {e}); pass "
                          "ZeroOffloadStrategy() as the strategy instead", stacklevel=2)
