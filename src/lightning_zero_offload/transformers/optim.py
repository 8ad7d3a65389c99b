"""The Trainer's ``optim`` names that the engine trains with an optimizer of its own choosing.

Some ``TrainingArguments.optim`` values name an optimizer from a package the engine does not use
(bitsandbytes' for ``"lion_32bit"``) although an update rule of the engine (``core.rules.rules``)
implements the same update. Under ZeRO-Offload the Trainer gets that rule's optimizer instead,
built from the same arguments (the learning rate, and the betas the Trainer would pass); the
Trainer's param groups bring the weight decay. Every other name goes to the Trainer as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _lion(args: Any) -> tuple[type, dict[str, Any]]:
    """bitsandbytes' 32-bit Lion, as lion_pytorch's: the same update (the Trainer passes it the
    learning rate and ``adam_beta1``/``adam_beta2`` as its betas)."""
    try:
        from lion_pytorch import Lion
    except ImportError:
        raise ImportError("optim='lion_32bit' under ZeRO-Offload trains with lion_pytorch.Lion: "
                          "pip install lion-pytorch (or lightning-zero-offload[all])") from None
    return Lion, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2)}


# optim name -> (TrainingArguments -> (optimizer class, keyword arguments))
OPTIMS: dict[str, Callable[[Any], tuple[type, dict[str, Any]]]] = {"lion_32bit": _lion}


def optimizer_for(args: Any) -> tuple[type, dict[str, Any]] | None:
    """The optimizer class and keyword arguments the engine uses for ``args.optim``, or None
    where the Trainer's own choice stands."""
    name = getattr(args.optim, "value", args.optim)  # an OptimizerNames member or a string
    make = OPTIMS.get(name)
    return None if make is None else make(args)
