"""Checkpoint formats: per-rank shards and the consolidated (torch) form.

A shard is ``ZeroOffload.state_dict()``: this rank's fp32 master weights and its update rule's
state per group as the engine holds them, by the rule's names (``"rule"``; ``"moment_dtype"``:
fp32, bf16, or 8-bit codes with a ``<name>_scales`` per block; format ``/1`` shards are fp32),
step counts per group and per parameter (``"param_steps"``, in layout order; before format
``/3`` the group's), hyperparameters, the loss scaler and the layout that produced it. The
layout lets :func:`consolidate` rebuild the full, world-size-independent form from all shards:
a fp32 model state_dict plus an optimizer state_dict in torch's format (``torch.optim.AdamW``'s
for Adam; every parameter's entry carries its ``"step"``, which ``lion_pytorch.Lion`` ignores),
the rule's key beside its ``"state"`` and ``"param_groups"`` (``"rule"``, which torch's
``load_state_dict`` ignores; a form without it, a plain torch optimizer's or one saved before
the key, is read as the rule its state's names say).
Files, checksums and atomic publishing are ``files``'s; the checks of a loaded state are
``validation``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero_offload.core.rules.rule import Rule
from lightning_zero_offload.core.rules.rules import rule_named
from lightning_zero_offload.ops.moments import Moments

# /2: compact moments ("moment_dtype"); /3: step counts per parameter ("param_steps")
SHARD_FORMAT = "lightning_zero_offload.shard/3"
SHARD_FORMATS = ("lightning_zero_offload.shard/1", "lightning_zero_offload.shard/2",
                 SHARD_FORMAT)  # what loads read
FULL_FORMAT = "lightning_zero_offload.full/1"
DIR_FORMAT = "lightning_zero_offload.dir/1"
MOMENT_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
RULE = "rule"  # the update rule's key, in a shard and in a consolidated form's optimizer state
RULE_OPTIONS = "rule_options"  # beside it: the options that shape its state (Rule.options)


class CheckpointError(ValueError):
    """A checkpoint that does not exist, cannot be read, or does not fit this engine."""



def group_hparams(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def shard_moment_dtype(shard: dict) -> str:
    """The moment format of a shard (format ``/1`` shards hold fp32 moments)."""
    return shard.get("moment_dtype", "fp32")


def shard_rule(shard: dict) -> Rule:
    """The update rule that wrote a shard (shards before the key were Adam's)."""
    return named_rule(shard.get(RULE, "adamw"), "shard", shard.get(RULE_OPTIONS))


def named_rule(key: object, where: str, options: object = None) -> Rule:
    """The rule a checkpoint records by its key and the options that shape its state
    (``where``: the part that records them)."""
    try:
        return rule_named(str(key), **(options if isinstance(options, dict) else {}))
    except ValueError as e:
        raise CheckpointError(f"the {where}'s {e}; use another checkpoint") from None


def optimizer_rule(optimizer: dict) -> Rule | None:
    """The rule a consolidated form's optimizer state records (None: not recorded, a plain
    torch optimizer's state or one saved before the key)."""
    key = optimizer.get(RULE)
    return None if key is None else named_rule(key, "optimizer state", optimizer.get(RULE_OPTIONS))


def param_steps(shard: dict) -> list[int]:
    """Steps taken per parameter, in layout order (older shards: each its group's count)."""
    if "param_steps" in shard:
        return [int(n) for n in shard["param_steps"]]
    return [int(shard["groups"][g]["step"]) for _, g, *_ in shard["layout"]["params"]]


def group_moments(shard: dict, g: int) -> Moments:
    """Group ``g``'s saved moments as ``ops.Moments`` (views of the shard's tensors)."""
    return shard_rule(shard).named(shard_moment_dtype(shard), shard["groups"][g])


def moments_fields(mom: Moments) -> dict[str, Tensor]:
    """The tensors a shard group stores for ``mom`` (the inverse of :func:`group_moments`)."""
    return mom.fields()


def consolidate(shards: list[dict]) -> dict:
    """Full state ``{"model": {name: fp32}, "optimizer": AdamW state_dict}`` from every shard.

    ``model`` holds the trained parameters only (first name of tied ones); callers add buffers.
    """
    if not shards:
        raise CheckpointError("consolidate: no shards given")
    if any("tensor_parallel" in s for s in shards):
        mesh = tuple(shards[0]["tensor_parallel"]["mesh"])
        raise CheckpointError(
            f"consolidate: the shards were written under tensor parallelism (mesh {mesh}); they "
            "resume only at that mesh. For one file, save a consolidated checkpoint from the "
            "run at that mesh (save_checkpoint(path, sharded=False); Lightning: "
            "sharded_checkpoint=False)")
    desc = shards[0]["layout"]
    world = desc["world_size"]
    by_rank = {s["rank"]: s for s in shards}
    if sorted(by_rank) != list(range(world)):
        raise CheckpointError(
            f"consolidate: the checkpoint was written by {world} ranks but shards for ranks "
            f"{sorted(by_rank)} were found; all {world} shard files are needed"
        )
    rule = shard_rule(shards[0])
    names = rule.names
    keys = ("master", *names)
    flats = {k: [torch.zeros(n) for n in desc["group_numel"]] for k in keys}
    for g, start, numel, host in desc["buckets"]:
        size = numel // world
        for r in range(world):
            sl = slice(start + r * size, start + (r + 1) * size)
            flats["master"][g][sl] = by_rank[r]["groups"][g]["master"][host : host + size]
            # Compact moments are dequantized bucket shard by bucket shard (block-aligned).
            state = group_moments(by_rank[r], g).chunk(host, size).to_fp32()
            for name, x in zip(names, state, strict=True):
                flats[name][g][sl] = x
    return assemble(desc, flats, param_steps(shards[0]), shards[0]["param_groups"], rule)


def assemble(desc: dict, flats: dict[str, list[Tensor]], steps: list[int],
             hparams: list[dict], rule: Rule) -> dict:
    """Full state from full flat fp32 buffers per group (``flats[key][group]``) and the steps
    per parameter (layout order; a parameter that never had a gradient gets no state, as in
    torch); without ``"master"`` the model is empty, without ``rule``'s state the optimizer
    state."""
    names = rule.names
    model: dict[str, Tensor] = {}
    state: dict[int, dict] = {}
    for (name, g, index, offset, numel, shape), step in zip(desc["params"], steps, strict=True):
        sl = slice(offset, offset + numel)
        if "master" in flats:
            model[name] = flats["master"][g][sl].view(shape).clone()
        if step > 0 and all(n in flats for n in names):
            state[index] = {"step": torch.tensor(float(step)), **{
                n: flats[n][g][sl].view(shape).clone() for n in names}}
    param_groups, index = [], 0
    for hp, size in zip(hparams, desc["group_sizes"], strict=True):
        param_groups.append({**hp, "params": list(range(index, index + size))})
        index += size
    return {"model": model, "optimizer": optimizer_state(state, param_groups, rule)}


def optimizer_state(state: dict[int, dict], param_groups: list[dict], rule: Rule) -> dict:
    """A consolidated form's optimizer state: torch's ``state`` and ``param_groups``, and the
    key of the rule that wrote it, with the options that shape its state where it has any."""
    options = {RULE_OPTIONS: rule.options} if rule.options else {}
    return {"state": state, "param_groups": param_groups, RULE: rule.KEY, **options}


def shard_numel(desc: dict, group: int) -> int:
    return sum(numel // desc["world_size"] for g, _, numel, _ in desc["buckets"] if g == group)
