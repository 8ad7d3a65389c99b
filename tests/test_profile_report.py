"""The package's profile reader: format_summary's numbers, and the ``plot``/``summary`` commands
on a profile a CPU engine recorded."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_zero_offload as zo
from lightning_zero_offload import profile_report
from lightning_zero_offload.core.device.profile import FIELDS, StepProfile
from lightning_zero_offload.profile_report import draw, format_summary, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """Six steps of a small CPU engine (delayed update after 2), dumped as JSON."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zo.ZeroOffload(model, opt, precision="32-true", delayed_update=True,
                            delayed_update_warmup=2, cpu_threads=1)
    x = torch.randn(32, 64)
    for _ in range(6):
        engine.backward(engine.module(x).square().mean())
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    path = tmp_path_factory.mktemp("profile") / "run.json"
    assert profile_report.save(engine.profile, path) == path  # the documented way
    engine.teardown()
    return path


def test_summary_reports_median_ms_and_main_thread_shares(recorded):
    records = json.loads(recorded.read_text())["records"]
    assert len(records) == 6
    text = format_summary([StepProfile(**r) for r in records])
    med = {k: statistics.median(r[k] for r in records) for k in FIELDS}
    main_thread = med["fwd_bwd"] + med["grad_wait"] + med["stall"]
    lines = text.splitlines()
    assert lines[0] == "ZeRO-Offload profile, median of 6 steps (steps 1-6):"
    for key, label in (("fwd_bwd", "forward+backward"), ("cpu_step", "CPU step"),
                       ("stall", "stall")):
        line = next(ln for ln in lines if ln.strip().startswith(label))
        assert f"{1e3 * med[key]:.2f} ms" in line
    fb = next(ln for ln in lines if ln.strip().startswith("forward+backward"))
    assert f"{100 * med['fwd_bwd'] / main_thread:3.0f}% of the step" in fb
    assert f"main-thread step time {1e3 * main_thread:.2f} ms" in lines[-1]
    assert format_summary(records) == text  # dicts (from JSON) read the same
    assert format_summary([]) == "ZeRO-Offload profile: no steps recorded"


def test_plot_and_summary_commands(recorded, tmp_path):
    out = tmp_path / "timeline.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "lightning_zero_offload.profile_report"]
    proc = subprocess.run([*cmd, "plot", str(recorded), "-o", str(out), "--steps", "3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    proc = subprocess.run([*cmd, "summary", str(recorded)], env=env, capture_output=True,
                          text=True, timeout=300)
    records = json.loads(recorded.read_text())["records"]
    assert proc.returncode == 0 and proc.stdout.strip() == format_summary(records)
    empty = tmp_path / "empty.json"
    empty.write_text('{"records": []}')
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1


def test_plot_without_matplotlib_names_the_extra(recorded, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"lightning-zero-offload\[plot\]"):
        draw([("run", json.loads(recorded.read_text())["records"])], tmp_path / "t.png")
