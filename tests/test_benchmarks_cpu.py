"""The benchmark scripts run end to end on the CPU (smoke sizes), so they work when a GPU comes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero_offload.core.profile import ProfileRecorder

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_timeline_draws_recorded_profiles(tmp_path: Path) -> None:
    files = []
    for mode in ("plain", "delayed"):
        rec = ProfileRecorder()
        for step in range(1, 4):
            t = step * 1.0
            rec.add("fwd_bwd", step, t, t + 0.4)
            rec.add("grad_transfer", step, t + 0.2, t + 0.3)
            rec.add("cpu_step", step, t + (0.0 if mode == "delayed" else 0.45), t + 0.9)
            rec.add("weight_copy", step, t + 0.9, t + 0.95)
            rec.add("stall", step, t + 0.4, t + 0.45)
            rec.close(step)
        rec.dump(str(tmp_path / f"{mode}.json"))
        files.append(str(tmp_path / f"{mode}.json"))
    out = tmp_path / "t.png"
    _run("timeline.py", *files, "--labels", "plain", "delayed", "--steps", "2", "-o", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_demo_from_a_cpu_engine_run(tmp_path: Path) -> None:
    out = tmp_path / "demo.png"
    _run("timeline.py", "--demo", "--steps", "3", "-o", str(out))
    assert out.stat().st_size > 1000


@pytest.mark.slow
def test_gpu_e2e_cpu_smoke(tmp_path: Path) -> None:
    stdout = _run("gpu_e2e.py", "--cpu-smoke", "--out", str(tmp_path), "--budget-s", "240")
    res = json.loads((tmp_path / "gpu_e2e.json").read_text())
    (thr,) = res["throughput"]
    peers = thr["peers"]
    for peer in ("torch_bf16_master", "torch_autocast"):
        assert peers[peer]["tokens_per_s"] > 0 and peers[peer]["peak_host_gib"] > 0
    assert res["cap"]["gpu"]["largest"]["size"] == "small"
    assert "| model |" in (tmp_path / "gpu_e2e.md").read_text() and "Largest model" in stdout
    for peer in ("zero_offload", "zero_offload_dpu"):
        assert "error" not in peers[peer], peers[peer]
        assert peers[peer]["profile_mean_s"]["cpu_step"] > 0
    assert set(thr["ratios"]) >= {"zero_offload/torch_bf16_master",
                                  "zero_offload_dpu/torch_autocast"}
    assert res["cap"]["offload"]["largest"]["size"] == "small" and res["cap"]["ratio"] == 1.0


def test_dpu_overlap_cpu_tiny(tmp_path: Path) -> None:
    _run("dpu_overlap_cpu.py", "--tiny", "--out", str(tmp_path))
    res = json.loads((tmp_path / "dpu_overlap_cpu.json").read_text())
    for mode in ("plain", "delayed"):
        assert res[mode]["step_s"] > 0 and res[mode]["profile_mean_s"]["cpu_step"] > 0
    assert res["delayed"]["profile_mean_s"]["stall"] <= res["delayed"]["step_s"]
    assert (tmp_path / "dpu_timeline.png").stat().st_size > 1000


@pytest.mark.parametrize("model,precision", [("mlp", "bf16-mixed"), ("gpt", "32-true")])
def test_engine_cpu_speed_runs_each_model_and_precision(model: str, precision: str) -> None:
    """The engine and its plain-torch peer both train a step of the chosen model (not a speed
    check: ratios of a tiny model mean nothing)."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "engine_cpu.py"), "--speed-only", "--model",
         model, "--precision", precision, "--width", "64", "--layers", "1", "--hidden", "64",
         "--vocab", "128", "--seq", "16", "--steps", "2", "--warmup", "0"],
        env=dict(os.environ, PYTHONPATH=str(BENCH.parent / "src")), capture_output=True, text=True,
        timeout=300)
    assert out.returncode == 0, out.stderr
    speed = json.loads(out.stdout)["speed"]
    assert speed["step_time_ratio"] > 0 and speed["median_s"]["engine"]["fwd_bwd"] > 0
