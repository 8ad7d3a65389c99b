"""The planner (``lzo-plan``): its host bytes against the engine's own count and against the RSS
growth of building an engine on the CPU; the fit search, the CLI's JSON, model folders, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_zero_offload as zo
from lightning_zero_offload.planner import main, model_info, parse_bytes, plan

ROOT = Path(__file__).resolve().parents[1]

# Build a model of ~N parameters, keep the user's fp32 tensors alive (so only what the engine
# allocates shows), and report the RSS growth of ZeroOffload(...) on the CPU.
RSS_SCRIPT = r"""
import json, sys, psutil, torch
from torch import nn
import lightning_zero_offload as zo
from lightning_zero_offload.ops import _build
_build.load()
n, precision, delayed = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
d = 512  # small layers: the three bucket buffers the budget holds stay ~1% of it
model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(max(1, n // (d * d)))])
keep = [p.data for p in model.parameters()]
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
proc = psutil.Process()
before = proc.memory_info().rss
engine = zo.ZeroOffload(model, opt, precision=precision, device="cpu", delayed_update=delayed,
                        bucket_size_mb=1)
growth = proc.memory_info().rss - before
print(json.dumps({"params": sum(p.numel() for p in keep), "growth": growth,
                  "host_bytes": engine.host_bytes}))
"""


@pytest.mark.parametrize("numel,precision,delayed", [(8 * 2**20, "bf16-mixed", False),
                                                     (16 * 2**20, "32-true", False),
                                                     (24 * 2**20, "bf16-mixed", True)])
def test_planned_host_bytes_match_rss_growth(numel, precision, delayed):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(numel), precision,
                           str(int(delayed))], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # 1 MB buckets: the one bucket buffer the budget holds (allocated only by a later backward)
    # stays under 1% of the total
    p = plan(got["params"], precision=precision, device="cpu", delayed_update=delayed,
             bucket_size_mb=1, measure=False)
    assert abs(p.host_bytes_per_rank - got["growth"]) <= 0.05 * got["growth"], (p, got)
    # the engine's buckets are at least one parameter (262K elements here), the planner's 1 MB
    assert abs(p.host_bytes_per_rank - got["host_bytes"]) <= 0.01 * got["host_bytes"], (p, got)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "16-mixed"])
@pytest.mark.parametrize("delayed", [False, True])
def test_planned_host_bytes_match_engine_count(precision, delayed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 500), nn.GELU(), nn.Linear(500, 70), nn.LayerNorm(70))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zo.ZeroOffload(model, opt, precision=precision, device="cpu",
                            delayed_update=delayed, check_host_memory=False)
    n = sum(p.numel() for p in model.parameters())
    p = plan(n, precision=precision, device="cpu", delayed_update=delayed, measure=False)
    # the engine also counts the alignment padding: < 16 elements per parameter and per bucket,
    # at most 28 host bytes each (fp32 master, moments, gradient, spare gradient, 2 weights)
    pad = 16 * (len(list(model.parameters())) + 1) * 28
    assert abs(p.host_bytes_per_rank - engine.host_bytes) <= pad, (p, engine.host_bytes)
    engine.teardown()


def test_fit_and_largest_model_are_consistent():
    kw = dict(precision="bf16-mixed", device_memory="24GiB", host_memory="160GiB", measure=False)
    p = plan(7e9, **kw)
    assert p.fits and p.device_fits and p.host_fits
    assert p.device_bytes <= parse_bytes("24GiB") and p.host_bytes_per_node <= 160 * 2**30
    big = p.max_params_that_fit
    assert plan(big, **kw).fits and not plan(int(big * 1.01), **kw).fits
    assert not plan(int(big * 1.01), **kw).fits
    # more ranks shrink each rank's host share, not the device weights
    two = plan(7e9, world_size=2, ranks_per_node=1, **kw)
    assert two.host_bytes_per_rank < 0.6 * p.host_bytes_per_rank
    assert two.device_bytes == p.device_bytes
    # pinned staging and output are packed into power-of-two blocks: a few percent, not 2x
    pinned, used = p.host_breakdown["staging"], 2 * (2 * 7 * 10**9)
    assert used <= pinned <= 1.03 * used
    # activations only with a shape; LoRA-style frozen weights cost device bytes, not host state
    lora = plan(7e9, frozen_params=6.9e9, **kw)
    assert lora.device_bytes > 0.99 * p.device_bytes
    assert lora.host_bytes_per_rank < 0.4 * p.host_bytes_per_rank


def test_cli_json(capsys):
    assert main(["--params", "7e9", "--precision", "bf16-mixed", "--world-size", "1",
                 "--device-memory", "24GiB", "--host-memory", "128GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("device_bytes", "host_bytes_per_rank", "fits", "max_params_that_fit"):
        assert key in out
    ref = plan(7e9, device_memory="24GiB", host_memory="128GiB", measure=False)
    # 20 bytes per parameter on the host (with the fp32 gradient of accumulation): 130 GiB
    assert out["host_bytes_per_rank"] == ref.host_bytes_per_rank and out["fits"] is False
    assert 6e9 < out["max_params_that_fit"] < 7e9
    assert out["cpu_step_seconds"] == pytest.approx(7e9 / out["kernel_params_per_second"])
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--device-memory", "24 GiBs"])
    assert "cannot read '24 GiBs' as a size" in capsys.readouterr().err


def test_model_folder_counts_parameters(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    n = sum(p.numel() for p in model.parameters())
    assert model_info(tmp_path)["params"] == n  # from the safetensors header
    (tmp_path / "model.safetensors").unlink()
    info = model_info(tmp_path / "config.json")  # from the config, built on the meta device
    assert info["params"] == n and info["hidden_size"] == 64
    p = plan(model=tmp_path, batch_size=2, seq_len=32, measure=False)
    assert p.params == n and p.device_breakdown["activations (estimate)"] > 0


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="exactly one of params"):
        plan()
    with pytest.raises(ValueError, match="precision='fp8'"):
        plan(1e9, precision="fp8")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        plan(1e9, world_size=0)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        plan(model="/nonexistent/model")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_planned_pinned_bytes_match_cuda_host_allocator():
    """On CUDA the pinned buffers (staging, weight output) equal the caching host allocator's
    count, and the engine's unpinned state equals the planner's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    engine = zo.ZeroOffload(model, opt, precision="bf16-mixed", device="cuda")
    pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    p = plan(6 * 2**20, precision="bf16-mixed", device="cuda", measure=False)
    planned = p.host_breakdown["staging"]  # gradient staging and weight output, pinned
    assert pinned == planned, (pinned, p.host_breakdown)
    engine.teardown()


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_planned_compact_moments_match_engine_count(moment_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 500), nn.GELU(), nn.Linear(500, 70), nn.LayerNorm(70))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zo.ZeroOffload(model, opt, precision="bf16-mixed", device="cpu",
                            moment_dtype=moment_dtype, check_host_memory=False)
    n = sum(p.numel() for p in model.parameters())
    p = plan(n, precision="bf16-mixed", device="cpu", measure=False, moment_dtype=moment_dtype)
    # padding as above, plus int8's bucket padding to a whole 256-element block
    pad = (16 * (len(list(model.parameters())) + 1) + 256) * 28
    assert abs(p.host_bytes_per_rank - engine.host_bytes) <= pad, (p, engine.host_bytes)
    assert abs(p.host_breakdown["moments"] - engine.host_budget["moments"]) <= pad
    engine.teardown()
    # 7B on a GPU: the moments shrink from 8 to 4 (bf16) or 2 + 8/256 (int8) bytes per parameter
    fp32, small = (plan(7e9, measure=False, moment_dtype=m).host_breakdown["moments"]
                   for m in ("fp32", moment_dtype))
    assert fp32 == 8 * 7 * 10**9
    assert small == pytest.approx(7e9 * (4 if moment_dtype == "bf16" else 2 + 8 / 256), rel=1e-6)


def test_cli_moment_dtype(capsys):
    assert main(["--params", "7e9", "--moment-dtype", "int8", "--no-measure", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_bytes_per_rank"] == plan(7e9, measure=False,
                                              moment_dtype="int8").host_bytes_per_rank
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--moment-dtype", "fp8"])
    with pytest.raises(ValueError, match="moment_dtype='fp8' is not supported"):
        plan(7e9, moment_dtype="fp8")
