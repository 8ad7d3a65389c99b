"""``ZeroOffloadFabricStrategy(parallelize_fn=..., tensor_parallel_size=2)`` on 4 CPU processes:
Fabric's ``ModelParallelStrategy`` interface (``parallelize_fn(module, device_mesh)``) with the
engine behind ``fabric.setup(model, optimizer)``, against torch's AdamW on one process."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import free_port, run_ranks
from _helpers import total_rel_err
from _tiny_llama import batch, lm_loss, make, parallelize, param_groups
from test_tensor_parallel import ACCUM, STEPS, _reference

from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy


def _parallelize(module, mesh):
    return parallelize(module, mesh["tensor_parallel"])


def _whole(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def _fabric_tp(rank: int, world: int, root: str, port: int) -> dict:
    """One of 4 processes of a torchrun-style launch (Fabric starts the process group)."""
    from lightning.fabric import Fabric

    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    strategy = ZeroOffloadFabricStrategy(parallelize_fn=_parallelize, tensor_parallel_size=2,
                                         bucket_size_mb=0.002)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy, precision="32-true")
    fabric.launch()
    model = make(0)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)  # over the plain module
    model, optimizer = fabric.setup(model, optimizer)
    dp = strategy.device_mesh["data_parallel"].get_local_rank()
    for step in range(STEPS):
        for m in range(ACCUM):
            x, y = batch(step, m, dp)
            with fabric.no_backward_sync(model, enabled=m < ACCUM - 1):
                fabric.backward(lm_loss(model(x), y) / ACCUM)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(f"{root}/fabric.ckpt", {"model": model, "optimizer": optimizer})
    strategy.teardown()
    return {"weights": _whole(model.module), "mesh": tuple(strategy.device_mesh.mesh.shape),
            "sampler": strategy.distributed_sampler_kwargs,
            "dtensor": type(model.layers[0].attn.wq.weight).__name__}


@pytest.mark.slow
def test_fabric_tensor_parallel_2_on_4_processes_equals_torch_adamw(tmp_path):
    got = run_ranks(_fabric_tp, 4, str(tmp_path), free_port(), timeout=400)
    want = _reference()
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)
    for rank, r in enumerate(got):
        assert r["mesh"] == (2, 2) and r["dtensor"] == "DTensor"
        assert r["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert total_rel_err(r["weights"], want) < 5e-5
    # the checkpoint holds the whole tensors: a plain model loads it
    plain = make(0)
    plain.load_state_dict(saved["model"])
    assert all(torch.equal(v, got[0]["weights"][k]) for k, v in _whole(plain).items())


def test_parallelize_fn_without_a_mesh_size_is_refused():
    with pytest.raises(ValueError, match="parallelize_fn needs a mesh: set tensor_parallel_size"):
        ZeroOffloadFabricStrategy(parallelize_fn=_parallelize)
