"""A tiny initial fp16 loss scale: below the scaler's floor it is refused at configuration, naming
the floor and the way out; the floor itself is accepted and steps to finite weights."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers import tiny_engine
from _tiny_gpt import batches, lm_loss

from lightning_zero_offload import ZeroOffloadConfig
from lightning_zero_offload.core.step.scaler import MIN_SCALE


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
