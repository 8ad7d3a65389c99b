"""The update rules the engine implements, and which one a user's optimizer gets."""

from __future__ import annotations

import torch

from lightning_zero_offload.core.adam import Adam
from lightning_zero_offload.core.lion import Lion
from lightning_zero_offload.core.rule import Rule

RULES: tuple[type[Rule], ...] = (Adam, Lion)


def rule_for(optimizer: torch.optim.Optimizer) -> Rule:
    """The rule of the user's optimizer, its options checked; a clear error for any other."""
    for cls in RULES:
        if cls.accepts(optimizer):
            return cls.for_optimizer(optimizer)
    supported = " and ".join(r.OPTIMIZERS for r in RULES)
    raise TypeError(
        f"ZeroOffload supports {supported} (or subclasses) only (the fused CPU step implements "
        f"them); got {type(optimizer).__name__}. Create the optimizer with "
        "torch.optim.AdamW(model.parameters(), ...)")


def rule_named(key: str) -> type[Rule]:
    """The rule a checkpoint or a plan names by its key (``"adamw"``, ...)."""
    for cls in RULES:
        if cls.KEY == key:
            return cls
    raise ValueError(f"unknown update rule {key!r}; known: {[r.KEY for r in RULES]}")
