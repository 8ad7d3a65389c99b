"""Asynchronous saves (``save_checkpoint(..., blocking=False)``, ``async_checkpoint=True``): the
state is copied when the save is called, a thread writes it while training goes on, the file is
what a blocking save at that step writes, and a failure raises on every rank with the previous
checkpoint intact."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _helpers import (
    buffer_engine,
    equal_nested,
    same_state,
    snapshot,
    tiny_engine,
    train,
    train_buffer_net,
)
from _tiny_gpt import batches

from lightning_zero_offload.core import CheckpointError
from lightning_zero_offload.core.checkpoint import files, pending

pytestmark = pytest.mark.usefixtures("isolated_process_group")  # Lightning fits in this process


def _held_writes(monkeypatch) -> threading.Event:
    """The writer thread waits for the returned event before it writes (so training provably
    goes on first)."""
    go = threading.Event()
    real = files.stream.write

    def write(obj, path):
        if threading.current_thread() is not threading.main_thread():
            assert go.wait(60)
        real(obj, path)

    monkeypatch.setattr(files.stream, "write", write)
    return go


def _content(path: Path) -> dict:
    """What every file of a checkpoint holds (its checksum included), as loaded."""
    found = [path] if path.is_file() else sorted(path.iterdir())
    return {p.name: p.read_text() if p.suffix == ".json" else
            torch.load(p, weights_only=True) for p in found}


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("delayed", [False, True])
def test_an_asynchronous_save_is_the_blocking_save_of_its_step_and_resumes_exactly(
        tmp_path, monkeypatch, sharded, delayed):
    data = batches(6)
    ours = tiny_engine(precision="32-true", delayed_update=delayed)
    ref = tiny_engine(precision="32-true", delayed_update=delayed)
    train(ours, data[:3])
    train(ref, data[:3])
    name = "ckpt" if sharded else "ckpt.pt"
    go = _held_writes(monkeypatch)
    handle = ours.save_checkpoint(tmp_path / "async" / name, sharded=sharded, blocking=False)
    assert handle is not None and not handle.done()
    train(ours, data[3:])  # the state changes while the save is held
    go.set()
    handle.wait()
    assert handle.done()
    ref.save_checkpoint(tmp_path / "blocking" / name, sharded=sharded)
    assert equal_nested(_content(tmp_path / "async" / name),
                        _content(tmp_path / "blocking" / name))

    resumed = tiny_engine(precision="32-true", delayed_update=delayed)
    resumed.load_checkpoint(tmp_path / "async" / name)
    train(resumed, data[3:], gather=True)
    ours.gather_weights()
    assert same_state(snapshot(resumed), snapshot(ours))


def test_the_next_step_publishes_and_a_second_save_waits(tmp_path, monkeypatch):
    engine = buffer_engine()
    train_buffer_net(engine)
    go = _held_writes(monkeypatch)
    first = engine.save_checkpoint(tmp_path / "a", blocking=False)
    assert first is not None
    train_buffer_net(engine, 1)
    assert not (tmp_path / "a").exists()  # held: not published
    go.set()
    while not first.done():
        time.sleep(0.01)
    train_buffer_net(engine, 1)  # the step settles it
    assert (tmp_path / "a").is_dir() and engine._state.saves.save is None
    staging = [t.data_ptr() for t in engine._state.saves.staging]
    second = engine.save_checkpoint(tmp_path / "b", blocking=False)
    assert [t.data_ptr() for t in engine._state.saves.staging] == staging  # "a"'s memory reused
    engine.save_checkpoint(tmp_path / "c")  # waits for "b" first
    assert second is not None and second.done() and (tmp_path / "b").is_dir()
    assert equal_nested(_content(tmp_path / "b"), _content(tmp_path / "c"))  # same step
    engine.teardown()
    assert engine._state.saves.staging == []  # the snapshot's memory goes with the engine


def test_a_failed_write_raises_at_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = buffer_engine()
    train_buffer_net(engine)
    engine.save_checkpoint(tmp_path / "full.pt", sharded=False)
    before = (tmp_path / "full.pt").read_bytes()
    train_buffer_net(engine, 1)

    def disk_full(obj, path):
        path.write_bytes(b"PK\x03\x04")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.stream, "write", disk_full)
    handle = engine.save_checkpoint(tmp_path / "full.pt", sharded=False, blocking=False)
    assert handle is not None
    with pytest.raises(OSError, match="No space left.*full.pt|full.pt.*No space left"):
        handle.wait()
    assert (tmp_path / "full.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]


def test_without_room_for_the_copy_the_save_warns_and_blocks(tmp_path, monkeypatch):
    engine = buffer_engine()
    train_buffer_net(engine)

    class Scarce:
        available = 1000

    monkeypatch.setattr(pending.psutil, "virtual_memory", lambda: Scarce)
    with pytest.warns(UserWarning, match=r"not enough host memory .* short"):
        handle = engine.save_checkpoint(tmp_path / "c", blocking=False)
    assert handle is None and (tmp_path / "c").is_dir()  # written before the call returned


def _rank_1_fails(rank: int, world: int, folder: str) -> str:
    torch.manual_seed(0)
    engine = buffer_engine()
    train_buffer_net(engine)
    engine.save_checkpoint(f"{folder}/ckpt")  # the previous checkpoint
    train_buffer_net(engine, 1)
    if rank == 1:
        def disk_full(obj, path):
            raise OSError(28, "No space left on device")

        files.stream.write = disk_full
    handle = engine.save_checkpoint(f"{folder}/ckpt", blocking=False)
    assert handle is not None
    try:
        for _ in range(50):  # the error comes at a step once both ranks' writes ended
            train_buffer_net(engine, 1)
    except (OSError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_on_every_rank_naming_the_file(tmp_path):
    old = buffer_engine(seed=1)
    errors = run_ranks(_rank_1_fails, 2, str(tmp_path))
    assert "ckpt" in errors[0] and "rank(s) [1]" in errors[0], errors
    assert "No space left" in errors[1] and "ckpt" in errors[1], errors
    old.load_checkpoint(tmp_path / "ckpt")  # the previous checkpoint is whole
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


# -- the Lightning and Fabric strategies ----------------------------------------------------------


def _fit_with_model_checkpoint(root: Path, strategy: object) -> Path:
    from lightning.pytorch import seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_lightning_checkpoint_damage import Net, loader, trainer

    seed_everything(0)
    t = trainer(strategy, root, 6)
    t.callbacks.append(ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2,
                                       save_top_k=1, monitor="step", mode="max"))
    t.fit(Net(), loader())
    return root / "ckpts"


@pytest.mark.parametrize("sharded", [False, True])
def test_lightning_async_checkpoint_writes_what_a_blocking_run_writes(tmp_path, monkeypatch,
                                                                       sharded):
    from lightning_zero_offload.lightning import ZeroOffloadStrategy

    started = []
    real = pending.PendingSave.__init__
    monkeypatch.setattr(pending.PendingSave, "__init__",
                        lambda self, *a: started.append(self) or real(self, *a))
    ours = _fit_with_model_checkpoint(
        tmp_path / "async", ZeroOffloadStrategy(async_checkpoint=True, sharded_checkpoint=sharded))
    assert len(started) == 3  # every save (steps 2, 4, 6) was asynchronous
    ref = _fit_with_model_checkpoint(
        tmp_path / "blocking", ZeroOffloadStrategy(sharded_checkpoint=sharded))
    assert len(started) == 3
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in ref.iterdir()) == ["epoch=0-step=6.ckpt"]  # older gone
    got, want = _content(ours / names[0]), _content(ref / names[0])
    for c in (got, want):
        for v in c.values():
            if isinstance(v, dict) and files.CHECKSUM_KEY in v:
                assert v.pop(files.CHECKSUM_KEY) == files.checksum(v)  # written with its data
                v.pop("callbacks", None)  # ModelCheckpoint's state names the folder it ran in
    assert equal_nested(got, want)


def test_lightning_async_checkpoint_io_is_refused(tmp_path):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from test_lightning_checkpoint_damage import Net, loader, trainer

    t = trainer("zero_offload", tmp_path, 2)
    t.strategy.checkpoint_io = AsyncCheckpointIO()
    with pytest.raises(ValueError, match=r"AsyncCheckpointIO.*async_checkpoint=True"):
        t.fit(Net(), loader())


@pytest.mark.parametrize("sharded", [False, True])
def test_the_snapshot_kept_for_the_next_save_counts_in_host_bytes(tmp_path, sharded):
    """The copy an asynchronous save writes from is kept for the next one: ``host_bytes``
    counts it once it exists, as the bytes of every tensor the checkpoint holds."""
    from lightning_zero_offload.core.checkpoint.crc import tensors

    engine = tiny_engine(precision="32-true")
    train(engine, batches(2))
    before = engine.host_bytes
    assert "save_snapshot" not in engine.host_budget
    engine.save_checkpoint(tmp_path / "ck", sharded=sharded, blocking=False).wait()
    files_ = sorted((tmp_path / "ck").glob("shard-*")) if sharded else [tmp_path / "ck"]
    saved = sum(t.nbytes for f in files_ for t in tensors(torch.load(f, weights_only=True)))
    assert engine.host_budget["save_snapshot"] == saved > 0
    assert engine.host_bytes == before + saved
    engine.teardown()
