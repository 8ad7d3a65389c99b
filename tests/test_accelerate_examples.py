"""examples/accelerate_finetune.py runs at a tiny size and its loss falls (1 and 2 processes)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "accelerate_finetune.py"


@pytest.fixture()
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(Path(json.__file__).read_text(encoding="utf-8")[:12000], encoding="utf-8")
    return path


def _load_recipe():
    spec = importlib.util.spec_from_file_location("accelerate_finetune", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def test_finetune_recipe_one_process(text_file, tmp_path, monkeypatch, capsys):
    from _accelerate_state import reset_accelerate

    for var in [v for v in os.environ if v.startswith("ZERO_OFFLOAD")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("ZERO_OFFLOAD", "1")
    reset_accelerate()
    recipe_mod = _load_recipe()
    cfg = recipe_mod.parse_args(["--tiny-random-llama", "--data", str(text_file),
                                 "--max-steps", "24", "--lr", "3e-3", "--seq-len", "64",
                                 "--output-dir", str(tmp_path / "out")])
    recipe = recipe_mod.FinetuneRecipe(cfg)
    recipe.setup()
    assert recipe.plugin.engine is not None
    losses = recipe.train()
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    assert "ZeRO-Offload profile, median of 24 steps (steps 1-24)" in capsys.readouterr().out
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / "model.safetensors")
    master = recipe.plugin.engine.full_state_dict()["model"]
    assert all(torch.equal(v, master[k]) for k, v in saved.items())
    reset_accelerate()


@pytest.mark.slow
def test_finetune_recipe_two_processes_torchrun(text_file):
    from _dist import torchrun

    run = torchrun(RECIPE, "--tiny-random-llama", "--data", str(text_file), "--max-steps", "16",
                   "--lr", "3e-3", "--seq-len", "64", "--batch-size", "2", "--log-every", "1",
                   ZERO_OFFLOAD="1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ZeRO-Offload: on, processes: 2" in run.stdout, run.stdout
    assert run.stdout.count("ZeRO-Offload profile, median of 16 steps") == 1, run.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 16
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
