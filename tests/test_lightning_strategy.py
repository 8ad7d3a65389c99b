"""The Trainer strategy's surface: ``strategy.grad_norm`` after fit is the last step's, and two
optimizers are refused saying why and what to do instead."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn


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
                                         r"optimizer's state .* fused update .*strategy=\"auto\""
                                         r".*one optimizer with a parameter group for each"):
        _fit(_Net.make(two=True), tmp_path)
