"""Checks of a checkpoint before anything of it is loaded: shards against each other, against
the module, and against this engine's layout; the consolidated form against the module and
optimizer. Every failure is a ``CheckpointError`` that says what does not fit and what to use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_zero_offload.core.checkpoint.formats import (
    MOMENT_STORAGE,
    SHARD_FORMATS,
    CheckpointError,
    optimizer_rule,
    shard_moment_dtype,
    shard_numel,
    shard_rule,
)
from lightning_zero_offload.core.rules.rules import RULES
from lightning_zero_offload.ops.moments import MOMENT_DTYPES, num_blocks

if TYPE_CHECKING:
    from lightning_zero_offload.core.checkpoint.engine_state import EngineState
    from lightning_zero_offload.core.rules.rule import Rule


def validate_shards(shards: list[dict], expected: Mapping[str, tuple[str | None, tuple]]) -> None:
    """Check shards against each other and the module before anything is loaded.

    ``expected`` maps each key of the module's state_dict to ``(name of the trained parameter it
    holds or None, shape)``; trained ones must be in the layout, the rest in ``module_extra``.
    """
    first = shards[0]
    for s in shards:
        if (s.get("format") not in SHARD_FORMATS or s["layout"] != first["layout"]
                or shard_moment_dtype(s) != shard_moment_dtype(first)
                or s.get("rule") != first.get("rule")
                or s.get("rule_options") != first.get("rule_options")):
            raise CheckpointError("checkpoint shards come from different saves; use another "
                                  "checkpoint")
        check_shard_groups(s, [shard_numel(s["layout"], g) for g in range(len(s["groups"]))],
                           f"shard of rank {s['rank']}")
    _check_module(first, expected)


def check_tensor_parallel(shards: list[dict], mine: dict | None, path: object) -> None:
    """A shard written under tensor parallelism or ``fully_shard`` loads only into the same
    place of the same mesh (``mine``: this rank's ``TensorParallel.describe()``, None without
    either), and a shard written without them only without them."""
    saved = shards[0].get("tensor_parallel")
    if saved is None and mine is None:
        return
    if len(shards) == 1 and saved == mine:
        return
    fsdp = any(d is not None and d.get("fsdp") for d in (saved, mine))
    kind = "fully_shard" if fsdp else "tensor parallelism"

    def where(d: dict | None) -> str:
        if d is None:
            return f"no {kind}"
        if d.get("fsdp"):  # every process holds its own shards
            mesh = tuple(d["mesh"])
            return (f"fully_shard over {d['size']} process{'es' if d['size'] != 1 else ''}"
                    + (f" (mesh (data_parallel, tensor_parallel) = {mesh})" if len(mesh) > 1
                       else ""))
        return f"mesh (data_parallel, tensor_parallel) = {tuple(d['mesh'])}"
    raise CheckpointError(
        f"the sharded checkpoint {str(path)!r} was written with {where(saved)}, this run has "
        f"{where(mine)}: a sharded checkpoint under {kind} resumes only at the mesh "
        "that wrote it. To change the mesh, save a consolidated checkpoint at the old one "
        "(save_checkpoint(path, sharded=False); Lightning: sharded_checkpoint=False) and load that")


def check_shard_groups(shard: dict, numels: list[int], who: str) -> None:
    """Every group of ``shard`` holds ``numels[g]`` elements of master and moments, in the
    dtypes its ``moment_dtype`` names, with one scale per block for 8-bit moments."""
    md, names = shard_moment_dtype(shard), shard_rule(shard).names
    if md not in MOMENT_DTYPES:
        raise CheckpointError(f"{who}: unknown moment_dtype {md!r}; use another checkpoint")
    if len(shard["groups"]) != len(numels):
        raise CheckpointError(f"{who}: {len(shard['groups'])} groups, expected {len(numels)}")
    steps = shard.get("param_steps")
    if steps is not None and (
            not isinstance(steps, list) or len(steps) != len(shard["layout"]["params"])
            or not all(isinstance(n, int) and n >= 0 for n in steps)):
        raise CheckpointError(f"{who}: param_steps is not one step count per parameter (corrupt "
                              "shard?); use another checkpoint")
    for g, (grp, n) in enumerate(zip(shard["groups"], numels, strict=True)):
        want = {"master": (n, torch.float32),
                **{name: (n, MOMENT_STORAGE[md]) for name in names}}
        if md == "int8":
            want.update({f"{name}_scales": (num_blocks(n), torch.float32)
                         for name in names})
        for key, (numel, dtype) in want.items():
            t = grp.get(key)
            if not isinstance(t, Tensor) or t.numel() != numel or t.dtype != dtype:
                raise CheckpointError(
                    f"{who}: group {g} {key} has the wrong size or dtype (expected {numel} "
                    f"{dtype} for {md} moments; corrupt shard?); use another checkpoint")


def _check_module(shard: dict, expected: Mapping[str, tuple[str | None, tuple]]) -> None:
    params = {name: tuple(shape) for name, _, _, _, _, shape in shard["layout"]["params"]}
    extra = shard["module_extra"]
    saved_of = {key: params.get(trained) if trained is not None else (
        tuple(extra[key].shape) if key in extra else None)
        for key, (trained, _) in expected.items()}
    missing = sorted(key for key, shape in saved_of.items() if shape is None)
    held = {trained for trained, _ in expected.values() if trained is not None}
    unexpected = sorted((set(params) - held) | (set(extra) - set(expected)))
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint's parameters do not match the module (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}): it was written for a different model")
    for key, (_, shape) in expected.items():
        if saved_of[key] != tuple(shape):
            raise CheckpointError(f"{key!r} has shape {saved_of[key]} in the checkpoint, the "
                                  f"module has {tuple(shape)}: it was written for a different "
                                  "model")


def check_shard(state: Any, engine: EngineState) -> None:
    """``state`` is this rank's shard of this very layout (``ZeroOffload.load_state_dict``)."""
    if not isinstance(state, dict) or state.get("format") not in SHARD_FORMATS:
        raise CheckpointError(
            "ZeroOffload.load_state_dict: not a ZeroOffload shard (expected the dict returned by "
            "ZeroOffload.state_dict(); for the consolidated form use load_full_state_dict)"
        )
    if state.get("tensor_parallel") != engine.tp_describe():
        raise CheckpointError(
            f"ZeroOffload.load_state_dict: shard of tensor-parallel place "
            f"{state.get('tensor_parallel')} cannot load into {engine.tp_describe()}; load a "
            "consolidated checkpoint (full_state_dict/load_full_state_dict) to change the mesh")
    check_rule(shard_rule(state), engine, "ZeroOffload.load_state_dict")
    if state["world_size"] != engine.world_size or state["rank"] != engine.rank:
        raise CheckpointError(
            f"ZeroOffload.load_state_dict: shard of rank {state['rank']} of {state['world_size']} "
            f"cannot load into rank {engine.rank} of {engine.world_size}; use save_checkpoint/"
            "load_checkpoint or full_state_dict/load_full_state_dict to change world size"
        )
    if state["layout"] != engine.layout.describe():
        saved = shard_moment_dtype(state)
        why = (f" (or its moment_dtype={saved!r}: int8 moments pad buckets to whole 256-element "
               "blocks, so the layout differs)" if saved != engine.host.moment_dtype else "")
        raise CheckpointError(
            "ZeroOffload.load_state_dict: the shard was written for a different model, optimizer "
            f"grouping or bucket size{why}; load it through save_checkpoint/load_checkpoint or "
            "full_state_dict/load_full_state_dict"
        )
    check_shard_groups(state, list(engine.layout.group_shard_numel),
                       "ZeroOffload.load_state_dict")


def check_full(state: Any, engine: EngineState) -> tuple[dict, dict | None]:
    """``state`` is a consolidated form that fits the module and optimizer; returns its model
    state_dict and optimizer state (None when it has none)."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(
            "ZeroOffload.load_full_state_dict: expected {'model': state_dict, 'optimizer': "
            "AdamW state_dict (optional)}"
        )
    model, opt = state["model"], state.get("optimizer")
    expected = engine.module.state_dict()
    missing = sorted(set(expected) - set(model))
    unexpected = sorted(set(model) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"ZeroOffload.load_full_state_dict: model keys do not match the module (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]})"
        )
    for k, t in expected.items():
        if tuple(model[k].shape) != tuple(t.shape):
            raise CheckpointError(f"ZeroOffload.load_full_state_dict: {k!r} has shape "
                                  f"{tuple(model[k].shape)}, the module has {tuple(t.shape)}")
    if opt is None:
        return model, None
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if groups is None or not isinstance(opt.get("state"), dict) or [
        len(g["params"]) for g in groups
    ] != engine.group_sizes:
        raise CheckpointError(
            "ZeroOffload.load_full_state_dict: the optimizer state does not match this optimizer's "
            "param groups (same groups with the same number of parameters are needed)"
        )
    who, names = "ZeroOffload.load_full_state_dict", engine.host.rule.names
    recorded = optimizer_rule(opt)
    if recorded is not None:
        check_rule(recorded, engine, who)
    for i, st in opt["state"].items():
        held = tuple(k for k in st if k != "step") if isinstance(st, dict) else ()
        if set(held) == set(names):
            continue
        if recorded is not None:
            raise CheckpointError(
                f"{who}: the optimizer state of parameter {i} holds {list(held)}, not "
                f"{recorded.NAME}'s {list(names)} that it records (corrupt checkpoint?); use "
                "another checkpoint")
        # a plain torch optimizer's state, or one saved before the rule was recorded
        saved = next((r() for r in RULES if set(r.STATE) == set(held)), None)
        check_rule(saved, engine, who, held)
    for slot in engine.layout.slots:
        st = opt["state"].get(slot.index)
        if st is not None and any(tuple(st[n].shape) != tuple(slot.param.shape)
                                  for n in names):
            raise CheckpointError(f"ZeroOffload.load_full_state_dict: optimizer state of "
                                  f"{slot.name!r} has the wrong shape")
    return model, opt


def check_rule(saved: Rule | None, engine: EngineState, who: str,
               held: tuple[str, ...] = ()) -> None:
    """The checkpoint's update rule (None: state of no rule the engine knows, ``held`` its
    names) is this engine's: a rule's state means nothing to another."""
    mine = engine.host.rule
    if saved is not None and saved.KEY == mine.KEY and saved.names == mine.names:
        return
    what = (f"{saved.NAME}'s ({', '.join(saved.names)})" if saved is not None
            else f"of no supported optimizer ({', '.join(held) or 'empty'})")
    raise CheckpointError(
        f"{who}: the checkpoint's optimizer state is {what}, but this engine's optimizer is "
        f"{mine.NAME} ({', '.join(mine.names)}): optimizer state resumes only with the update "
        "rule that wrote it. Resume with the optimizer the checkpoint was written with, or load "
        "the weights alone (load_full_state_dict({'model': ...}) on a consolidated checkpoint) "
        "and start the new optimizer afresh")
