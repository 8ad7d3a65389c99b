"""Trainer(strategy="zero_offload") against the default strategy, checkpoints, and its errors."""

from __future__ import annotations

import csv
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _helpers import (
    Payload,
    SubAdamW,
    buffer_engine,
    dead_pid,
    rel_err,
    same_state,
    snapshot,
    train_buffer_net,
)
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero_offload
from lightning_zero_offload import ZeroOffloadConfig, ZeroOffloadFabricStrategy, ZeroOffloadStrategy
from lightning_zero_offload.core import CheckpointError
from lightning_zero_offload.core.device.profile import FIELDS
from lightning_zero_offload.lightning import ZeroOffloadPrecision
from lightning_zero_offload.lightning import checkpoint as lckpt
from lightning_zero_offload.lightning.checkpoint import consolidate_checkpoint

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*The number of training batches.*")


pytestmark = pytest.mark.usefixtures("isolated_process_group")


def data(n: int = 32, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


class Net(LightningModule):
    def __init__(
        self, lr: float = 5e-2, optimizer: str = "adamw", scheduler: str = "lists"
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.norms: list[float] = []
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        params = self.parameters()
        if self.hparams.optimizer == "rmsprop":
            return torch.optim.RMSprop(params, lr=self.hparams.lr)
        if self.hparams.optimizer == "lion":
            from lion_pytorch import Lion
            return Lion(params, lr=self.hparams.lr / 10, weight_decay=0.01)
        adamw = SubAdamW if self.hparams.optimizer == "adamw_subclass" else torch.optim.AdamW
        optimizer = adamw(params, lr=self.hparams.lr, weight_decay=0.01)
        form = self.hparams.scheduler  # Lightning's return forms
        sched = torch.optim.lr_scheduler
        if form == "none":
            return optimizer
        if form == "lists":
            step_lr = sched.StepLR(optimizer, step_size=2, gamma=0.5)
            return [optimizer], [{"scheduler": step_lr, "interval": "step"}]
        if form == "epoch":
            return [optimizer], [sched.StepLR(optimizer, step_size=1, gamma=0.3)]
        if form == "dict":
            lam = sched.LambdaLR(optimizer, lambda s: 1 / (1 + s))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lam, "interval": "step"}}
        plateau = sched.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        config = {"scheduler": plateau, "monitor": "train_loss", "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": config}


class PlainNormNet(Net):
    """Records the pre-clip global gradient norm the way torch computes it."""

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


class OffloadNormNet(Net):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            self.norms.append(float(self.trainer.strategy.grad_norm))


def trainer(strategy="auto", tmp_path=None, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        use_distributed_sampler=False,  # same batches as the single-device default strategy
    )
    options.update(kwargs)
    return Trainer(strategy=strategy, **options)


def loader(n: int = 32, batch_size: int = 4) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size, shuffle=False)


def fit(model_cls=Net, strategy="auto", tmp_path=None, model_kwargs=None, **kwargs):
    seed_everything(0)
    model = model_cls(**(model_kwargs or {}))
    t = trainer(strategy, tmp_path, **kwargs)
    t.fit(model, loader())
    return model, t


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def assert_close(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = rel_err(a[k], b[k])
        assert err <= rel, f"{k}: relative error {err:.2e}"


def test_registered_in_both_registries_and_idempotent():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_zero_offload.lightning.register()  # a second call is harmless
    assert isinstance(StrategyRegistry.get("zero_offload"), ZeroOffloadStrategy)
    assert isinstance(STRATEGY_REGISTRY.get("zero_offload"), ZeroOffloadFabricStrategy)
    assert isinstance(trainer("zero_offload").strategy, ZeroOffloadStrategy)


def test_matches_default_strategy_fp32(tmp_path):
    ref, ref_trainer = fit(PlainNormNet, "auto", tmp_path / "ref")
    off, off_trainer = fit(OffloadNormNet, "zero_offload", tmp_path / "off")
    assert ref_trainer.global_step == off_trainer.global_step == 6
    assert_close(weights(off), weights(ref))
    assert all(v.dtype == torch.float32 for v in off.state_dict().values())
    # the pre-clip global norm the strategy reports is torch's
    torch.testing.assert_close(torch.tensor(off.norms), torch.tensor(ref.norms), rtol=1e-5, atol=0)
    assert off_trainer.strategy.engine is None  # teardown released the engine
    assert off_trainer.strategy.precision_plugin.engine is None


def test_lr_monitor_and_scheduler_see_live_groups(tmp_path):
    logged, names = {}, {}
    for name, strategy in (("ref", "auto"), ("off", "zero_offload")):
        logger = CSVLogger(tmp_path, name=name)
        fit(
            Net,
            strategy,
            tmp_path,
            logger=logger,
            callbacks=[LearningRateMonitor(logging_interval="step")],
            log_every_n_steps=1,
        )
        with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        keys = [k for k in rows[0] if k.startswith("lr-")]
        assert len(keys) == 1, keys  # one optimizer, not the user's plus the engine's
        names[name] = keys[0]
        logged[name] = [float(r[keys[0]]) for r in rows if r[keys[0]]]
    assert names["off"] == names["ref"] == "lr-AdamW"  # named as without offload
    assert logged["off"] == logged["ref"]
    assert logged["off"][-1] < logged["off"][0]  # the StepLR schedule acted


class ProfiledNet(OffloadNormNet):
    def on_train_start(self):
        self.engine = self.trainer.strategy.engine  # kept past teardown: its step profiles


def test_step_profile_and_grad_norm_are_logged_once_per_step(tmp_path):
    logger = CSVLogger(tmp_path, name="profile")
    model, t = fit(ProfiledNet, "zero_offload", tmp_path, logger=logger, log_every_n_steps=1)
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("zero_offload/cpu_step_ms")]
    assert len(rows) == t.global_step == 6  # once per optimizer step, not per micro-batch
    # each row is its own step's profile as the engine measured it, in milliseconds
    profiles = model.engine.profile
    assert [p.step for p in profiles] == [1, 2, 3, 4, 5, 6]
    for row, prof in zip(rows, profiles, strict=True):
        for k in FIELDS:
            assert float(row[f"zero_offload/{k}_ms"]) == pytest.approx(
                1e3 * getattr(prof, k), rel=1e-6, abs=1e-9), (prof.step, k)
        assert prof.cpu_step > 0 and prof.fwd_bwd > 0
        # device copies only on an asynchronous device (the emulated one under the env seed)
        assert (prof.weight_copy > 0) == bool(os.environ.get("LZO_EMULATED_DEVICE_SEED"))
    # the logged norm is the one the strategy reports (torch's, see the fp32 test)
    assert [float(r["zero_offload/grad_norm"]) for r in rows] == pytest.approx(model.norms)
    assert not any(k.startswith("zero_offload/") for k in t.progress_bar_metrics)


@pytest.mark.parametrize("form", ["epoch", "dict", "plateau"])
def test_scheduler_return_forms_act_on_the_engine(tmp_path, form):
    ref, _ = fit(Net, "auto", tmp_path / "ref", model_kwargs={"scheduler": form})
    off, t = fit(Net, "zero_offload", tmp_path / "off", model_kwargs={"scheduler": form})
    assert_close(weights(off), weights(ref))
    assert t.lr_scheduler_configs[0].scheduler.optimizer is t.optimizers[0]


def test_resume_is_bit_exact(tmp_path):
    kwargs = dict(max_epochs=4, max_steps=-1)
    full, _ = fit(Net, "zero_offload", tmp_path / "a", **kwargs)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    fit(
        Net,
        "zero_offload",
        tmp_path / "b",
        max_epochs=2,
        max_steps=-1,
        enable_checkpointing=True,
        callbacks=[ckpt_cb],
    )
    path = tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    assert path.is_file()
    seed_everything(0)
    resumed = Net()
    trainer("zero_offload", tmp_path / "c", **kwargs).fit(resumed, loader(), ckpt_path=path)
    for k, v in weights(full).items():
        assert torch.equal(weights(resumed)[k], v), k


def test_checkpoint_is_plain_fp32_and_loads_without_strategy(tmp_path):
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    weights_cb = ModelCheckpoint(dirpath=tmp_path, filename="weights-{step}", save_top_k=-1,
                                 every_n_train_steps=3, save_weights_only=True)
    model, _ = fit(
        Net,
        "zero_offload",
        tmp_path,
        enable_checkpointing=True,
        callbacks=[ckpt_cb, weights_cb],
        precision="bf16-mixed",
    )
    path = tmp_path / "epoch=1-step=6.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    state = checkpoint["state_dict"]
    assert all(v.dtype == torch.float32 for v in state.values())
    assert_close(state, weights(model), rel=0)  # the fp32 masters, not bf16 device copies
    (optimizer_state,) = checkpoint["optimizer_states"]
    plain = torch.optim.AdamW(Net().parameters())
    plain.load_state_dict(optimizer_state)  # torch's AdamW format
    assert float(plain.state[plain.param_groups[0]["params"][0]]["step"]) == 6
    loaded = Net.load_from_checkpoint(path)
    assert_close(weights(loaded), state, rel=0)
    weights_only = torch.load(tmp_path / "weights-step=6.ckpt", weights_only=False)
    assert "optimizer_states" not in weights_only
    assert_close(weights_only["state_dict"], state, rel=0)


def test_resume_zero_offload_checkpoint_with_default_strategy(tmp_path):
    """The checkpoint's optimizer state is torch AdamW's: the default strategy resumes from it."""
    kwargs = dict(max_epochs=4, max_steps=-1)
    full, _ = fit(Net, "zero_offload", tmp_path / "a", **kwargs)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    fit(
        Net,
        "zero_offload",
        tmp_path / "b",
        max_epochs=2,
        max_steps=-1,
        enable_checkpointing=True,
        callbacks=[ckpt_cb],
    )
    seed_everything(0)
    resumed = Net()
    trainer("auto", tmp_path / "c", **kwargs).fit(
        resumed, loader(), ckpt_path=tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    )
    assert_close(weights(resumed), weights(full))


def test_sharded_checkpoint_resume_and_consolidate(tmp_path):
    kwargs = dict(max_epochs=4, max_steps=-1)
    full, _ = fit(Net, "zero_offload", tmp_path / "a", **kwargs)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    half, _ = fit(
        Net,
        ZeroOffloadStrategy(sharded_checkpoint=True),
        tmp_path / "b",
        max_epochs=2,
        max_steps=-1,
        enable_checkpointing=True,
        callbacks=[ckpt_cb],
    )
    path = tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    assert path.is_dir() and len(list(path.glob("shard-*"))) == 1
    seed_everything(0)
    resumed = Net()
    trainer(ZeroOffloadStrategy(sharded_checkpoint=True), tmp_path / "c", **kwargs).fit(
        resumed, loader(), ckpt_path=path
    )
    for k, v in weights(full).items():
        assert torch.equal(weights(resumed)[k], v), k
    consolidate_checkpoint(path, tmp_path / "one.ckpt")
    assert_close(weights(Net.load_from_checkpoint(tmp_path / "one.ckpt")), weights(half), rel=0)


def test_validate_test_predict_use_device_weights(tmp_path):
    dtypes = []

    class Probe(Net):
        def validation_step(self, batch, batch_idx):
            dtypes.append(self.net[0].weight.dtype)
            return super().validation_step(batch, batch_idx)

    seed_everything(0)
    model = Probe()
    t = trainer(
        "zero_offload", tmp_path, precision="bf16-mixed", val_check_interval=4, limit_val_batches=2
    )
    t.fit(model, loader(), loader())
    assert dtypes and set(dtypes) == {torch.bfloat16}  # validation ran on the engine's weights
    assert model.net[0].weight.dtype == torch.float32  # teardown gave back fp32 masters
    assert t.validate(model, loader(), verbose=False)[0]["val_loss"] > 0
    assert t.test(model, loader(), verbose=False)[0]["val_loss"] > 0
    predictions = t.predict(model, loader())
    assert len(predictions) == 8 and predictions[0].shape == (4, 4)


def test_bf16_mixed_trains_and_loss_falls(tmp_path):
    model, t = fit(
        Net,
        "zero_offload",
        tmp_path,
        precision="bf16-mixed",
        max_steps=40,
        max_epochs=-1,
        model_kwargs={"scheduler": "none", "lr": 1e-2},
    )
    assert isinstance(t.strategy.precision_plugin, ZeroOffloadPrecision)
    first, last = sum(model.losses[:8]) / 8, sum(model.losses[-8:]) / 8
    assert last < 0.8 * first


def test_manual_optimization_matches_default(tmp_path):
    class Manual(Net):
        def __init__(self):
            super().__init__(scheduler="none")
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()

    results = []
    for strategy in ("auto", "zero_offload"):
        model, _ = fit(
            Manual, strategy, tmp_path, gradient_clip_val=None, accumulate_grad_batches=1
        )
        results.append(weights(model))
    assert_close(results[1], results[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"precision": "64-true"}, ValueError, "does not support precision '64-true'"),
        ({"precision": "bf16-true"}, ValueError, "use 'bf16-mixed'"),
        ({"precision": "16-true"}, ValueError, "choose one of"),
    ],
)
def test_unsupported_precision_fails_at_trainer_creation(kwargs, error, match):
    with pytest.raises(error, match=match):
        trainer("zero_offload", **kwargs)


@pytest.mark.parametrize(
    ("model_kwargs", "trainer_kwargs", "error", "match"),
    [
        ({"optimizer": "rmsprop"}, {}, TypeError, "AdamW"),
        ({}, {"gradient_clip_algorithm": "value"}, ValueError, "gradient_clip_algorithm='norm'"),
    ],
)
def test_unsupported_training_setups_raise(tmp_path, model_kwargs, trainer_kwargs, error, match):
    with pytest.raises(error, match=match):
        fit(Net, "zero_offload", tmp_path, model_kwargs=model_kwargs, **trainer_kwargs)


def test_two_optimizers_raise(tmp_path):
    class Two(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self):
            return [
                torch.optim.AdamW(self.net[0].parameters()),
                torch.optim.AdamW(self.net[2].parameters()),
            ]

    with pytest.raises(ValueError, match="exactly one optimizer"):
        fit(Two, "zero_offload", tmp_path, gradient_clip_val=None, accumulate_grad_batches=1)


def test_strategy_options():
    strategy = ZeroOffloadStrategy(bucket_size_mb=1.0, cpu_threads=1)
    assert strategy.config == ZeroOffloadConfig(bucket_size_mb=1.0, cpu_threads=1)
    with pytest.raises(TypeError, match="unknown option"):
        ZeroOffloadStrategy(bucket_mb=1)
    with pytest.raises(TypeError, match="Trainer"):
        ZeroOffloadStrategy(precision="bf16-mixed")



@pytest.mark.parametrize("explicit", ["bf16-mixed", "16-mixed"])
def test_config_precision_that_disagrees_with_the_trainer_raises(explicit):
    # "bf16-mixed" was the old default, so an explicit one used to be silently overridden
    strategy = ZeroOffloadStrategy(ZeroOffloadConfig(precision=explicit))
    match = rf"precision='{explicit}'\) does not match Trainer\(precision='32-true'\)"
    with pytest.raises(ValueError, match=match):
        trainer(strategy, max_steps=1).fit(Net(), loader())


@pytest.mark.parametrize("config", [ZeroOffloadConfig(), ZeroOffloadConfig(precision="bf16-mixed")])
def test_config_precision_unset_or_equal_takes_the_trainers(tmp_path, config):
    model, _ = fit(ProfiledNet, ZeroOffloadStrategy(config), tmp_path, precision="bf16-mixed",
                   max_steps=1)
    assert model.engine.config.precision == "bf16-mixed"
    assert model.engine.compute_dtype == torch.bfloat16


def test_adamw_subclass_trains_like_the_default_strategy(tmp_path):
    kwargs = {"model_kwargs": {"optimizer": "adamw_subclass"}}
    ref, _ = fit(Net, "auto", tmp_path / "ref", **kwargs)
    off, t = fit(ProfiledNet, "zero_offload", tmp_path / "off", **kwargs)
    assert type(off.engine.optimizer).__name__ == "SubAdamW"
    assert_close(weights(off), weights(ref))


def test_lion_from_configure_optimizers_trains_like_the_default_strategy(tmp_path):
    pytest.importorskip("lion_pytorch")
    kwargs = {"model_kwargs": {"optimizer": "lion"}}
    ref, _ = fit(Net, "auto", tmp_path / "ref", **kwargs)
    off, _ = fit(ProfiledNet, "zero_offload", tmp_path / "off", **kwargs)
    assert type(off.engine.optimizer).__name__ == "Lion"
    assert_close(weights(off), weights(ref))


def test_lightning_cli_class_path(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    argv = [
        "prog",
        "--trainer.strategy=lightning_zero_offload.ZeroOffloadStrategy",
        "--trainer.strategy.sharded_checkpoint=true",
        "--trainer.strategy.config.cpu_threads=1",
        "--trainer.accelerator=cpu",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    cli = LightningCLI(Net, run=False, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroOffloadStrategy)
    assert strategy.sharded_checkpoint and strategy.config.cpu_threads == 1


@pytest.mark.slow
def test_two_processes_match_ddp(tmp_path):
    """2 CPU ranks (gloo), accumulation and clipping: zero_offload (partitioned) ends where DDP
    does, and its sharded checkpoint (one file per rank) consolidates to those weights."""
    results = {}
    for name, strategy in (
        ("ddp", "ddp_spawn"),
        ("off", ZeroOffloadStrategy(start_method="spawn", sharded_checkpoint=True)),
    ):
        ckpt_cb = ModelCheckpoint(dirpath=tmp_path / name, save_top_k=-1, every_n_train_steps=6)
        model, _ = fit(
            Net,
            strategy,
            tmp_path / name,
            devices=2,
            use_distributed_sampler=True,
            enable_checkpointing=True,
            callbacks=[ckpt_cb],
        )
        results[name] = weights(model)  # the spawn launcher copies rank 0's weights back
    assert_close(results["off"], results["ddp"])
    sharded = next((tmp_path / "off").glob("*step=6.ckpt"))
    assert len(list(sharded.glob("shard-*"))) == 2
    consolidate_checkpoint(sharded, tmp_path / "one.ckpt")
    state = torch.load(tmp_path / "one.ckpt", weights_only=False)["state_dict"]
    assert_close(state, results["off"], rel=0)


def test_fp16_loss_scaler_is_checkpointed_and_resumes(tmp_path):
    """fp16 (forced on the CPU through the plugin): the engine's loss scaler travels with the
    optimizer state and a resumed run ends bit-exactly where the uninterrupted one does."""
    plugins = [ZeroOffloadPrecision("16-mixed")]
    kwargs = dict(max_epochs=4, max_steps=-1, precision=None, plugins=plugins)
    full, t = fit(Net, "zero_offload", tmp_path / "a", **kwargs)
    assert isinstance(t.strategy.precision_plugin, ZeroOffloadPrecision)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    fit(
        Net,
        "zero_offload",
        tmp_path / "b",
        enable_checkpointing=True,
        callbacks=[ckpt_cb],
        **{**kwargs, "max_epochs": 2},
    )
    path = tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    (optimizer_state,) = torch.load(path, weights_only=False)["optimizer_states"]
    assert optimizer_state["zero_offload_scaler"]["scale"] == 2.0**16
    seed_everything(0)
    resumed = Net()
    trainer("zero_offload", tmp_path / "c", **kwargs).fit(resumed, loader(), ckpt_path=path)
    for k, v in weights(full).items():
        assert torch.equal(weights(resumed)[k], v), k
    # evaluation straight from the checkpoint (no engine: the fp32 weights on the device)
    result = trainer("zero_offload", tmp_path / "d").validate(
        Net(), loader(), ckpt_path=path, verbose=False
    )
    assert result[0]["val_loss"] > 0


@pytest.mark.parametrize("sharded", [False, True])
def test_save_checkpoint_after_fit_resumes_exactly(tmp_path, sharded):
    """``trainer.save_checkpoint`` once ``fit`` returned (the usual final save with DDP) writes
    the engine's state, and resuming from it equals one uninterrupted run."""
    kwargs = dict(max_epochs=4, max_steps=-1)
    full, _ = fit(Net, "zero_offload", tmp_path / "a", **kwargs)
    seed_everything(0)
    first = Net()
    t = trainer(ZeroOffloadStrategy(sharded_checkpoint=sharded), tmp_path / "b", max_epochs=2,
                max_steps=-1)
    t.fit(first, loader())
    path = tmp_path / "final.ckpt"
    t.save_checkpoint(path)
    assert path.exists()
    seed_everything(0)
    resumed = Net()
    trainer(ZeroOffloadStrategy(sharded_checkpoint=sharded), tmp_path / "c", **kwargs).fit(
        resumed, loader(), ckpt_path=path)
    for k, v in weights(full).items():
        assert torch.equal(weights(resumed)[k], v), k


def test_lightning_cli_takes_config_fields_under_init_args(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    cfg = tmp_path / "cli.yaml"
    cfg.write_text("trainer:\n  accelerator: cpu\n  strategy:\n"
                   "    class_path: lightning_zero_offload.ZeroOffloadStrategy\n"
                   "    init_args:\n      delayed_update: true\n      cpu_threads: 1\n"
                   "      bucket_size_mb: 3.0\n")
    monkeypatch.setattr(sys, "argv", ["prog", f"--config={cfg}"])
    strategy = LightningCLI(Net, run=False, save_config_callback=None).trainer.strategy
    assert isinstance(strategy, ZeroOffloadStrategy)
    c = strategy.config
    assert (c.delayed_update, c.cpu_threads, c.bucket_size_mb) == (True, 1, 3.0)



def test_partial_offload_options_reach_the_engine(tmp_path, monkeypatch):
    assert (ZeroOffloadStrategy().config.offload_fraction,
            ZeroOffloadStrategy().config.device_memory_headroom) == ("auto", 0.2)
    strategy = ZeroOffloadStrategy(offload_fraction=0.5, device_memory_headroom=0.3)
    model, _ = fit(ProfiledNet, strategy, tmp_path, max_steps=1)
    assert (model.engine.config.offload_fraction,
            model.engine.config.device_memory_headroom) == (0.5, 0.3)
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    for fraction, want in (("auto", "auto"), ("0.25", 0.25)):
        cfg = tmp_path / "cli.yaml"
        cfg.write_text("trainer:\n  accelerator: cpu\n  strategy:\n"
                       "    class_path: lightning_zero_offload.ZeroOffloadStrategy\n"
                       f"    init_args:\n      offload_fraction: {fraction}\n"
                       "      device_memory_headroom: 0.1\n")
        monkeypatch.setattr(sys, "argv", ["prog", f"--config={cfg}"])
        c = LightningCLI(Net, run=False, save_config_callback=None).trainer.strategy.config
        assert (c.offload_fraction, c.device_memory_headroom) == (want, 0.1)


@pytest.mark.parametrize("kw, match", [
    ({"offload_fraction": 1.5}, r'offload_fraction must be a number in \[0, 1\] or "auto"'),
    ({"offload_fraction": "all"}, r'offload_fraction must be .* or "auto", got \'all\''),
    ({"device_memory_headroom": 1.0}, r"device_memory_headroom must be a number in \[0, 1\)")])
def test_bad_partial_offload_options_raise_when_the_strategy_is_built(kw, match):
    with pytest.raises(ValueError, match=match + r".*ZeroOffloadStrategy arguments"):
        ZeroOffloadStrategy(**kw)

def test_one_device_keeps_the_default_strategys_data_order(tmp_path):
    """Lightning's distributed sampler is not inserted for one process: a shuffling
    DataLoader gives the same batches, so the same weights, as the default strategy."""
    runs = []
    for strategy in ("auto", "zero_offload"):
        seed_everything(0)
        model = Net()
        t = trainer(strategy, tmp_path / strategy, use_distributed_sampler=True)
        t.fit(model, DataLoader(data(), batch_size=4, shuffle=True))
        runs.append(weights(model))
    assert_close(runs[1], runs[0], rel=1e-6)


class ShardAtEndNet(ProfiledNet):
    def on_train_end(self):
        self.shard = self.trainer.strategy.engine.state_dict()


def test_moment_dtype_kwarg_reaches_the_engine(tmp_path):
    """ZeroOffloadStrategy(moment_dtype="int8"): the engine keeps 8-bit moments, and trains
    close to the default strategy (tracking tolerance of tests/test_moments_engine.py)."""
    ref, _ = fit(Net, "auto", tmp_path / "ref")
    model, _ = fit(ShardAtEndNet, ZeroOffloadStrategy(moment_dtype="int8"), tmp_path / "off")
    assert model.engine.config.moment_dtype == "int8"
    assert model.shard["moment_dtype"] == "int8"
    assert model.shard["groups"][0]["exp_avg"].dtype == torch.uint8
    assert model.shard["groups"][0]["exp_avg_scales"].dtype == torch.float32
    assert_close(weights(model), weights(ref), rel=0.05)


def test_strategy_reports_the_precision_in_use(tmp_path):
    strategy = ZeroOffloadStrategy()
    assert strategy.config.precision is None  # unset: the Trainer's
    _, t = fit(Net, strategy, tmp_path, precision="32-true")
    assert t.strategy.config.precision == "32-true"
    assert t.strategy.finished_engine.config.precision == "32-true"


class FailsOnRankOne(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("training_step failed on rank 1")
        return super().training_step(batch, batch_idx)


FAIL_TIMEOUT, FAIL_MARGIN = 5.0, 25.0  # the strategy's collective_timeout_s; start-up and load


def _fit_with_a_failing_rank(rank: int, world: int, root: str, port: int) -> dict:
    """One process of a torchrun-style launch: Lightning starts the process group (with the
    strategy's timeout, as under torchrun), so the harness's own group goes first."""
    import time

    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    start = time.monotonic()
    try:
        fit(FailsOnRankOne, ZeroOffloadStrategy(collective_timeout_s=FAIL_TIMEOUT),
            f"{root}/{rank}", devices=2)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever each rank raised
        out = {"type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - start}
        if rank == 1:  # stays alive: rank 0 must end by the timeout, not by our exit
            time.sleep(FAIL_TIMEOUT + FAIL_MARGIN + 20)  # longer than rank 0 may take
        return out
    return {"type": None}


@pytest.mark.slow
def test_an_exception_in_training_step_on_one_rank_ends_both_ranks(tmp_path):
    """Lightning's exception handler tears the strategy down; that must start no collective
    (the peer would wait in it) and the peer's own wait ends within the collective timeout."""
    from _dist import free_port, run_ranks

    first, second = run_ranks(_fit_with_a_failing_rank, 2, str(tmp_path), free_port(),
                              timeout=150)
    assert second["error"] == "training_step failed on rank 1", second
    assert second["seconds"] < FAIL_TIMEOUT + FAIL_MARGIN
    assert first["type"] == "CollectiveError", first
    # Lightning's per-batch broadcast waits one timeout (and swallows its error), the engine's
    # next collective another.
    assert first["seconds"] < 2 * FAIL_TIMEOUT + FAIL_MARGIN
    assert "rank 1 failed first" in first["error"] and "training_step failed" in first["error"]


def test_the_process_group_timeout_defaults_to_the_collective_timeout():
    from datetime import timedelta

    assert ZeroOffloadStrategy(collective_timeout_s=7.0)._timeout == timedelta(seconds=7)
    given = timedelta(minutes=3)
    assert ZeroOffloadStrategy(collective_timeout_s=7.0, timeout=given)._timeout == given


# -- sharded checkpoints: crafted meta, a killed publish, the wrong loader ---------------------


def _sharded_lightning_folder(tmp: Path, meta: dict) -> Path:
    """A sharded Lightning checkpoint (shards of the engine plus ``meta.pt``) via the adapter."""
    engine = buffer_engine()
    train_buffer_net(engine)
    folder = tmp / "lightning.ckpt"
    lckpt.save_sharded(engine, meta, folder,
                       SimpleNamespace(is_global_zero=True, async_checkpoint=False))
    return folder


@pytest.mark.parametrize("weights_only", [None, False])
def test_lightning_meta_never_unpickles_code(tmp_path, weights_only):
    folder = _sharded_lightning_folder(tmp_path, {"epoch": 3})
    assert lckpt.load_sharded_meta(folder, weights_only)["epoch"] == 3
    marker = tmp_path / "ran"
    meta = torch.load(folder / lckpt.META, weights_only=True)
    torch.save({**meta, "hyper_parameters": Payload(marker)}, folder / lckpt.META)
    with pytest.raises(CheckpointError, match="meta.pt.*could run code"):
        lckpt.load_sharded_meta(folder, weights_only)
    with pytest.raises(CheckpointError, match="meta.pt.*could run code"):
        lckpt.consolidate_checkpoint(folder, tmp_path / "one.ckpt")
    assert not marker.exists() and not (tmp_path / "one.ckpt").exists()


def test_lightning_resume_falls_back_to_the_folder_a_killed_publish_left(tmp_path):
    folder = _sharded_lightning_folder(tmp_path, {"epoch": 2})
    old = folder.with_name(f".{folder.name}.old-{dead_pid()}-0badcafe-{os.uname().nodename}")
    folder.rename(old)  # where a kill between the two renames of the publish leaves it
    with pytest.warns(UserWarning, match="is missing: a save was killed"):
        meta = lckpt.load_sharded_meta(folder)
    assert meta["epoch"] == 2 and meta[lckpt.SHARDED_KEY] == str(old)
    engine = buffer_engine(seed=4)
    engine.load_checkpoint(meta[lckpt.SHARDED_KEY])
    reference = buffer_engine()
    train_buffer_net(reference)
    assert same_state(snapshot(reference), snapshot(engine))


def test_lightning_load_from_checkpoint_of_a_sharded_folder_says_what_to_do(tmp_path):
    folder = _sharded_lightning_folder(tmp_path, {"epoch": 0})
    with pytest.raises(CheckpointError, match=r"sharded zero_offload checkpoint.*consolidate_"
                                              r"checkpoint\(folder, 'model.ckpt'\)"):
        LightningModule.load_from_checkpoint(folder)
    with pytest.raises(FileNotFoundError):  # other paths reach Lightning's loader unchanged
        LightningModule.load_from_checkpoint(tmp_path / "absent.ckpt")


class _FailsAtStep2(Net):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise ValueError("the user's training_step failed")
        return super().training_step(batch, batch_idx)


def test_a_fit_inside_the_users_except_block_is_not_a_failure(tmp_path, monkeypatch):
    """``trainer.fit`` called while the user handles an error of their own (a retry, a fallback)
    ends as a fit that went well: no failure is reported to the peers (on several ranks that
    would skip gathering the weights back); a fit that fails reports its own error."""
    from lightning_zero_offload.core.dist import collectives

    reported: list[BaseException] = []
    monkeypatch.setattr(collectives, "report_failure", reported.append)
    try:
        raise KeyError("the user's own, handled")
    except KeyError:
        fit(Net, "zero_offload", tmp_path / "ok")
        with pytest.raises(ValueError, match="training_step failed"):
            fit(_FailsAtStep2, "zero_offload", tmp_path / "failed")
    assert reported and {type(e) for e in reported} == {ValueError}  # never the KeyError
    reported.clear()
    strategy = ZeroOffloadStrategy()  # an error whose teardown never came (a logger failed)
    strategy.on_exception(RuntimeError("an earlier run's"))
    fit(Net, strategy, tmp_path / "next")  # does not fail the next fit
    assert reported == []
