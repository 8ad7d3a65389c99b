"""``ZeroOffloadFabricStrategy(parallelize_fn=..., data_parallel_size=...,
tensor_parallel_size=...)`` where ``parallelize_fn`` calls ``fully_shard`` over
``device_mesh["data_parallel"]`` (and ``parallelize_module`` over ``"tensor_parallel"``), in
Fabric's ``ModelParallelStrategy`` order (``fabric.setup(model)``, the optimizer over its
parameters, ``fabric.setup_optimizers``) and jointly (``fabric.setup(model, optimizer)``).
Against Fabric's ``ModelParallelStrategy`` with torch's AdamW on 2 (2 x 1) and 4 (2 x 2) gloo
processes, accumulation 2, clipping at 0.5 (binding at every step)."""

from __future__ import annotations

import pytest
import torch
from _dist import free_port, run_ranks
from _helpers import total_rel_err
from _tiny_llama import batch, lm_loss, make, parallelize, param_groups
from test_lightning_fsdp2 import CLIP, _relaunch, hand_clip

STEPS, ACCUM = 5, 2


def shard(module, mesh):
    """A ``parallelize_fn`` as a Fabric ``ModelParallelStrategy`` user writes it."""
    from torch.distributed.fsdp import fully_shard

    if mesh["tensor_parallel"].size() > 1:
        parallelize(module, mesh["tensor_parallel"])
    for layer in module.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(module, mesh=mesh["data_parallel"])


def _whole(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}


def _train(which: str, world: int, tp: int, root: str) -> dict:
    """``which``: "lightning" (Fabric's strategy), "ours" (the same code), "ours-joint"
    (``fabric.setup(model, optimizer)``, the optimizer over the plain module)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy

    kind = ModelParallelStrategy if which == "lightning" else ZeroOffloadFabricStrategy
    strategy = kind(parallelize_fn=shard, data_parallel_size=world // tp, tensor_parallel_size=tp)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    if which == "ours-joint":
        model = make(0)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(param_groups(model), lr=1e-2))
    else:
        model = fabric.setup(make(0))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(param_groups(model), lr=1e-2))
    dp = strategy.device_mesh["data_parallel"].get_local_rank()
    for step in range(STEPS):
        for m in range(ACCUM):
            x, y = batch(step, m, dp)
            with fabric.no_backward_sync(model, enabled=m < ACCUM - 1):
                fabric.backward(lm_loss(model(x), y) / ACCUM)
        if which == "lightning" and tp > 1:  # torch's clip_grad_norm_ fails over two meshes
            hand_clip(model.parameters(), CLIP)
        else:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    out = {"weights": _whole(model.module)}  # as the loop left them: the engine's fp32 copies
    if which != "lightning":
        fabric.save(f"{root}/fabric.ckpt", {"model": model, "optimizer": optimizer})
        strategy.teardown()  # collective: the masters back into the module
        out["torn_down"] = _whole(model.module)
    return out


def _both(rank: int, world: int, which: str, tp: int, root: str, port: int) -> dict:
    _relaunch(port)
    return {"ours": _train(which, world, tp, root),
            "lightning": _train("lightning", world, tp, root)}


def _compare(world: int, tp: int, which: str, root: str) -> None:
    got = run_ranks(_both, world, which, tp, root, free_port(), timeout=400)
    assert total_rel_err(got[0]["lightning"]["weights"], _whole_plain(make(0))) > 1e-2  # trains
    rel = max(total_rel_err(r["ours"]["weights"], r["lightning"]["weights"]) for r in got)
    print(f"fabric {which}, {world} processes, tensor parallel {tp}: rel {rel:.3g}")
    assert rel < 1e-6
    saved = torch.load(f"{root}/fabric.ckpt", weights_only=True)["model"]  # whole tensors
    for r in got:
        ours = r["ours"]
        assert all(torch.equal(ours["torn_down"][k], v) for k, v in ours["weights"].items())
        assert all(torch.equal(saved[k], v) for k, v in ours["weights"].items())


def _whole_plain(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def test_fully_shard_on_2_processes_equals_fabric_model_parallel_strategy(tmp_path):
    _compare(2, 1, "ours", str(tmp_path))


@pytest.mark.slow
def test_fully_shard_times_tensor_parallel_2x2_set_up_jointly_equals_fabric(tmp_path):
    _compare(4, 2, "ours-joint", str(tmp_path))
