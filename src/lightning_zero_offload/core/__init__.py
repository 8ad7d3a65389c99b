"""The offload engine (layer 3): framework independent, driven by a plain loop or an adapter.

Its rooms, each importing only from those before it: ``config``/``limits`` (options, constants),
``dist`` (collectives, tensor parallelism), ``rules`` (the update rules), ``device`` (streams,
events, timing), ``buckets`` (the layout, the bucket records, the host arrays, the placement),
``transfer`` (gradients down, weights up), ``step``, ``checkpoint``; ``engine``, ``setup``,
``checks``, ``optimizer`` and ``ranks`` wire them (``tests/test_structure.py`` keeps the order).
"""

from lightning_zero_offload.core.checkpoint import CheckpointError
from lightning_zero_offload.core.config import ZeroOffloadConfig
from lightning_zero_offload.core.engine import ZeroOffload

__all__ = ["ZeroOffload", "ZeroOffloadConfig", "CheckpointError"]
