"""A LightningModule (and a Fabric ``parallelize_fn``) written for Lightning's
``ModelParallelStrategy`` whose ``fully_shard`` calls carry FSDP2's ``CPUOffloadPolicy``: the
weights live on the host, the engine steps FSDP2's host shards in place. Only the strategy
changes (on the CPU it is told ``offload_weights=True``: FSDP2 has no public getter for its
policy, and on a CPU compute device the shards' place cannot say). Against
``ModelParallelStrategy`` with the same policy and torch's AdamW, 2 gloo processes, accumulation
2, clipping at 0.5 (binding at every step); the Trainer and Fabric in one spawn."""

from __future__ import annotations

import pytest
import torch
from _dist import free_port, run_ranks
from _helpers import total_rel_err
from _tiny_llama import batch, lm_loss, make, param_groups
from test_lightning_fsdp2 import CLIP, ShardedLlama, _full, _relaunch, _strategy, _trainer

from lightning_zero_offload import ZeroOffloadConfig

pytestmark = pytest.mark.slow  # gloo processes

STEPS, ACCUM = 5, 2


def offload_shard(module: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 per block and at the root over ``mesh["data_parallel"]``, weights on the host
    (unpinned: this machine has no CUDA)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw = {"mesh": mesh["data_parallel"], "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    for layer in module.layers:  # type: ignore[union-attr]
        fully_shard(layer, **kw)
    return fully_shard(module, **kw)


class OffloadedLlama(ShardedLlama):
    """The tiny Llama whose ``configure_model`` puts FSDP2's shards on the host."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.model, FSDPModule):
            offload_shard(self.model, self.device_mesh)

    def on_train_end(self) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        self.master_bytes = None if engine is None else engine.host_budget["master"]


OFFLOAD = ZeroOffloadConfig(offload_weights=True)


def _trainer_fit(which: str, world: int) -> dict:
    module = OffloadedLlama()
    kw = {"config": OFFLOAD} if which == "ours" else {}
    _trainer(_strategy(which, world, 1, **kw), world, max_steps=STEPS, limit_val_batches=0,
             precision="32-true").fit(module)
    return {"weights": _full(module), "master_bytes": module.master_bytes,
            "on_host": {p.to_local().device.type for p in module.parameters()}}


def _fabric_fit(which: str, world: int) -> dict:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy

    if which == "ours":
        strategy = ZeroOffloadFabricStrategy(OFFLOAD, parallelize_fn=offload_shard,
                                             data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = ModelParallelStrategy(parallelize_fn=offload_shard, data_parallel_size=world,
                                         tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    model = fabric.setup(make(0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(param_groups(model), lr=1e-2))
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            x, y = batch(step, m, fabric.global_rank)
            with fabric.no_backward_sync(model, enabled=m < ACCUM - 1):
                fabric.backward(lm_loss(model(x), y) / ACCUM)
        norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad()
    if which == "ours":
        strategy.teardown()  # collective: waits for the last host step
    weights = {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}
    return {"weights": weights, "norms": norms}


def _all(rank: int, world: int, port: int) -> dict:
    _relaunch(port)
    return {f"{front} {which}": fit(which, world)
            for front, fit in (("trainer", _trainer_fit), ("fabric", _fabric_fit))
            for which in ("ours", "lightning")}


def test_cpu_offload_policy_equals_model_parallel_strategy_trainer_and_fabric():
    start = {n: p.detach() for n, p in make(0).named_parameters()}
    for r in run_ranks(_all, 2, free_port(), timeout=500):
        for front in ("trainer", "fabric"):
            ours, want = r[f"{front} ours"], r[f"{front} lightning"]
            strip = {k.removeprefix("model."): v for k, v in want["weights"].items()}
            assert total_rel_err(strip, start) > 1e-2  # the run does train
            rel = total_rel_err(ours["weights"], want["weights"])
            print(f"{front}, 2 processes, CPUOffloadPolicy: rel {rel:.3g}")
            assert rel < 1e-6, front
        trainer = r["trainer ours"]
        # FSDP2's host shards are the master: the engine holds no copy of the weights
        assert trainer["master_bytes"] == 0 and trainer["on_host"] == {"cpu"}
        assert min(r["fabric lightning"]["norms"]) > CLIP  # clipping binds at every step


def test_the_recipe_with_offload_weights_ends_where_model_parallel_strategy_ends():
    """examples/lightning_fsdp2.py --offload-weights on 2 CPU processes, 3 steps, under each
    strategy."""
    from pathlib import Path

    from _dist import torchrun

    recipe = Path(__file__).resolve().parents[1] / "examples" / "lightning_fsdp2.py"
    losses = []
    for strategy in ("zero_offload", "model_parallel"):
        proc = torchrun(recipe, "--devices", "2", "--accelerator", "cpu",
                        "--max-steps", "3", "--strategy", strategy, "--offload-weights",
                        timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses += [line for line in proc.stdout.splitlines() if line.startswith("final loss")]
    assert len(losses) == 2 and losses[0] == losses[1], losses
