"""One step's gradients, as the streamer hands them over: the step owns them from ``finish()``.

``GradStreamer.finish`` waits for every transfer, folds what is left in staging and returns a
:class:`Grads`; the step reads it (the norm, which parameters got a gradient, the kernel's
sources) and hands the sources back when it is done with them, without calling the streamer
again. The next backward (after ``zero_grad``) fills the same buffers anew.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_zero_offload.core.device.device import SyncDevice


@dataclass
class Grads:
    """Per bucket this rank's reduced gradient shard (the kernel's source: the staging slice, the
    fp32 gradient, or the device part's gradient), per parameter whether a gradient arrived
    since ``zero_grad``, and the device's sums of squares of the flushed shards where they
    describe the gradient (every bucket flushed once; else None)."""

    sources: list[Tensor]
    had_grad: list[bool]
    stats: list[Tensor] | None
    dev: SyncDevice

    @property
    def sq_sum(self) -> Tensor | None:
        """Sum of squares of this rank's shard, from the device statistics (None: not known)."""
        return None if not self.stats else torch.stack(self.stats).sum()

    def consumed(self, sources: Iterable[Tensor]) -> None:
        """The step has read ``sources``: their contents are dead until the next backward fills
        them (rule 5 of ``core.device.device``; poisoned on the emulated device)."""
        for t in sources:
            self.dev.handed_back(t)
