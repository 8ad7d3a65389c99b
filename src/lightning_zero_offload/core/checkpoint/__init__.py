"""The engine's checkpoint code, one module per concern:

- ``formats``: what a shard and the consolidated form hold, and how shards consolidate;
- ``files``: checksums, weights-only loads, atomic writes and the atomic publish of a folder;
- ``validation``: the checks of a loaded state against each other, the module and the layout;
- ``places``: a sharded model's local shards gathered whole, whole tensors cut to local shards;
- ``agreement``: the cross-rank agreement of a save or load (every rank raises if one failed);
- ``engine_state``: :class:`EngineState`, the engine's state in and out through the above.
"""

from lightning_zero_offload.core.checkpoint.engine_state import EngineState
from lightning_zero_offload.core.checkpoint.formats import CheckpointError

__all__ = ["CheckpointError", "EngineState"]
