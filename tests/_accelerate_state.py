"""One place for resetting Accelerate between tests.

Accelerate keeps its state in process-wide singletons (``AcceleratorState``, ``GradientState``)
and has no public reset; its own test base class calls the private ``_reset_state`` as done here.
"""

from __future__ import annotations


def reset_accelerate() -> None:
    """Forget every Accelerator made in this process (the next one reads its arguments anew)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
