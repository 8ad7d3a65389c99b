"""Each adapter hands the engine ``accumulate`` from its framework's accumulation setting.

``ZeroOffloadConfig.accumulate`` decides whether the engine allocates the fp32 gradient at setup
(True), never (False) or at the first backward that accumulates (None); an explicit value in the
user's config wins over the framework's setting.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadConfig

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*The number of training batches.*")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_resolve_accumulate_rule():
    assert ZeroOffloadConfig().resolve_accumulate(1).accumulate is False
    assert ZeroOffloadConfig().resolve_accumulate(2).accumulate is True
    assert ZeroOffloadConfig().resolve_accumulate(None).accumulate is None
    assert ZeroOffloadConfig(accumulate=True).resolve_accumulate(1).accumulate is True
    assert ZeroOffloadConfig(accumulate=False).resolve_accumulate(4).accumulate is False
    with pytest.raises(TypeError, match="accumulate must be True, False or None"):
        ZeroOffloadConfig(accumulate=1)  # type: ignore[arg-type]


# -- Lightning ----------------------------------------------------------------------------------
def _lightning_fit(tmp_path, accumulate_grad_batches: int, callbacks=(), **strategy_kw):
    from lightning.pytorch import LightningModule, Trainer

    from lightning_zero_offload import ZeroOffloadStrategy

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
    t = Trainer(strategy=ZeroOffloadStrategy(**strategy_kw), accelerator="cpu", devices=1,
                max_steps=1, accumulate_grad_batches=accumulate_grad_batches,
                precision="32-true", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tmp_path, callbacks=list(callbacks))
    t.fit(Net(), DataLoader(data, batch_size=2))
    return t.strategy.finished_engine.config.accumulate


@pytest.mark.usefixtures("isolated_process_group")
@pytest.mark.parametrize("n, want", [(1, False), (2, True)])
def test_lightning_accumulate_grad_batches(tmp_path, n, want):
    pytest.importorskip("lightning")
    assert _lightning_fit(tmp_path, n) is want


@pytest.mark.usefixtures("isolated_process_group")
def test_lightning_accumulation_scheduler_and_explicit_config(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    # a scheduler that accumulates from epoch 1 on: the fit accumulates, known at setup
    assert _lightning_fit(tmp_path, 1, [GradientAccumulationScheduler({1: 2})]) is True
    assert _lightning_fit(tmp_path, 1, accumulate=True) is True  # the user's value wins


@pytest.mark.usefixtures("isolated_process_group")
def test_fabric_leaves_accumulate_unsaid():
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero_offload", precision="32-true")
    fabric.launch()
    model = _net()
    fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert fabric.strategy.engine.config.accumulate is None
    fabric.strategy.engine.teardown()


# -- Accelerate ---------------------------------------------------------------------------------
@pytest.fixture
def _accelerate(monkeypatch):
    pytest.importorskip("accelerate")
    from _accelerate_state import reset_accelerate

    for var in [v for v in os.environ if v.startswith("ZERO_OFFLOAD")]:
        monkeypatch.delenv(var)
    reset_accelerate()
    yield
    reset_accelerate()


def _accelerate_engine(steps: int, **plugin_kw):
    from accelerate import Accelerator

    from lightning_zero_offload.accelerate import ZeroOffloadPlugin

    accelerator = Accelerator(gradient_accumulation_steps=steps, mixed_precision="no", cpu=True)
    plugin = ZeroOffloadPlugin(enabled=True, **plugin_kw)
    model = _net()
    plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert plugin.engine is not None
    out = plugin.engine.config.accumulate
    plugin.engine.teardown()
    return out


@pytest.mark.usefixtures("_accelerate")
@pytest.mark.parametrize("n, want", [(1, False), (2, True)])
def test_accelerate_gradient_accumulation_steps(n, want):
    assert _accelerate_engine(n) is want


@pytest.mark.usefixtures("_accelerate")
def test_accelerate_explicit_config_wins(monkeypatch):
    assert _accelerate_engine(1, accumulate=True) is True
    monkeypatch.setenv("ZERO_OFFLOAD_ACCUMULATE", "1")
    assert _accelerate_engine(1) is True


# -- transformers Trainer -----------------------------------------------------------------------
def _trainer_engine(tmp_path, steps: int, **options):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_zero_offload.transformers import (
        ZeroOffloadTrainer,
        ZeroOffloadTrainingArguments,
    )

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    args = ZeroOffloadTrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
        gradient_accumulation_steps=steps, optim="adamw_torch", save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, zero_offload=True,
        zero_offload_config=options or None)
    trainer = ZeroOffloadTrainer(model=LlamaForCausalLM(cfg), args=args)
    trainer.create_optimizer()
    engine = trainer.zero_offload_engine
    assert engine is not None
    out = engine.config.accumulate
    engine.teardown()
    return out


@pytest.mark.usefixtures("_accelerate")
@pytest.mark.parametrize("n, want", [(1, False), (2, True)])
def test_trainer_gradient_accumulation_steps(tmp_path, n, want):
    assert _trainer_engine(tmp_path, n) is want


@pytest.mark.usefixtures("_accelerate")
def test_trainer_explicit_config_wins(tmp_path):
    assert _trainer_engine(tmp_path, 1, accumulate=True) is True
