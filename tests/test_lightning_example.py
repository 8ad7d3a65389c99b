"""examples/lightning_gpt.py: a tiny run prints the offload summary; bad flag values are argparse
errors naming the flag (what ``tasks.py train --steps 0`` passes through); the peer flags
(``--no-zero-offload --optimizer ...``) train with the optimizer they name and no engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "lightning_gpt.py"


def _run(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_OFFLOAD")}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", **env_vars)
    return subprocess.run([sys.executable, str(RECIPE), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("flag,value,message", [
    ("--steps", "0", "argument --steps: must be >= 1, got 0"),
    ("--devices", "0", "argument --devices: must be >= 1, got 0"),
    ("--batch-size", "-2", "argument --batch-size: must be >= 1, got -2"),
    ("--seq-len", "1", "argument --seq-len: must be >= 2, got 1"),
    ("--accumulate", "x", "argument --accumulate: expected an integer, got 'x'"),
    ("--lr", "0", "argument --lr: must be > 0, got 0.0"),
])
def test_bad_flag_values_name_the_flag(flag, value, message):
    proc = _run(flag, value)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_tiny_run_prints_the_offload_summary():
    proc = _run("--steps", "4", "--batch-size", "2", "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-Offload profile, median of 4 steps (steps 1-4):" in proc.stdout, proc.stdout
    assert "CPU step" in proc.stdout and "main-thread step time" in proc.stdout


def test_moment_dtype_flag_reaches_the_strategy_and_losses_are_written(tmp_path):
    csv = tmp_path / "loss.csv"
    proc = _run("--steps", "3", "--batch-size", "2", "--seq-len", "32", "--moment-dtype", "int8",
                "--loss-csv", str(csv))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "int8 moments" in proc.stdout, proc.stdout
    rows = csv.read_text().splitlines()
    assert rows[0] == "step,loss,step_s" and len(rows) == 4
    assert all(0 < float(r.split(",")[1]) < 10 for r in rows[1:])


@pytest.mark.parametrize("flags,message", [
    (["--optimizer", "torchao-adamw8bit"],
     "argument --optimizer: torchao-adamw8bit runs without the engine"),
    (["--no-zero-offload", "--moment-dtype", "int8"],
     "argument --moment-dtype: int8 moments need the engine; drop --no-zero-offload"),
])
def test_peer_flags_that_cannot_combine_are_argparse_errors(flags, message):
    proc = _run(*flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("optimizer,printed", [
    ("adamw", "AdamW (no engine, SingleDeviceStrategy)"),
    ("torchao-adamw8bit", "AdamW8bit (no engine, SingleDeviceStrategy)"),
])
def test_peer_runs_train_without_the_engine(tmp_path, optimizer, printed):
    if optimizer == "torchao-adamw8bit":
        pytest.importorskip("torchao.optim")
    csv = tmp_path / "loss.csv"
    # TORCHDYNAMO_DISABLE: torchao compiles its step (a minute on 2 cores); eager runs the same
    # math, and this test is about which optimizer the flags build
    proc = _run("--steps", "3", "--batch-size", "2", "--seq-len", "32", "--no-zero-offload",
                "--optimizer", optimizer, "--loss-csv", str(csv), TORCHDYNAMO_DISABLE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert printed in proc.stdout and "ZeRO-Offload profile" not in proc.stdout, proc.stdout
    rows = [r.split(",") for r in csv.read_text().splitlines()]
    assert rows[0] == ["step", "loss", "step_s"] and len(rows) == 4
    assert all(0 < float(loss) < 10 and float(t) > 0 for _, loss, t in rows[1:])


def test_offload_fraction_and_bucket_size_flags_reach_the_strategy_and_help_shows_defaults():
    """``--bucket-size-mb`` splits the tiny model (one 25 MiB bucket: 0.5 would run at 1.0, the
    nearer of its two splits) into buckets whose nearest split is near 0.5; two steps print a
    throughput (no step after the warm-up: measured over both) and "2 steps"."""
    import re

    proc = _run("--steps", "2", "--batch-size", "2", "--seq-len", "32", "--offload-fraction",
                "0.5", "--bucket-size-mb", "0.25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"offload fraction (\d\.\d{3})", proc.stdout)
    assert m and abs(float(m.group(1)) - 0.5) < 0.1, proc.stdout
    assert re.search(r", 2 steps, .*\nthroughput: [\d,]+ tokens/s \(all ranks, over 2 batches, "
                     "warm-up included", proc.stdout), proc.stdout
    shown = _run("--help")
    assert "(default: auto)" in shown.stdout and "(default: 60)" in shown.stdout, shown.stdout
    assert "--bucket-size-mb" in shown.stdout and "(default: 25.0)" in shown.stdout
    bad = _run("--offload-fraction", "1.5")
    assert bad.returncode == 2 and "must be in [0, 1] or auto, got 1.5" in bad.stderr


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_throughput_is_measured_however_few_the_steps(steps, monkeypatch):
    """After a 3-step warm-up where there are steps after it, else over every batch from the
    first one's start: never nan, and "1 step" in the singular."""
    import math
    from types import SimpleNamespace

    sys.path.insert(0, str(RECIPE.parent))
    job = pytest.importorskip("lightning_gpt_job")
    clock = iter(range(100))
    monkeypatch.setattr(job.time, "perf_counter", lambda: float(next(clock)))
    meter, trainer = job.Throughput(tokens_per_batch=10), SimpleNamespace(global_step=0)
    for i in range(steps):
        meter.on_train_batch_start(trainer, None, None, i)
        trainer.global_step += 1
        meter.on_train_batch_end(trainer, None, None, None, i)
    rate = meter.tokens_per_second()
    assert math.isfinite(rate) and rate > 0
    assert meter.measured() == ("1 batch after a 3-step warm-up" if steps == 4 else
                                f"{job._count(steps, 'batch', 'batches')}, warm-up included: "
                                "with more than 3 steps it is left out")
    assert job._count(1, "step") == "1 step" and job._count(2, "step") == "2 steps"


def test_help_and_bad_flags_answer_without_importing_torch():
    """``--help`` and an argparse error come from the command line alone: the job (torch,
    Lightning, transformers) is imported only once the flags parsed."""
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{str(RECIPE)!r}] + sys.argv[1:]\n"
        "try:\n"
        f"    runpy.run_path({str(RECIPE)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules)\n"
        "print('exit', code, 'imported', heavy)\n"
    )
    for args, code in ((["--help"], 0), (["--steps", "0"], 2)):
        proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert f"exit {code} imported []" in proc.stdout, (args, proc.stdout, proc.stderr)
