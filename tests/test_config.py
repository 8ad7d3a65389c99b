"""ZeroOffloadConfig: bad values are refused naming the field, good ones kept as given."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero_offload import ZeroOffloadConfig


@pytest.mark.parametrize("field, value, error, message", [
    ("delayed_update", "no", TypeError, "delayed_update must be True or False, got 'no' (str)"),
    ("delayed_update", 1, TypeError, "delayed_update must be True or False, got 1 (int)"),
    ("check_host_memory", "false", TypeError, "check_host_memory must be True or False"),
    ("pin_memory", "false", TypeError, "pin_memory must be True, False or None, got 'false'"),
    ("bucket_size_mb", math.inf, ValueError, "bucket_size_mb must be > 0 and finite"),
    ("bucket_size_mb", math.nan, ValueError, "bucket_size_mb must be > 0 and finite"),
    ("bucket_size_mb", "25", TypeError, "bucket_size_mb must be a number, got '25' (str)"),
    ("bucket_size_mb", True, TypeError, "bucket_size_mb must be a number, got True (bool)"),
    ("max_grad_norm", True, TypeError, "max_grad_norm must be a number or None, got True"),
    ("max_grad_norm", math.nan, ValueError, "max_grad_norm must be a positive number or None"),
    ("cpu_threads", True, TypeError, "cpu_threads must be an int or None, got True (bool)"),
    ("cpu_threads", 2.0, TypeError, "cpu_threads must be an int or None, got 2.0 (float)"),
    ("delayed_update_warmup", True, TypeError, "delayed_update_warmup must be an int, got True"),
    ("delayed_update_warmup", 1.5, TypeError, "delayed_update_warmup must be an int, got 1.5"),
    ("loss_scale_growth_interval", 2.5, TypeError, "loss_scale_growth_interval must be an int"),
    ("initial_loss_scale", math.inf, ValueError, "initial_loss_scale must be a finite number"),
    ("collective_timeout_s", 0, ValueError, "collective_timeout_s must be a finite number of "
                                            "seconds > 0, got 0"),
    ("collective_timeout_s", math.inf, ValueError, "collective_timeout_s must be a finite"),
    ("collective_timeout_s", "300", TypeError, "collective_timeout_s must be a number, got '300'"),
    ("collective_timeout_s", False, TypeError, "collective_timeout_s must be a number, got False"),
])
def test_config_rejects_bad_values(field, value, error, message):
    with pytest.raises(error, match="ZeroOffloadConfig: " + _literal(message)):
        ZeroOffloadConfig(**{field: value})


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_config_accepts_good_values_unchanged():
    config = ZeroOffloadConfig(delayed_update=True, check_host_memory=False, pin_memory=None,
                               bucket_size_mb=1, max_grad_norm=1, cpu_threads=2,
                               collective_timeout_s=30)
    assert (config.bucket_size_mb, config.max_grad_norm, config.collective_timeout_s) == (1, 1, 30)
    assert ZeroOffloadConfig().collective_timeout_s == 300.0


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "0.5", "half"])
def test_a_config_field_changed_after_construction_is_checked_when_the_engine_is_built(bad):
    from lightning_zero_offload import ZeroOffload

    model = torch.nn.Linear(4, 4)
    cfg = ZeroOffloadConfig(precision="32-true")
    cfg.offload_fraction = bad  # a dataclass field: nothing checks it at assignment
    with pytest.raises(ValueError, match=r"offload_fraction must be a number in \[0, 1\]"):
        ZeroOffload(model, torch.optim.AdamW(model.parameters()), cfg)


def test_each_front_end_checks_its_options_where_they_are_given_and_names_itself(
        monkeypatch, tmp_path):
    from lightning_zero_offload.accelerate import ZeroOffloadPlugin
    from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy
    from lightning_zero_offload.transformers import ZeroOffloadTrainingArguments

    with pytest.raises(ValueError, match=r"from the ZeroOffloadFabricStrategy arguments"):
        ZeroOffloadFabricStrategy(offload_fraction=1.5)
    monkeypatch.setenv("ZERO_OFFLOAD_OFFLOAD_FRACTION", "abc")
    with pytest.raises(ValueError, match=r"got 'abc' .*ZERO_OFFLOAD_OFFLOAD_FRACTION"):
        ZeroOffloadPlugin()  # not only at prepare()
    monkeypatch.delenv("ZERO_OFFLOAD_OFFLOAD_FRACTION")
    with pytest.raises(ValueError, match=r"ZeroOffloadTrainingArguments\(zero_offload_config"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path),
                                     zero_offload_config={"offload_fraction": 1.5})
