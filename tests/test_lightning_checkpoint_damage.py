"""The strategies' single-file checkpoints carry the engine's checksum: a damaged, truncated or
foreign file is refused with an error naming it; a good one is still plain Lightning/PyTorch."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")
from lightning_zero_offload.core import CheckpointError
from lightning_zero_offload.core.checkpoint import files
from lightning_zero_offload.lightning import ZeroOffloadStrategy, consolidate_checkpoint

warnings.filterwarnings("ignore", ".*does not have many workers.*")

pytestmark = pytest.mark.usefixtures("isolated_process_group")
WEIGHT = "net.0.weight"


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def trainer(strategy: object, root: Path, steps: int) -> Trainer:
    return Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=root)


def save(tmp_path: Path, strategy: object = "zero_offload") -> tuple[Path, Net]:
    """A checkpoint after 4 steps, and the model that wrote it."""
    seed_everything(0)
    model = Net()
    t = trainer(strategy, tmp_path, 4)
    t.fit(model, loader())
    path = tmp_path / "model.ckpt"
    t.save_checkpoint(path)
    return path, model


def resume(path: Path, tmp_path: Path) -> Net:
    model = Net()
    trainer("zero_offload", tmp_path / "resumed", 6).fit(model, loader(), ckpt_path=path)
    return model


def flip_inside_weight(path: Path) -> None:
    """Flip 8 bytes in the middle of a weight's data (the zip stores tensors uncompressed)."""
    weight = torch.load(path, weights_only=True)["state_dict"][WEIGHT]
    data = bytearray(path.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at >= 0 and data.find(weight.numpy().tobytes(), at + 1) < 0
    middle = at + weight.numel() * weight.element_size() // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def test_good_checkpoint_is_plain_and_resumes(tmp_path):
    path, model = save(tmp_path)
    raw = torch.load(path, weights_only=True)  # plain PyTorch, weights only
    assert raw[files.CHECKSUM_KEY].startswith("crc32:")
    loaded = Net.load_from_checkpoint(path)  # plain Lightning, no strategy
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed = resume(path, tmp_path)
    assert not [w for w in record if "checksum" in str(w.message)]  # it was checked
    assert not torch.equal(resumed.state_dict()[WEIGHT], model.state_dict()[WEIGHT])  # trained on
    assert torch.isfinite(resumed.state_dict()[WEIGHT]).all()


def test_flipped_bytes_in_a_weight_are_refused(tmp_path):
    path, _ = save(tmp_path)
    flip_inside_weight(path)
    with pytest.raises(CheckpointError, match="is damaged") as info:
        resume(path, tmp_path)
    assert str(path) in str(info.value) and "another checkpoint" in str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_file_is_refused_without_unsafe_advice(tmp_path, damage):
    path, _ = save(tmp_path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(len(data)),
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="cannot be read") as info:
        resume(path, tmp_path)
    message = str(info.value)
    assert str(path) in message and "another checkpoint" in message
    assert "weights_only" not in message and info.value.__cause__ is None


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(Net().state_dict(), path)  # a plain state dict, not a Lightning checkpoint
    with pytest.raises(CheckpointError, match="no 'state_dict' entry") as info:
        resume(path, tmp_path)
    assert str(path) in str(info.value)
    torch.save([torch.zeros(3)], path)
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        resume(path, tmp_path)


def test_checkpoint_of_another_strategy_resumes_with_a_warning(tmp_path):
    path, model = save(tmp_path, strategy="auto")  # plain Lightning: no checksum
    with pytest.warns(UserWarning, match="no zero_offload checksum") as record:
        resume(path, tmp_path)
    assert any(str(path) in str(w.message) for w in record)


def test_consolidated_file_carries_the_checksum(tmp_path):
    folder, _ = save(tmp_path, ZeroOffloadStrategy(sharded_checkpoint=True))
    path = tmp_path / "consolidated.ckpt"
    consolidate_checkpoint(folder, path)
    assert files.CHECKSUM_KEY in torch.load(path, weights_only=True)
    flip_inside_weight(path)
    with pytest.raises(CheckpointError, match="is damaged"):
        resume(path, tmp_path)


def fabric_state() -> tuple[Fabric, dict]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero_offload")
    fabric.launch()
    seed_everything(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    return fabric, {"model": model, "optimizer": optimizer}


def test_fabric_checkpoint_is_checked(tmp_path):
    fabric, state = fabric_state()
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, state)
    saved = torch.load(path, weights_only=True)
    assert files.CHECKSUM_KEY in saved
    assert fabric.load(path, state) == {}  # the checksum is verified and removed
    data = bytearray(path.read_bytes())
    weight = saved["model"]["0.weight"].numpy().tobytes()
    at = data.find(weight) + len(weight) // 2
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged"):
        fabric.load(path, state)
    fabric.strategy.teardown()


def test_fabric_load_without_the_offloaded_objects_is_checked_too(tmp_path):
    """``fabric.load(path)`` (or a dict of other state only) reads the same file: its checksum
    is verified and removed, so a damaged file is refused and the returned dict is the user's."""
    fabric, state = fabric_state()
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {**state, "step": 7})
    whole = fabric.load(path)
    assert files.CHECKSUM_KEY not in whole and whole["step"] == 7
    assert torch.equal(whole["model"]["0.weight"], state["model"].module[0].weight)
    counters = {"step": 0}
    assert set(fabric.load(path, counters)) == {"model", "optimizer"} and counters["step"] == 7
    data = bytearray(path.read_bytes())
    weight = whole["model"]["0.weight"].numpy().tobytes()
    at = data.find(weight) + len(weight) // 2
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))
    for target in (None, {"step": 0}):
        with pytest.raises(CheckpointError, match="is damaged"):
            fabric.load(path, target)
    fabric.save(tmp_path / "counters.ckpt", {"step": 3})  # the user's own state: no checksum
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fabric.load(tmp_path / "counters.ckpt") == {"step": 3}
    assert not [w for w in seen if "checksum" in str(w.message)], [str(w.message) for w in seen]
    fabric.strategy.teardown()


@pytest.mark.parametrize("error", [ConnectionError("remote store unreachable"),
                                   MemoryError("host out of memory"),
                                   OSError(5, "Input/output error")])
def test_a_failure_that_is_not_the_files_surfaces_as_itself(tmp_path, error):
    """A good checkpoint is not called damaged when reading it fails for another reason (a
    remote store, memory, a disk error): the error is the loader's own."""
    from lightning_zero_offload.lightning.checkpoint import load_single

    def load():
        raise error

    with pytest.raises(type(error)) as info:
        load_single(tmp_path / "x.ckpt", load, ())
    assert info.value is error
