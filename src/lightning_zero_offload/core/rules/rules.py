"""The update rules the engine implements, and which one a user's optimizer gets."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero_offload.core.rules.adam import Adam
from lightning_zero_offload.core.rules.lion import Lion
from lightning_zero_offload.core.rules.rule import Rule, qualified
from lightning_zero_offload.core.rules.sgd import SGD

RULES: tuple[type[Rule], ...] = (Adam, Lion, SGD)


def rule_for(optimizer: torch.optim.Optimizer) -> Rule:
    """The rule of the user's optimizer, its options checked; a clear error for any other."""
    for cls in RULES:
        if cls.accepts(optimizer):
            return cls.for_optimizer(optimizer)
    kind = type(optimizer)
    # A Lion user is told which Lion, not to switch to AdamW: the advice follows the kind the
    # class name says, or lists every rule's.
    near = [r for r in RULES if r.FAMILY in kind.__name__.lower()] or list(RULES)
    raise TypeError(
        f"ZeroOffload supports {supported()} only, and their "
        "subclasses that keep their update (the fused CPU step implements exactly those); got "
        f"{qualified(kind)}. Create the optimizer with "
        f"{' or '.join(r.EXAMPLE for r in near)}")


def rule_named(key: str, **options: Any) -> Rule:
    """The rule a checkpoint or a plan names by its key (``"adamw"``, ``"lion"``, ...), for an
    optimizer of that kind made with ``options`` (none: its defaults), without one."""
    for cls in RULES:
        if cls.KEY == key:
            return cls.from_options(**options)
    raise ValueError(f"unknown update rule {key!r}; known: {[r.KEY for r in RULES]}")


def supported() -> str:
    """Every optimizer the engine takes, for messages (the registry's, in its order):
    "torch.optim.AdamW and torch.optim.Adam, lion_pytorch.Lion"."""
    return ", ".join(r.OPTIMIZERS for r in RULES)
