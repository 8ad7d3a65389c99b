"""examples/lightning_tp.py's command line: ``--help`` shows the whole description, the run is
one epoch of exactly ``--max-steps`` batches on every data-parallel replica (with ``max_steps``
alone Lightning's ``max_epochs`` is -1 and the progress bar read "Epoch 0/-2"); and the README's
example runs write under ignored folders."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "lightning_tp.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("lightning_tp_recipe", RECIPE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_shows_the_whole_description():
    proc = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "share of its local shards' fp32 master and Adam state on the host." in proc.stdout
    assert "--devices 8 --tensor-parallel-size 4 --precision bf16-mixed" in proc.stdout
    assert "--max-steps MAX_STEPS" in proc.stdout and "(default: 20)" in proc.stdout


@pytest.mark.parametrize("devices,tp,steps,batch", [(4, 2, 20, 8), (8, 4, 3, 2), (2, 2, 5, 1)])
def test_one_epoch_holds_exactly_the_steps(monkeypatch, devices, tp, steps, batch):
    recipe = _recipe()
    made: dict = {}

    class Trainer:
        is_global_zero = False

        def __init__(self, **kw) -> None:
            made["kw"] = kw

        def fit(self, model, loader) -> None:
            made["loader"] = loader

    monkeypatch.setattr(recipe, "Trainer", Trainer)
    recipe.main(["--devices", str(devices), "--tensor-parallel-size", str(tp),
                 "--max-steps", str(steps), "--batch-size", str(batch)])
    assert made["kw"]["max_epochs"] == 1 and made["kw"]["max_steps"] == steps
    replicas = devices // tp  # each replica's sampler takes 1/replicas of the samples
    assert len(made["loader"].dataset) == steps * batch * replicas
    assert made["loader"].dataset[len(made["loader"].dataset) - 1].shape == (65,)


def test_a_tensor_parallel_size_that_does_not_divide_the_devices_is_refused():
    recipe = _recipe()
    with pytest.raises(SystemExit) as e:
        recipe.parse_args(["--devices", "4", "--tensor-parallel-size", "3"])
    assert e.value.code == 2


@pytest.mark.parametrize("written", ["out/sft/adapter_model.safetensors", "benchmarks/out/x.csv"])
def test_the_readme_example_outputs_are_ignored(written):
    """The README's TRL example writes ``--output-dir out/sft``: git does not list it."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", written], cwd=ROOT, timeout=60)
    assert proc.returncode == 0, f"{written} would show as untracked"
