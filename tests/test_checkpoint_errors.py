"""Checkpoint errors that name what is wrong: a checkpoint of a model with other parameters
(both forms, both ways round, the model unchanged), and saves that cannot go where asked (missing
folders are created; an unwritable place or a read-only folder is named and nothing is left)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _helpers import BufferNet, buffer_engine, snapshot, train_buffer_net
from torch import nn

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.core import CheckpointError


class WiderNet(BufferNet):
    """``BufferNet`` with an extra layer (parameters the plain one lacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra_layer = nn.Linear(8, 8)


def test_both_checkpoint_forms_name_the_parameters_that_differ(tmp_path):
    torch.manual_seed(0)
    net = WiderNet()
    wide = ZeroOffload(net, torch.optim.AdamW(net.parameters(), lr=1e-2), precision="32-true",
                       bucket_size_mb=0.0005, cpu_threads=1)
    wide.save_checkpoint(tmp_path / "ckpt")
    wide.save_checkpoint(tmp_path / "full.pt", sharded=False)
    plain = buffer_engine(seed=3)
    before = snapshot(plain)
    for path in (tmp_path / "ckpt", tmp_path / "full.pt"):
        with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['extra_layer.bias',"
                                                  r" 'extra_layer.weight'\]"):
            plain.load_checkpoint(path)
    # and the other way round: the wider module misses them in a plain checkpoint
    plain.save_checkpoint(tmp_path / "plain")
    plain.save_checkpoint(tmp_path / "plain.pt", sharded=False)
    for path in (tmp_path / "plain", tmp_path / "plain.pt"):
        with pytest.raises(CheckpointError, match=r"missing \['extra_layer.bias', "
                                                  r"'extra_layer.weight'\], unexpected \[\]"):
            wide.load_checkpoint(path)
    assert snapshot(plain)["module"].keys() == before["module"].keys()


# -- 4. where a save cannot go ---------------------------------------------------------------------


def test_both_save_forms_create_missing_folders_and_load_back(tmp_path):
    engine = buffer_engine()
    train_buffer_net(engine)
    want = snapshot(engine)
    for sharded, name in ((True, "ckpt"), (False, "full.pt")):
        path = tmp_path / name / "a" / "b" / name  # its own missing folders, each form
        engine.save_checkpoint(path, sharded=sharded)
        other = buffer_engine(seed=5)
        other.load_checkpoint(path)
        got = snapshot(other)
        assert all(torch.equal(got["module"][k], v) for k, v in want["module"].items())
        assert all(torch.equal(a[k], b[k]) for a, b in zip(got["groups"], want["groups"],
                                                           strict=True)
                   for k in ("master", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("sharded", [True, False])
def test_a_save_to_an_unwritable_place_names_the_users_path(sharded):
    engine = buffer_engine()
    path = Path("/proc/lzo-test/x")
    with pytest.raises(OSError) as info:
        engine.save_checkpoint(path, sharded=sharded)
    message = str(info.value)
    assert f"cannot save the checkpoint to {str(path)!r}" in message
    assert ".tmp-" not in message and "No such file or directory" in message
    assert not Path("/proc/lzo-test").exists()


def test_a_save_into_a_read_only_folder_names_the_users_path_and_leaves_nothing(tmp_path,
                                                                                monkeypatch):
    engine = buffer_engine()
    real_open = open

    def refuse(file, mode="r", *args, **kwargs):  # root ignores chmod: refuse as a RO mount
        if "w" in mode and str(file).startswith(str(tmp_path)):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)
    monkeypatch.setattr("builtins.open", refuse)
    for sharded, name in ((True, "ckpt"), (False, "full.pt")):
        with pytest.raises(PermissionError, match=re.escape(
                f"cannot save the checkpoint to {str(tmp_path / name)!r}: Permission denied")):
            engine.save_checkpoint(tmp_path / name, sharded=sharded)
    assert list(tmp_path.iterdir()) == []
