"""Checkpoints of a ``fully_shard`` model under ZeRO-Offload (issue 46 item 6).

Sharded (each process writes its local shards) resumes bit for bit at the mesh that wrote it and
is refused, on every rank and changing nothing, at another; consolidated (gathered a tensor at a
time) loads into a plain model with torch's AdamW, into the engine without FSDP2 and into
``fully_shard`` at another world size or mesh; one process (``fully_shard`` over a mesh of one)
saves and resumes too; and the model state Lightning's ``ModelParallelStrategy`` writes (a
``torch.distributed.checkpoint`` folder) loads into a ``fully_shard`` model under the engine.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist import free_port, run_ranks
from _helpers import clone_nested, equal_nested
from _tiny_llama import batch, lm_loss, make, param_groups
from test_fsdp2 import _full, _optimizer, _sharded
from torch import nn

from lightning_zero_offload import ZeroOffload

SAVED_AT, STEPS = 3, 6  # steps before the save; the runs go on to STEPS
REFUSED = "resumes only at the mesh that wrote it"


def _engine(world: int, *, fsdp: bool = True, **cfg: object) -> ZeroOffload:
    """The tiny Llama (final norm frozen), ``fully_shard``-ed over ``world`` processes or
    plain, two parameter groups, under the engine (bf16-mixed unless ``cfg`` says)."""
    model = _sharded(world) if fsdp else make(0).requires_grad_(True)
    if not fsdp:
        model.norm.weight.requires_grad_(False)
    return ZeroOffload(model, _optimizer(model, "adamw"), device="cpu", max_grad_norm=1.0,
                       bucket_size_mb=0.002, **cfg)  # type: ignore[arg-type]


def _steps(engine: ZeroOffload, part: int, steps: range) -> None:
    for step in steps:
        for m in range(2):
            x, y = batch(step, m, part)
            engine.backward(lm_loss(engine.module(x), y) / 2, sync_gradients=m == 1)
        engine.step()
        engine.zero_grad()


def _finish(engine: ZeroOffload, part: int) -> dict:
    """The run from the save on: the whole weights and this rank's state at the end."""
    _steps(engine, part, range(SAVED_AT, STEPS))
    engine.gather_weights()
    out = {"weights": _full(engine.module), "state": clone_nested(engine.state_dict())}
    engine.teardown()
    return out


def _round_trip(rank: int, world: int, root: str, cfg: dict) -> dict:
    """Train, save sharded and consolidated (and keep ``state_dict()``), go on; then fresh
    engines at the same mesh resume from each and go on the same way."""
    a = _engine(world, **cfg)
    _steps(a, rank, range(SAVED_AT))
    shard, full = clone_nested(a.state_dict()), a.full_state_dict()
    lazy = a.consolidated()  # nothing gathered until written: a tensor at a time
    out: dict = {"lazy": all(type(v).__name__ == "Later" for k, v in lazy["model"].items()
                             if k != "norm.weight")}
    a.save_checkpoint(f"{root}/sharded")
    a.save_checkpoint(f"{root}/full.pt", sharded=False)
    out["straight"], out["full"] = _finish(a, rank), full
    for name, load in (("sharded", lambda e: e.load_checkpoint(f"{root}/sharded")),
                       ("state_dict", lambda e: e.load_state_dict(shard)),
                       ("consolidated", lambda e: e.load_checkpoint(f"{root}/full.pt"))):
        e = _engine(world, **cfg)
        load(e)
        out[f"{name}_restored"] = (equal_nested(e.state_dict(), shard) and
                                   equal_nested(e.full_state_dict(), full))
        out[name] = _finish(e, rank)
    return out


def _check_round_trip(out: list[dict]) -> None:
    for r in out:
        assert r["lazy"]
        for name in ("sharded", "state_dict", "consolidated"):
            assert r[f"{name}_restored"], name
            # bit for bit what the run that went straight on reached: weights and state
            assert equal_nested(r[name], r["straight"]), name


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """Checkpoints written at 2 processes (bf16-mixed), and how resuming from them went."""
    root = str(tmp_path_factory.mktemp("fsdp2_ckpt"))
    return root, run_ranks(_round_trip, 2, root, {}, timeout=400)


def test_sharded_and_consolidated_resume_bit_for_bit_at_the_same_mesh(two) -> None:
    _check_round_trip(two[1])


def test_one_process_resumes_bit_for_bit(tmp_path) -> None:
    """``fully_shard`` over one process: the engine has no sharded side of more than one
    rank there, and its module's parameters are still DTensors."""
    _check_round_trip(run_ranks(_round_trip, 1, str(tmp_path), {"precision": "32-true"}))


def test_delayed_update_resumes_bit_for_bit(tmp_path) -> None:
    cfg = {"precision": "32-true", "delayed_update": True, "delayed_update_warmup": 1}
    _check_round_trip(run_ranks(_round_trip, 2, str(tmp_path), cfg, timeout=400))


def _fresh(world: int, **kw: object) -> tuple[ZeroOffload, dict]:
    e = _engine(world, **kw)
    return e, e.full_state_dict()


def _at_four(rank: int, world: int, root: str) -> dict:
    """The 2-process checkpoints at 4 processes: the sharded one refused, the consolidated
    one loaded, into ``fully_shard`` and into the engine without it."""
    from lightning_zero_offload.core.checkpoint import CheckpointError

    out: dict = {}
    for fsdp in (True, False):
        e, start = _fresh(world, fsdp=fsdp)
        with pytest.raises(CheckpointError) as err:
            e.load_checkpoint(f"{root}/sharded")
        out[f"refused_{fsdp}"] = str(err.value)
        out[f"unchanged_{fsdp}"] = equal_nested(e.full_state_dict(), start)
        e.load_checkpoint(f"{root}/full.pt")
        out[f"loaded_{fsdp}"] = e.full_state_dict()
        _steps(e, rank, range(SAVED_AT, SAVED_AT + 1))  # and it trains on
        e.teardown()
    return out


def test_another_world_size_refuses_sharded_and_loads_consolidated(two) -> None:
    root, written = two
    for r in run_ranks(_at_four, 4, root, timeout=400):
        for fsdp in (True, False):
            assert REFUSED in r[f"refused_{fsdp}"]
            assert "written with fully_shard over 2 processes" in r[f"refused_{fsdp}"]
            assert r[f"unchanged_{fsdp}"]  # the refused load changed nothing
            assert equal_nested(r[f"loaded_{fsdp}"], written[0]["full"])
        assert "this run has fully_shard over 4 processes" in r["refused_True"]
        assert "this run has no fully_shard" in r["refused_False"]


def _at_one(rank: int, world: int, root: str) -> dict:
    """The 2-process checkpoints in one process: ``fully_shard`` over a mesh of one (sharded
    refused, consolidated loaded), the engine without it, a plain model with torch's AdamW."""
    from lightning_zero_offload.core.checkpoint import CheckpointError, files

    e, start = _fresh(1)
    with pytest.raises(CheckpointError) as err:
        e.load_checkpoint(f"{root}/sharded")
    out: dict = {"refused": str(err.value), "unchanged": equal_nested(e.full_state_dict(), start)}
    for fsdp in (True, False):
        e = e if fsdp else _engine(1, fsdp=False)
        e.load_checkpoint(f"{root}/full.pt")
        out[f"loaded_{fsdp}"] = e.full_state_dict()
        e.teardown()
    full = files.load_file(f"{root}/full.pt")  # checksum verified and removed
    plain = make(0)
    plain.norm.weight.requires_grad_(False)
    opt = _optimizer(plain, "adamw")
    plain.load_state_dict(full["model"])
    opt.load_state_dict(full["optimizer"])
    out["plain"] = {"model": plain.state_dict(), "optimizer": opt.state_dict()}
    out["file"] = full
    return out


def test_consolidated_loads_into_one_process_a_plain_model_and_torch_adamw(two) -> None:
    root, written = two
    (r,) = run_ranks(_at_one, 1, root)
    assert REFUSED in r["refused"] and "this run has fully_shard over 1 process" in r["refused"]
    assert r["unchanged"]
    assert equal_nested(r["loaded_True"], written[0]["full"])
    assert equal_nested(r["loaded_False"], written[0]["full"])
    plain, full = r["plain"], r["file"]
    assert equal_nested(plain["model"], full["model"])  # the values before the save
    assert equal_nested(plain["optimizer"]["state"], full["optimizer"]["state"])
    assert equal_nested(full["model"], written[0]["full"]["model"])


def _two_d(rank: int, world: int, root: str) -> dict:
    """FSDP2 over "data_parallel" x tensor parallelism (2 x 2): sharded resumes there and is
    refused by a 1-D ``fully_shard`` of 4; the consolidated one loads into it."""
    from _tiny_llama import parallelize
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_zero_offload.core.checkpoint import CheckpointError

    def engine() -> ZeroOffload:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel",
                                                               "tensor_parallel"))
        model = make(0)
        model.norm.weight.requires_grad_(False)
        parallelize(model, mesh["tensor_parallel"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return ZeroOffload(model, _optimizer(model, "adamw"), device="cpu", device_mesh=mesh,
                           max_grad_norm=1.0, bucket_size_mb=0.002, precision="32-true")

    part = rank // 2  # the data-parallel coordinate
    a = engine()
    _steps(a, part, range(SAVED_AT))
    full = a.full_state_dict()
    a.save_checkpoint(f"{root}/2d")
    a.save_checkpoint(f"{root}/2d.pt", sharded=False)
    out = {"straight": _finish(a, part)}
    b = engine()
    b.load_checkpoint(f"{root}/2d")
    out["restored"] = equal_nested(b.full_state_dict(), full)
    out["resumed"] = _finish(b, part)
    c = _engine(world, precision="32-true")
    with pytest.raises(CheckpointError) as err:
        c.load_checkpoint(f"{root}/2d")
    out["refused"] = str(err.value)
    c.load_checkpoint(f"{root}/2d.pt")
    out["one_d"] = equal_nested(c.full_state_dict(), full)
    c.teardown()
    return out


def test_fully_shard_over_data_parallel_times_tensor_parallel(tmp_path) -> None:
    for r in run_ranks(_two_d, 4, str(tmp_path), timeout=400):
        assert r["restored"] and r["one_d"]
        assert equal_nested(r["resumed"], r["straight"])
        assert REFUSED in r["refused"]
        assert "(mesh (data_parallel, tensor_parallel) = (2, 2))" in r["refused"]


# -- no second copy of the state ------------------------------------------------------------------
def _memory(rank: int, world: int, folder: str) -> dict:
    """A 24M-parameter ``fully_shard`` model (12M per process, 144 MB of fp32 state): a
    consolidated or sharded save and load peak at most a bucket and a tensor over before."""
    from test_checkpoint_memory import BUCKET_MB, LAYERS, WIDTH
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    e = ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
                    precision="32-true", cpu_threads=1, bucket_size_mb=BUCKET_MB)
    e.backward(model(torch.randn(4, WIDTH)).square().mean())
    e.step()
    e.zero_grad()
    return _peaks(e, folder)


def _peaks(e: ZeroOffload, folder: str) -> dict:
    """``(save, load)`` peaks over before, sharded and consolidated, into ``folder``."""
    from test_checkpoint_memory import Peak

    out = {}
    for name, sharded in (("sharded", True), ("consolidated", False)):
        path = f"{folder}/{name}" + ("" if sharded else ".pt")
        with Peak() as save:
            e.save_checkpoint(path, sharded=sharded)
        with Peak() as load:
            e.load_checkpoint(path)
        out[name] = (save.over, load.over)
    return out


@pytest.mark.slow
def test_save_and_load_hold_no_second_copy(tmp_path) -> None:
    from test_checkpoint_memory import SLACK, MiB

    for rank, r in enumerate(run_ranks(_memory, 2, str(tmp_path), timeout=400)):
        for name, (save, load) in r.items():
            assert save <= SLACK, f"rank {rank}, {name}: the save peaked {save / MiB:.0f} MiB"
            assert load <= SLACK, f"rank {rank}, {name}: the load peaked {load / MiB:.0f} MiB"


# -- Lightning's ModelParallelStrategy ------------------------------------------------------------
def _fully_shard(model: nn.Module, mesh: object) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _lightning_write(rank: int, world: int, path: str, port: int) -> dict:
    """3 steps of AdamW under ``ModelParallelStrategy``, then ``trainer.save_checkpoint``: a
    ``torch.distributed.checkpoint`` folder (``save_distributed_checkpoint=True``)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from test_lightning_tp import Llama  # a ModelParallelStrategy user's module and data

    class Sharded(Llama):
        def configure_model(self) -> None:
            _fully_shard(self.model, self.device_mesh["data_parallel"])

    torch.distributed.destroy_process_group()  # Lightning starts its own
    os.environ["MASTER_PORT"] = str(port)
    module = Sharded()
    trainer = Trainer(strategy=ModelParallelStrategy(data_parallel_size=world,
                                                     tensor_parallel_size=1),
                      accelerator="cpu", devices=world, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


class _Holder(nn.Module):
    """What the LightningModule's state_dict keys name: ``model.<parameter>``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make(0)


def _lightning_read(rank: int, world: int, path: str) -> dict:
    """The weights of Lightning's folder (its ``"state_dict"`` entry) read with
    ``torch.distributed.checkpoint`` into a ``fully_shard`` model before the engine is built,
    and into fp32 DTensors cut as the parameters are, given to a built engine."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    out = {}
    for when in ("before", "after"):
        holder = _Holder()
        _fully_shard(holder.model, init_device_mesh("cpu", (world,)))
        if when == "before":
            state = {"state_dict": get_model_state_dict(holder)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(holder, state["state_dict"])
        e = ZeroOffload(holder, torch.optim.AdamW(param_groups(holder.model)), device="cpu")
        if when == "after":  # the bf16 shards cannot hold it: fp32 buffers of the same cut
            state = {"state_dict": {k: DTensor.from_local(
                torch.empty(v.to_local().shape), v.device_mesh, v.placements, shape=v.shape,
                stride=v.stride()) for k, v in get_model_state_dict(holder).items()}}
            dcp.load(state, checkpoint_id=path)
            e.load_full_state_dict({"model": state["state_dict"]})
        out[when] = e.full_state_dict(optimizer=False)["model"]  # the fp32 master weights
        e.teardown()
    return out


def test_a_model_parallel_strategy_checkpoint_loads_into_fully_shard_under_the_engine(tmp_path):
    path = str(tmp_path / "lightning.ckpt")
    want = run_ranks(_lightning_write, 2, path, free_port(), timeout=400)[0]
    assert os.path.isfile(os.path.join(path, ".metadata"))  # torch.distributed.checkpoint's
    start = {f"model.{n}": p for n, p in make(0).named_parameters()}
    assert not equal_nested(want, start)  # the fit moved the weights
    for world in (2, 1):  # the same mesh, and another (DCP reshards)
        for r in run_ranks(_lightning_read, world, path, timeout=400):
            assert equal_nested(r["before"], want) and equal_nested(r["after"], want)
