"""Local shards and whole tensors, for checkpoints of a sharded model (tensor parallelism or
``fully_shard``): a rank's local shards gathered whole into the consolidated form, and the
consolidated form's whole tensors cut back to this rank's local shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_zero_offload.core.checkpoint.stream import Later
from lightning_zero_offload.core.dist.tensor_parallel import is_dtensor, local

if TYPE_CHECKING:
    from lightning_zero_offload.core.checkpoint.engine_state import EngineState


def _params(state: EngineState) -> tuple[dict[str, Tensor], dict[int, Tensor]]:
    """The module's tensors by state_dict key, and the trained parameters by index."""
    return (state.module.state_dict(keep_vars=True),
            {s.index: s.param for s in state.layout.slots})


def whole(state: EngineState, full: dict) -> dict:
    """Collective over the tensor-parallel group: every local shard of ``full`` gathered whole
    (in the same order on every rank: state_dict keys, then parameter indices)."""
    tp, (names, params) = state.tp, _params(state)
    assert tp is not None
    if "model" in full:
        full["model"] = {k: tp.whole_value(names[k], v) for k, v in full["model"].items()}
    if "optimizer" in full:
        states = full["optimizer"]["state"]
        for i in sorted(states):
            for key in state.host.rule.names:
                states[i][key] = tp.whole_value(params[i], states[i][key])
    return full


def cut(state: EngineState, model: dict, opt: dict | None) -> tuple[dict, dict | None]:
    """The consolidated form's whole tensors cut to this rank's local shards: a trained
    tensor's cut is a stand-in made as the load reads it (no second copy of the state); a
    DTensor value (cut already, e.g. by ``torch.distributed.checkpoint``) is checked now."""
    tp, (names, params) = state.layout.tp, _params(state)  # even one rank's: DTensor values
    if tp is None:
        return model, opt
    trained = {id(s.param) for s in state.layout.slots}

    def one(param: Tensor, value: Tensor) -> Tensor | Later:
        if id(param) not in trained or is_dtensor(value):
            return tp.local_value(param, value)
        return Later(tuple(local(param).shape), torch.float32,
                     lambda: tp.local_value(param, value))

    model = {k: one(names[k], v) for k, v in model.items()}
    if opt is not None:
        opt = {**opt, "state": {i: {**st, **{key: one(params[i], st[key])
                                               for key in state.host.rule.names}}
                                for i, st in opt["state"].items()}}
    return model, opt
