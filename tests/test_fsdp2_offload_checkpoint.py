"""Checkpoints of a ``fully_shard`` model whose weights live on the host (FSDP2's
``CPUOffloadPolicy``, ``offload_weights=True``) under ZeRO-Offload (issue 47 item 4).

The consolidated file written with host weights loads into a plain model with torch's AdamW,
into ``fully_shard`` without the policy and into ``fully_shard`` with it at another world size
(2 -> 1 and 1 -> 2); one written without host weights loads with them; each run goes on equal
to the run that was not interrupted. A save or load holds no second copy of the rank's state
(FSDP2's host shards are the master: exported a bucket at a time), and a damaged or mismatched
checkpoint is refused, naming the problem, with nothing changed. The same-mesh resumes (sharded
with int8 moments, consolidated) are ``tests/test_fsdp2_offload.py``'s.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _helpers import clone_nested, equal_nested
from _tiny_llama import batch, lm_loss, make
from test_fsdp2 import _optimizer, _sharded
from test_fsdp2_checkpoint import _peaks
from test_fsdp2_offload import _offloaded
from torch import nn

from lightning_zero_offload import ZeroOffload

pytestmark = pytest.mark.slow  # every test spawns gloo processes

SAVED_AT, STEPS = 3, 6  # steps before the save; the runs go on to STEPS
PARTS = 2  # each step trains on two parts of two micro-batches, over 1 or 2 processes
CLOSE = 1e-6  # another world size or placement: the same sums in another order


def _model(world: int, where: str) -> nn.Module:
    """The tiny Llama (final norm frozen): ``"host"`` ``fully_shard``-ed with its weights on
    the host, ``"device"`` ``fully_shard``-ed without the policy, ``"plain"`` neither."""
    if where == "host":
        return _offloaded(world)
    if where == "device":
        return _sharded(world)
    model = make(0).requires_grad_(True)
    model.norm.weight.requires_grad_(False)
    return model


def _engine(world: int, where: str, kind: str = "adamw") -> ZeroOffload:
    model = _model(world, where)
    return ZeroOffload(model, _optimizer(model, kind), device="cpu", max_grad_norm=1.0,
                       bucket_size_mb=0.002, precision="32-true",
                       offload_weights=where == "host")


def _micro_batches(rank: int, world: int) -> list[tuple[int, int]]:
    """``(part, micro-batch)`` this rank trains on each step: every part at one process."""
    per = PARTS // world
    return [(part, m) for part in range(rank * per, (rank + 1) * per) for m in range(2)]


def _steps(engine: ZeroOffload, rank: int, world: int, steps: range) -> None:
    mine = _micro_batches(rank, world)
    for step in steps:
        for i, (part, m) in enumerate(mine):
            x, y = batch(step, m, part)
            engine.backward(lm_loss(engine.module(x), y) / len(mine),
                            sync_gradients=i == len(mine) - 1)
        engine.step()
        engine.zero_grad()


def _state(engine: ZeroOffload) -> dict:
    """The whole fp32 weights and torch AdamW's state (collective)."""
    engine.synchronize()  # the last host update may still run under the overlap
    full = engine.full_state_dict()
    return {"model": full["model"], "state": full["optimizer"]["state"]}


def _finish(engine: ZeroOffload, rank: int, world: int) -> dict:
    """The run from the save on, and where it ends."""
    _steps(engine, rank, world, range(SAVED_AT, STEPS))
    out = _state(engine)
    engine.teardown()
    return out


def _write(engine: ZeroOffload, rank: int, world: int, path: str) -> dict:
    """Train to the save, save consolidated (``path``) and sharded (``path`` without ".pt"),
    go on uninterrupted: what was saved, where the run ends."""
    _steps(engine, rank, world, range(SAVED_AT))
    engine.save_checkpoint(path, sharded=False)
    engine.save_checkpoint(path.removesuffix(".pt"))
    return {"saved": _state(engine), "straight": _finish(engine, rank, world)}


def _resumed(world: int, where: str, path: str, rank: int) -> dict:
    e = _engine(world, where)
    e.load_checkpoint(path)
    return {"loaded": _state(e), "end": _finish(e, rank, world)}


def _at_two(rank: int, world: int, root: str) -> dict:
    """At 2 processes: consolidated files with and without host weights, and each loaded the
    other way at this world size; the 1-process file (host weights) loaded with them here."""
    out = {"host": _write(_engine(world, "host"), rank, world, f"{root}/host2.pt"),
           "device": _write(_engine(world, "device"), rank, world, f"{root}/device2.pt")}
    out["host_to_device"] = _resumed(world, "device", f"{root}/host2.pt", rank)
    out["device_to_host"] = _resumed(world, "host", f"{root}/device2.pt", rank)
    out["one_to_two"] = _resumed(world, "host", f"{root}/host1.pt", rank)
    # the sharded folders: the same mesh, the other placement of the weights
    out["host_to_device_sharded"] = _resumed(world, "device", f"{root}/host2", rank)
    out["device_to_host_sharded"] = _resumed(world, "host", f"{root}/device2", rank)
    return out


def _at_one(rank: int, world: int, root: str, read: bool) -> dict:
    """At 1 process: the 2-process files loaded into ``fully_shard`` with and without host
    weights, the engine without ``fully_shard``, a plain model with torch's AdamW; and the
    file ``_at_two`` reads (host weights) written here."""
    from lightning_zero_offload.core.checkpoint import files

    if not read:
        return {"one": _write(_engine(world, "host"), rank, world, f"{root}/host1.pt")}
    out = {}
    for where in ("host", "device", "plain"):
        out[f"two_to_{where}"] = _resumed(world, where, f"{root}/host2.pt", rank)
    out["device_two_to_host"] = _resumed(world, "host", f"{root}/device2.pt", rank)
    full = files.load_file(f"{root}/host2.pt")  # checksum verified and removed
    plain = _model(world, "plain")
    opt = _optimizer(plain, "adamw")
    plain.load_state_dict(full["model"])
    opt.load_state_dict(full["optimizer"])
    out["torch_loaded"] = clone_nested({"model": plain.state_dict(),
                                        "state": opt.state_dict()["state"]})
    mine = _micro_batches(rank, world)
    for step in range(SAVED_AT, STEPS):  # torch's AdamW goes on from the file
        for part, m in mine:
            x, y = batch(step, m, part)
            (lm_loss(plain(x), y) / len(mine)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
    out["torch_end"] = {"model": plain.state_dict(), "state": opt.state_dict()["state"]}
    out["refused"] = _refusals(root)
    return out


def _diff(got: dict, want: dict) -> float:
    """Relative difference of the weights and of each moment of torch AdamW's state."""
    worst = _field(got["model"], want["model"])
    for name in ("exp_avg", "exp_avg_sq"):
        worst = max(worst, _field({i: s[name] for i, s in got["state"].items()},
                                  {i: s[name] for i, s in want["state"].items()}))
    return worst


def _field(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    num = sum(float((got[k].float() - want[k].float()).double().norm() ** 2) for k in want)
    return (num / sum(float(want[k].double().norm() ** 2) for k in want)) ** 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """1 process writes; 2 write and read; 1 reads: what each rank saw."""
    root = str(tmp_path_factory.mktemp("offload_ckpt"))
    one = run_ranks(_at_one, 1, root, False, timeout=400)[0]
    two = run_ranks(_at_two, 2, root, timeout=400)
    back = run_ranks(_at_one, 1, root, True, timeout=400)[0]
    return {"one": one, "two": two, "back": back}


def _check_run(got: dict, saved: dict, straight: dict, bound: float) -> float:
    """Loaded exactly what was saved, ended within ``bound`` of the uninterrupted run (0: bit
    for bit); the difference."""
    assert equal_nested(got["loaded"], saved)
    diff = _diff(got["end"], straight)
    assert diff <= bound, diff
    return diff


def test_host_weights_and_device_weights_are_one_run(runs) -> None:
    # the same arithmetic whichever holds the master: what follows compares across both
    for r in runs["two"]:
        assert equal_nested(r["host"], r["device"])


def test_consolidated_with_host_weights_loads_into_torch_adamw(runs) -> None:
    back, host = runs["back"], runs["two"][0]["host"]
    assert _diff(back["torch_loaded"], host["saved"]) == 0  # the weights and moments saved
    assert _diff(back["torch_end"], host["straight"]) < CLOSE  # torch's AdamW goes on alike


def test_consolidated_with_host_weights_loads_without_them(runs) -> None:
    for r in runs["two"]:  # fully_shard without the policy, the same mesh: bit for bit
        _check_run(r["host_to_device"], r["host"]["saved"], r["host"]["straight"], 0)
    back, host = runs["back"], runs["two"][0]["host"]
    for where in ("device", "plain"):  # and at one process, with fully_shard or without it
        _check_run(back[f"two_to_{where}"], host["saved"], host["straight"], CLOSE)


def test_consolidated_with_host_weights_loads_at_another_world_size(runs) -> None:
    back, host, one = runs["back"], runs["two"][0]["host"], runs["one"]["one"]
    _check_run(back["two_to_host"], host["saved"], host["straight"], CLOSE)  # 2 -> 1
    for r in runs["two"]:  # 1 -> 2
        _check_run(r["one_to_two"], one["saved"], one["straight"], CLOSE)


def test_consolidated_without_host_weights_loads_with_them(runs) -> None:
    for r in runs["two"]:
        _check_run(r["device_to_host"], r["device"]["saved"], r["device"]["straight"], 0)
    device = runs["two"][0]["device"]
    _check_run(runs["back"]["device_two_to_host"], device["saved"], device["straight"], CLOSE)


def test_sharded_resumes_across_the_weights_placement_at_the_same_mesh(runs) -> None:
    for r in runs["two"]:
        _check_run(r["host_to_device_sharded"], r["host"]["saved"], r["host"]["straight"], 0)
        _check_run(r["device_to_host_sharded"], r["device"]["saved"], r["device"]["straight"], 0)


# -- refused, naming the problem, changing nothing ------------------------------------------------
def _refusals(root: str) -> dict:
    """Loads into a 1-process engine with host weights that must fail: ``(message, whether
    the engine's state is as before)`` each."""
    from lightning_zero_offload.core.checkpoint import files

    damaged = f"{root}/damaged.pt"
    shutil.copyfile(f"{root}/host2.pt", damaged)
    with open(damaged, "r+b") as f:  # a byte in the middle of the tensors' data
        f.seek(os.path.getsize(damaged) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    other = files.load_file(f"{root}/host2.pt")
    other["model"]["layers.0.attn.wq.weight"] = other["model"]["layers.0.attn.wq.weight"][:-1]
    files.atomic_save(other, f"{root}/other_model.pt")
    out = {}
    for name, path, kind in (("sharded", f"{root}/host2", "adamw"), ("damaged", damaged, "adamw"),
                             ("other_model", f"{root}/other_model.pt", "adamw"),
                             ("other_rule", f"{root}/host2.pt", "lion")):
        e = _engine(1, "host", kind)
        before = e.full_state_dict()
        try:
            e.load_checkpoint(path)
            message = "accepted"
        except Exception as err:  # any error: the test names what it should have been
            message = f"{type(err).__name__}: {err}"
        out[name] = (message, equal_nested(e.full_state_dict(), before))
        e.teardown()
    return out


@pytest.mark.parametrize("name, words", [
    ("sharded", ["resumes only at the mesh that wrote it", "written with fully_shard over 2 "
                 "processes", "this run has fully_shard over 1 process"]),
    ("damaged", ["damaged.pt", "is damaged", "checksum"]),
    ("other_model", ["'layers.0.attn.wq.weight' has shape (31, 32)", "(32, 32)"]),
    ("other_rule", ["AdamW", "Lion", "resumes only with the update"])])
def test_a_damaged_or_mismatched_checkpoint_is_refused(runs, name: str, words: list[str]) -> None:
    message, unchanged = runs["back"]["refused"][name]
    assert message.startswith("CheckpointError: ") and all(w in message for w in words), message
    assert unchanged


# -- no second copy of the state ------------------------------------------------------------------
def _memory(rank: int, world: int, folder: str) -> dict:
    """A 24M-parameter model ``fully_shard``-ed with its weights on the host (12M per process:
    48 MB of FSDP2's fp32 shards, the master, and 96 MB of moments): each save's and load's
    peak over the memory before it, and the rank's master bytes."""
    from test_checkpoint_memory import BUCKET_MB, LAYERS, WIDTH
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from lightning_zero_offload.core.dist.tensor_parallel import local

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    kw: dict[str, Any] = dict(mesh=init_device_mesh("cpu", (world,)),
                              offload_policy=CPUOffloadPolicy(pin_memory=False))
    for layer in model:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    e = ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
                    precision="32-true", cpu_threads=1, bucket_size_mb=BUCKET_MB,
                    offload_weights=True)
    e.backward(model(torch.randn(4, WIDTH)).square().mean())
    e.step()
    e.zero_grad()
    e.synchronize()
    out = {"master": sum(local(p).numel() * 4 for p in model.parameters()), **_peaks(e, folder)}
    e.teardown()
    return out


def test_save_and_load_hold_no_second_copy(tmp_path) -> None:
    # a bucket (gathered: both ranks' halves), a tensor and the load's conversion buffers
    # over before (about 20 MiB), never a copy of the rank's master (48 MiB: the sharded save
    # joining FSDP2's shards into one tensor peaked 58 MiB)
    from test_checkpoint_memory import BOTH, SLACK, MiB

    for rank, r in enumerate(run_ranks(_memory, 2, str(tmp_path), timeout=400)):
        bound = min(SLACK, r["master"])
        print(f"rank {rank}: master {r['master'] / MiB:.0f} MiB, over before (save, load): "
              + ", ".join(f"{n} {[round(p / MiB, 1) for p in r[n]]}" for n in BOTH))
        for name in BOTH:
            for what, peak in zip(("save", "load"), r[name], strict=True):
                assert peak <= bound, (f"rank {rank}, {name}: the {what} peaked "
                                       f"{peak / MiB:.0f} MiB over before")
