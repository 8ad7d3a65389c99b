"""The edges of issue 21: tiny fp16 loss scales, zero_grad(set_to_none=False), checkpoint
mismatch and save-path errors, strategy.grad_norm after fit, the two-optimizer message."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _helpers import BufferNet, buffer_engine, rel_err, snapshot, tiny_engine, train_buffer_net
from _tiny_gpt import batches, lm_loss, make, param_groups
from torch import nn

from lightning_zero_offload import ZeroOffload, ZeroOffloadConfig
from lightning_zero_offload.core import CheckpointError
from lightning_zero_offload.core.scaler import MIN_SCALE

# -- 1. a tiny initial fp16 loss scale ------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-40, 1e-30, 2.0**-25])
def test_a_loss_scale_below_the_scalers_floor_is_refused_at_configuration(scale):
    want = re.escape(f"initial_loss_scale={scale!r} is below the loss scaler's floor")
    with pytest.raises(ValueError, match=want + r".*2\*\*16.*bf16-mixed"):
        ZeroOffloadConfig(precision="16-mixed", initial_loss_scale=scale)
    with pytest.raises(ValueError, match=want):  # the engine's keyword form, before any setup
        tiny_engine(precision="16-mixed", initial_loss_scale=scale)


def test_the_scalers_floor_itself_is_accepted_and_steps_finite():
    engine = tiny_engine(precision="16-mixed", initial_loss_scale=MIN_SCALE * 2**20)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x), y))
    norm = engine.step()
    assert norm is not None and norm.item() > 0 and not engine.last_step_skipped
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    assert ZeroOffloadConfig(initial_loss_scale=MIN_SCALE).initial_loss_scale == MIN_SCALE


# -- 2. zero_grad(set_to_none=False) --------------------------------------------------------------
# (backward?, how to zero after the step): no backward steps on the kept zero gradients; None
# after set_to_none=True, so the next step without backward is skipped by both.
PLAN = [(True, "optimizer"), (False, "engine"), (True, "module"), (False, "none"),
        (False, "engine"), (True, "none"), (False, "engine"), (True, "engine")]


def _zero(engine: ZeroOffload, how: str) -> None:
    if how == "optimizer":
        engine.optimizer.zero_grad(set_to_none=False)
    elif how == "engine":
        engine.zero_grad(set_to_none=False)
    elif how == "module":
        engine.module.zero_grad(set_to_none=False)
    else:
        engine.zero_grad(set_to_none=True)


def _reference(step_on_zero_grads: bool = True) -> nn.Module:
    """torch.optim.AdamW through PLAN on the whole batches (fp32); ``step_on_zero_grads=False``
    skips the steps without backward (what the engine wrongly did before)."""
    model = make(0)
    opt = torch.optim.AdamW(param_groups(model, lr=1e-2), lr=1e-2, weight_decay=0.1)
    for (x, y), (back, how) in zip(batches(len(PLAN)), PLAN, strict=True):
        if back:
            lm_loss(model(x), y).backward()
        if back or step_on_zero_grads:
            opt.step()
        opt.zero_grad(set_to_none=how == "none" or not step_on_zero_grads)
    return model


def _engine_plan(rank: int, world: int) -> list[torch.Tensor]:
    engine = tiny_engine(0, precision="32-true")
    for (x, y), (back, how) in zip(batches(len(PLAN)), PLAN, strict=True):
        if back:
            per = x.shape[0] // world
            part = slice(rank * per, (rank + 1) * per)
            engine.backward(lm_loss(engine.module(x[part]), y[part]))
        engine.step()
        _zero(engine, how)
    engine.gather_weights()
    return [p.detach().float().clone() for p in engine.module.parameters()]


def test_zero_grad_set_to_none_false_then_step_equals_torch_one_rank():
    want = _reference()
    assert rel_err(_engine_plan(0, 1), want) <= 1e-5
    # the test can fail: skipping the zero-gradient steps differs
    assert rel_err(_reference(step_on_zero_grads=False), want) > 1e-3


@pytest.mark.slow
def test_zero_grad_set_to_none_false_then_step_equals_torch_two_ranks():
    want = _reference()
    for got in run_ranks(_engine_plan, 2):
        assert rel_err(got, want) <= 1e-5


def test_zero_grad_set_to_none_false_before_any_backward_steps_nothing():
    engine = tiny_engine(0, precision="32-true")
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.zero_grad(set_to_none=False)
    assert engine.step() is None and engine.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


# -- 3. a sharded checkpoint of a model with more parameters ---------------------------------------


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


# -- 5./6. Lightning: grad_norm after fit, the two-optimizer message -------------------------------


class _Net:
    @staticmethod
    def make(two: bool = False):
        from lightning.pytorch import LightningModule

        class Net(LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
                self.norms: list[float | None] = []
                self.automatic_optimization = not two

            def training_step(self, batch, batch_idx):
                x, y = batch
                return nn.functional.mse_loss(self.net(x).float(), y)

            def on_train_batch_end(self, outputs, batch, batch_idx):
                engine = self.trainer.strategy.engine
                self.norms.append(engine.last_grad_norm)

            def configure_optimizers(self):
                if two:
                    return [torch.optim.AdamW(self.net[0].parameters()),
                            torch.optim.AdamW(self.net[2].parameters())]
                return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return Net()


def _fit(model, tmp_path):
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
    trainer = Trainer(strategy="zero_offload", accelerator="cpu", devices=1, max_steps=3,
                      precision="32-true", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return trainer


@pytest.mark.usefixtures("isolated_process_group")
def test_strategy_grad_norm_after_fit_is_the_last_steps(tmp_path):
    model = _Net.make()
    trainer = _fit(model, tmp_path)
    last = model.norms[-1]
    assert last is not None and math.isfinite(last) and last > 0
    assert trainer.strategy.grad_norm is not None
    assert float(trainer.strategy.grad_norm) == pytest.approx(last, rel=1e-6)


@pytest.mark.usefixtures("isolated_process_group")
def test_two_optimizers_are_refused_saying_why_and_the_way_out(tmp_path):
    with pytest.raises(ValueError, match=r"exactly one optimizer .* got 2: one engine keeps one "
                                         r"optimizer's state .* fused AdamW .*strategy=\"auto\""
                                         r".*one AdamW with a parameter group for each"):
        _fit(_Net.make(two=True), tmp_path)
