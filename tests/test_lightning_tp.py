"""``ZeroOffloadStrategy(tensor_parallel_size=2)`` on 4 CPU processes: a LightningModule written
for ``ModelParallelStrategy`` (``configure_model`` parallelizes itself over
``self.device_mesh["tensor_parallel"]``) ends where the plain single-process run ends."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
import torch
from _tiny_llama import SEQ, VOCAB, lm_loss, make, parallelize, param_groups
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.lightning import mesh as tp_mesh

STEPS, ACCUM, BATCH = 5, 2, 2  # BATCH per data-parallel rank and micro-batch
pytestmark = pytest.mark.usefixtures("isolated_process_group")  # a fit in this process
TIMEOUT = 20  # collective_timeout_s of the failure cases (the process group's too: rendezvous)


class Llama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make(0)

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # as under ModelParallelStrategy
            parallelize(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return lm_loss(self.model(tokens[:, :-1]), tokens[:, 1:])

    def configure_optimizers(self):
        return torch.optim.AdamW(param_groups(self.model), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        """Fixed data; data-parallel rank r of 2 reads samples r, r + 2, ... (what one process
        reads as batches of twice the size), its tensor-parallel peers the same ones."""
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (STEPS * ACCUM * 2 * BATCH, SEQ + 1), generator=g)
        if self.device_mesh is None:
            return DataLoader(TensorDataset(tokens), batch_size=2 * BATCH)
        dp = self.device_mesh["data_parallel"]
        mine = tokens[dp.get_local_rank()::dp.size()]
        return DataLoader(TensorDataset(mine), batch_size=BATCH)


def _fit(strategy: object, root: str, save: str | None = None, **kw) -> Llama:
    """``fit``, then (``save``) a checkpoint of the trained run at that path."""
    module = Llama()
    trainer = Trainer(strategy=strategy, accelerator="cpu", max_steps=STEPS,  # type: ignore
                      accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, precision="32-true",
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root,
                      use_distributed_sampler=False, **kw)
    trainer.fit(module)
    if save is not None:
        trainer.save_checkpoint(save)  # collective
    return module


def _full(module: Llama) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in module.model.named_parameters()}


def _fit_tp(rank: int, world: int, root: str, port: int) -> dict:
    """One of 4 processes of a torchrun-style launch (Lightning starts the process group)."""
    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    strategy = ZeroOffloadStrategy(tensor_parallel_size=2)
    module = _fit(strategy, f"{root}/{rank}", save=f"{root}/tp.ckpt", devices=4)
    mesh = strategy.device_mesh
    return {"weights": _full(module), "mesh": tuple(mesh.mesh.shape), "rank": rank,
            "sampler": strategy.distributed_sampler_kwargs,
            "dtensor": type(module.model.layers[0].attn.wq.weight).__name__}


@pytest.mark.slow
def test_trainer_tensor_parallel_2_on_4_processes_equals_the_plain_run(tmp_path):
    from _dist import free_port, run_ranks

    got = run_ranks(_fit_tp, 4, str(tmp_path), free_port(), timeout=400)
    plain = _full(_fit("auto", str(tmp_path / "plain"), devices=1))
    start = {n: p.detach().clone() for n, p in make(0).named_parameters()}
    num = sum(float((plain[k] - start[k]).norm() ** 2) for k in start) ** 0.5
    assert num / sum(float(v.norm() ** 2) for v in start.values()) ** 0.5 > 1e-2  # it trained
    for r in got:
        assert r["mesh"] == (2, 2) and r["dtensor"] == "DTensor"
        assert r["sampler"] == {"num_replicas": 2, "rank": r["rank"] // 2}  # the DP coordinate
        err = sum(float((r["weights"][k] - plain[k]).norm() ** 2) for k in plain) ** 0.5
        rel = err / sum(float(v.norm() ** 2) for v in plain.values()) ** 0.5
        print("lightning tp rel", rel)
        assert rel < 5e-5
    # the consolidated checkpoint: whole tensors, loaded without the strategy or a mesh
    loaded = Llama.load_from_checkpoint(str(tmp_path / "tp.ckpt"))
    assert type(loaded.model.layers[0].attn.wq.weight).__name__ == "Parameter"
    assert all(torch.equal(v, got[0]["weights"][k]) for k, v in _full(loaded).items())
    assert _full(loaded).keys() == got[0]["weights"].keys()


def test_mesh_sizes_resolve_like_model_parallel_strategy():
    assert tp_mesh.resolve_sizes("auto", 2, 4) == (2, 2)
    assert tp_mesh.resolve_sizes(1, "auto", 4) == (1, 4)
    assert tp_mesh.resolve_sizes("auto", "auto", 4) == (4, 1)  # data parallel only
    with pytest.raises(ValueError, match="must equal the number of processes"):
        tp_mesh.resolve_sizes(3, 2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 'auto' or a positive"):
        tp_mesh.resolve_sizes("auto", 0, 4)


# -- teardown under tensor parallelism: whatever holds the parameters; a fit's error as itself -----

class FailingMLP(LightningModule):
    """A small MLP, parallelized in ``configure_model``; ``training_step`` raises on rank
    ``fail_rank`` after its forward (the traceback then holds the autograd graph, and with it
    the parameters), and every parameter also sits in a user's list."""

    def __init__(self, fail_rank: int | None, kill: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 8))
        self.fail_rank, self.kill, self.started = fail_rank, kill, 0.0
        self.held: list = []

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
        self.held = list(self.net.parameters())

    def training_step(self, batch, batch_idx):
        failing = self.global_rank == self.fail_rank and batch_idx == 1
        if failing and self.kill:  # lost mid-run: no note for the peers, no teardown
            os.kill(os.getpid(), signal.SIGKILL)
        self.started = time.monotonic()
        loss = self.net(batch[0]).pow(2).mean()
        if failing:
            raise RuntimeError(f"user code failed on rank {self.global_rank}")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=torch.Generator()
                                                    .manual_seed(0))), batch_size=4)


def _fit_failing(tp: int, fail_rank: int | None, kill: bool = False) -> dict:
    """A bf16-mixed fit (teardown changes the parameters' dtype back to fp32); what it raised
    (and how long after the last step began) and what the module holds after it."""
    module = FailingMLP(fail_rank, kill)
    strategy = ZeroOffloadStrategy(tensor_parallel_size=tp, collective_timeout_s=TIMEOUT)
    trainer = Trainer(strategy=strategy,
                      devices=tp, accelerator="cpu", max_steps=3, precision="bf16-mixed",
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    error = None
    try:
        trainer.fit(module)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - module.started,
            "params": [(type(p).__name__, p.dtype) for p in module.held],
            "same": all(a is b for a, b in zip(module.held, module.net.parameters(),
                                               strict=True))}


@pytest.mark.parametrize("fail", [False, True])
def test_teardown_under_tensor_parallel_1_restores_and_keeps_the_fit_error(fail):
    got = _fit_failing(1, 0 if fail else None)
    assert got["error"] == ("RuntimeError: user code failed on rank 0" if fail else None)
    assert got["same"] and got["params"] == [("DTensor", torch.float32)] * 4


def _fit_failing_tp2(rank: int, world: int, port: int) -> dict:
    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    out = _fit_failing(2, 1)
    if rank == 1:
        import time

        time.sleep(2)  # stay alive a moment: rank 0 must fail on its own collective
    return out


@pytest.mark.slow
def test_a_fit_error_under_tensor_parallel_2_surfaces_and_names_its_rank():
    from _dist import free_port, run_ranks

    first, second = run_ranks(_fit_failing_tp2, 2, free_port(), timeout=300)
    assert second["error"] == "RuntimeError: user code failed on rank 1", second
    assert second["params"] == [("DTensor", torch.float32)] * 4  # restored all the same
    assert first["error"].startswith("CollectiveError: ZeroOffload: the "), first
    assert "rank 1 failed first" in first["error"] and "user code failed" in first["error"]


def _fit_killed_tp2(rank: int, world: int, port: int) -> dict:
    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    return _fit_failing(2, 1, kill=True)


@pytest.mark.slow
def test_a_rank_killed_under_tensor_parallel_2_ends_the_other_naming_it():
    """Rank 1 dies mid-fit (SIGKILL); rank 0, in a forward collective of DTensor's, ends with
    the engine's error naming the lost rank, as without tensor parallelism."""
    import torch.multiprocessing as mp
    from _dist import _worker, free_port, stop

    ctx = mp.get_context("spawn")
    results, ports = ctx.Queue(), (free_port(), free_port())  # run_ranks' and Lightning's
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(_fit_killed_tp2, r, 2, ports[0], ports[1:], 300, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, ok, payload = results.get(timeout=300)  # rank 1 never answers
    finally:
        stop(procs)
    assert rank == 0 and ok, payload
    got = pickle.loads(payload)
    assert got["error"].startswith("CollectiveError: ZeroOffload: the forward of the training "
                                   "step on rank 0 failed"), got["error"]
    assert "rank 1 probably failed, was lost" in got["error"]
    assert got["seconds"] < TIMEOUT + 10
