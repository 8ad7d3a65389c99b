"""The planner (``lzo-plan``): its host bytes against the engine's own count and against the RSS
growth of building an engine on the CPU; the fit search, the CLI's JSON, model folders, errors;
what it says is short and the changes that fit (each re-planned), activation checkpointing,
gradient accumulation, and a Llama-7B config whose activations alone overflow the device."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_zero_offload as zo
from lightning_zero_offload._units import format_bytes
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


EMULATED = "LZO_EMULATED_DEVICE_SEED"


def _real_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner models the CPU and CUDA devices; under the emulated suite's seed an engine on
    "cpu" is the emulated one (the CPU's memory with CUDA's asynchronous staging), neither."""
    monkeypatch.delenv(EMULATED, raising=False)


@pytest.mark.parametrize("numel,precision,delayed", [(8 * 2**20, "bf16-mixed", False),
                                                     (16 * 2**20, "32-true", False),
                                                     (24 * 2**20, "bf16-mixed", True)])
def test_planned_host_bytes_match_rss_growth(numel, precision, delayed):
    env = {k: v for k, v in os.environ.items() if k != EMULATED}  # see _real_devices_only
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
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
def test_planned_host_bytes_match_engine_count(precision, delayed, monkeypatch):
    _real_devices_only(monkeypatch)
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
    # more ranks shrink each rank's host share, not the device weights; the device gets the
    # reduce-scatter's three shard buffers (half a bucket each)
    two = plan(7e9, world_size=2, ranks_per_node=1, **kw)
    assert two.host_bytes_per_rank < 0.6 * p.host_bytes_per_rank
    assert two.device_bytes == p.device_bytes + 3 * 25 * 2**20 // 2
    # pinned staging (which also carries the new weights up) is packed into power-of-two
    # blocks: a few percent, not 2x
    pinned, used = p.host_breakdown["staging"], 2 * 7 * 10**9
    assert used <= pinned <= 1.03 * used
    # activations only with a shape; LoRA-style frozen weights cost device bytes, not host state
    lora = plan(7e9, frozen_params=6.9e9, **kw)
    assert lora.device_bytes > 0.99 * p.device_bytes
    assert lora.host_bytes_per_rank < 0.4 * p.host_bytes_per_rank


def test_cli_json(capsys):
    assert main(["--params", "10e9", "--precision", "bf16-mixed", "--world-size", "1",
                 "--device-memory", "24GiB", "--host-memory", "128GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("device_bytes", "host_bytes_per_rank", "fits", "max_params_that_fit",
                "host_bytes_accumulating", "short", "suggestions", "max_params_blocked_by"):
        assert key in out
    assert {tuple(s) for s in out["suggestions"]} == {(
        "change", "reason", "fits", "device_bytes", "host_bytes", "device_headroom_bytes")}
    ref = plan(10e9, device_memory="24GiB", host_memory="128GiB", measure=False)
    # 14 bytes per parameter on the host (no accumulation): 130.9 GiB, of 115.2 GiB usable (128
    # GiB less the default 10% reserve)
    assert out["host_bytes_per_rank"] == ref.host_bytes_per_rank and out["fits"] is False
    assert out["host_reserve"] == int(0.1 * 128 * 2**30)
    assert 8.5e9 < out["max_params_that_fit"] < 9e9
    assert out["cpu_step_seconds"] == pytest.approx(10e9 / out["kernel_params_per_second"])
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
    with pytest.raises(ValueError, match="precision: 'fp8' is not supported"):
        plan(1e9, precision="fp8")
    with pytest.raises(ValueError, match="world_size: 0 is not an int >= 1"):
        plan(1e9, world_size=0)
    # wrong types: a TypeError naming the argument
    for kwargs, name in [(dict(params=[7e9]), "params"), (dict(world_size=2.0), "world_size"),
                         (dict(bucket_size_mb="25"), "bucket_size_mb"),
                         (dict(host_memory=object()), "host_memory"),
                         (dict(delayed_update="yes"), "delayed_update"),
                         (dict(offload_fraction=True), "offload_fraction"),
                         (dict(device_memory_headroom=[0.1]), "device_memory_headroom")]:
        with pytest.raises(TypeError, match=f"plan: {name}: got "):
            plan(**{"params": 1e9, "measure": False, **kwargs})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        plan(model="/nonexistent/model")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_parts_step_is_measured_on_cuda():
    """Where CUDA is, the device part's step is timed (torch's fused AdamW); its traffic over
    its time is a memory bandwidth a device can have (under 10 TB/s)."""
    half = plan(13e9, offload_fraction=0.5, device_memory="141GiB", host_memory="128GiB",
                cpu_threads=1)
    assert half.device_step_seconds is not None and half.device_step_seconds > 0
    assert half.device_step_bytes / half.device_step_seconds < 10e12
    assert "measured on this machine's device" in str(half)


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
def test_planned_compact_moments_match_engine_count(moment_dtype, monkeypatch):
    _real_devices_only(monkeypatch)
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


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16", "int8"])
def test_planned_lion_matches_its_engine_and_fits_more(moment_dtype, monkeypatch):
    """--optimizer lion: the host keeps one moment (4, 2 or 1 + 4/256 bytes per parameter), as
    a Lion engine counts it; on the H200 box (139 GiB device, 128 GiB host, no reserve) the
    largest model is larger than Adam's."""
    lion = pytest.importorskip("lion_pytorch")
    _real_devices_only(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 500), nn.GELU(), nn.Linear(500, 70), nn.LayerNorm(70))
    engine = zo.ZeroOffload(model, lion.Lion(model.parameters()), precision="bf16-mixed",
                            device="cpu", moment_dtype=moment_dtype, check_host_memory=False)
    n = sum(p.numel() for p in model.parameters())
    p = plan(n, precision="bf16-mixed", device="cpu", measure=False, moment_dtype=moment_dtype,
             optimizer="lion")
    pad = (16 * (len(list(model.parameters())) + 1) + 256) * 28
    assert abs(p.host_breakdown["moments"] - engine.host_budget["moments"]) <= pad
    assert abs(p.host_bytes_per_rank - engine.host_bytes) <= pad, (p, engine.host_bytes)
    engine.teardown()
    box = dict(precision="bf16-mixed", device_memory="139GiB", host_memory="128GiB",
               host_reserve=0, moment_dtype=moment_dtype, measure=False)
    adam, mine = (plan(7e9, optimizer=o, **box) for o in ("adamw", "lion"))
    per = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256}[moment_dtype]
    assert mine.host_breakdown["moments"] == pytest.approx(7e9 * per, rel=1e-6)
    assert mine.optimizer == "lion" and "optimizer lion" in str(mine)
    assert mine.max_params_that_fit > adam.max_params_that_fit


def test_cli_moment_dtype(capsys):
    assert main(["--params", "7e9", "--moment-dtype", "int8", "--no-measure", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_bytes_per_rank"] == plan(7e9, measure=False,
                                              moment_dtype="int8").host_bytes_per_rank
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--moment-dtype", "fp8"])
    with pytest.raises(ValueError, match="moment_dtype: 'fp8' is not supported"):
        plan(7e9, moment_dtype="fp8")


KW = dict(precision="bf16-mixed", device_memory="24GiB", host_memory="128GiB", measure=False)
CLI = ["--precision", "bf16-mixed", "--device-memory", "24GiB", "--host-memory", "128GiB",
       "--no-measure"]
# plan() keywords of each change the planner lists, from its flags
FLAG_KW = {"--moment-dtype": ("moment_dtype", str), "--world-size": ("world_size", int),
           "--ranks-per-node": ("ranks_per_node", int), "--batch-size": ("batch_size", int),
           "--seq-len": ("seq_len", int), "--offload-fraction": ("offload_fraction", float)}


def _replan_kwargs(change: str) -> dict:
    """The plan() keywords a listed change stands for ("--moment-dtype int8 + ...")."""
    out: dict = {}
    for part in change.split(" + "):
        words = part.split()
        if words[0] == "--activation-checkpointing":
            out["activation_checkpointing"] = True
        elif words[0] == "--no-delayed-update":
            out["delayed_update"] = False
        elif words[0] == "--device-memory":
            out["device_memory"] = words[1]
        elif words[0] == "--attention":
            out["attention"] = words[1]
        elif words[0] == "--host-reserve":
            out["host_reserve"] = words[1]
        elif words[0] == "--device-memory-headroom":
            out["device_memory_headroom"] = float(words[1])
        else:
            for flag, value in zip(words[::2], words[1::2], strict=True):
                key, cast = FLAG_KW[flag]
                out[key] = cast(value)
    return out


def _llama7b(folder: Path) -> Path:
    """Llama-7B's config.json and a weightless safetensors header with its tensor shapes (the
    planner reads only the header): 6,738,415,616 parameters."""
    h, f, layers, v = 4096, 11008, 32, 32000
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h],
              "lm_head.weight": [v, h]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{n}_proj.weight": [h, h] for n in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                       p + "mlp.down_proj.weight": [h, f], p + "input_layernorm.weight": [h],
                       p + "post_attention_layernorm.weight": [h]})
    header = json.dumps({k: {"dtype": "F16", "shape": s, "data_offsets": [0, 0]}
                         for k, s in shapes.items()}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": v, "max_position_embeddings": 2048}))
    return folder


@pytest.mark.parametrize("params,delayed,host,device,expected", [
    ("10e9", False, "128GiB", "24GiB", {"--moment-dtype bf16", "--moment-dtype int8",
                                        "--world-size 2 --ranks-per-node 1"}),
    # bf16 moments would need 65.2 GiB: int8, bf16 with a 2 GiB reserve, and more ranks fit
    ("7e9", False, "64GiB", "24GiB", {"--moment-dtype int8", "--world-size 2 --ranks-per-node 1",
                                      "--moment-dtype bf16 + --host-reserve 2GiB"}),
    # delayed update: a second device copy of the weights (48 GiB device) and 2 more host bytes;
    # without it 117.8 GiB, under 136 GiB less the 10% reserve; the pool's own settings first:
    # 10% of the state on the device, a smaller headroom under "auto", a 6 GiB reserve
    ("9e9", True, "136GiB", "48GiB", {"--offload-fraction 0.9", "--device-memory-headroom 0.06",
                                      "--host-reserve 6GiB", "--moment-dtype bf16",
                                      "--moment-dtype int8", "--world-size 2 --ranks-per-node 1",
                                      "--no-delayed-update"}),
])
def test_host_short_names_it_and_the_changes_that_fit(capsys, params, delayed, host, device,
                                                      expected):
    flags = ["--params", params, "--precision", "bf16-mixed", "--device-memory", device,
             "--host-memory", host, "--no-measure"] + (["--delayed-update"] if delayed else [])
    assert main([*flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    base = dict(precision="bf16-mixed", device_memory=device, host_memory=host,
                measure=False, delayed_update=delayed)
    ref = plan(params, **base)
    assert out["fits"] is False and out["device_fits"] is True
    usable = parse_bytes(host) - int(0.1 * parse_bytes(host))  # the default 10% reserve
    assert ref.host_usable == usable
    assert out["short"] == [{"resource": "host", "needed": ref.host_bytes_per_node,
                             "available": usable}]
    assert {s["change"] for s in out["suggestions"]} == expected
    for s in out["suggestions"]:  # each one, re-planned, fits with the bytes it says
        again = plan(params, **{**base, **_replan_kwargs(s["change"])})
        assert s["fits"] is True and again.fits
        assert (s["device_bytes"], s["host_bytes"]) == (again.device_bytes,
                                                       again.host_bytes_per_node)
        if "--world-size" in s["change"]:  # the fewest ranks that fit
            fewer = _replan_kwargs(s["change"])
            fewer["world_size"] -= 1
            assert not plan(params, **{**base, **fewer}).fits
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert (f"  host memory is short: {ref.host_bytes_per_node / 2**30:.2f} GiB needed per "
            f"node, {usable / 2**30:.2f} GiB available (after the reserve)") in text
    assert "changes that fit:\n" in text and "device memory is short" not in text


def test_both_short_13b_lists_a_change_that_fits(capsys):
    assert main(["--params", "13e9", *CLI]) == 0
    text = capsys.readouterr().out
    ref = plan(13e9, **KW)
    assert not ref.device_fits and not ref.host_fits
    assert (f"  device memory is short: {ref.device_bytes / 2**30:.2f} GiB needed, "
            "24.00 GiB available") in text
    assert f"  host memory is short: {ref.host_bytes_per_node / 2**30:.2f} GiB" in text
    changes = [line.strip() for line in text.split("changes that fit:\n")[1].splitlines()
               if line.startswith("  --")]
    assert changes
    for line in changes:  # "CHANGE: device X GiB, host Y GiB per node"
        change, figures = line.rsplit(": device ", 1)
        again = plan(13e9, **{**KW, **_replan_kwargs(change)})
        assert again.fits, line
        free = format_bytes(again.device_memory - again.device_bytes)
        assert figures == (f"{again.device_bytes / 2**30:.2f} GiB ({free} of it free), host "
                           f"{again.host_bytes_per_node / 2**30:.2f} GiB per node")


def test_llama7b_activations_checkpointing_and_never_zero_largest(tmp_path, capsys):
    folder = _llama7b(tmp_path)
    assert model_info(folder)["params"] == 6_738_415_616
    s, b, h, a, v, layers = 2048, 1, 4096, 32, 32000, 32
    full = s * b * h * (34 + 5 * a * s / h)  # one layer, 16-bit
    kw = dict(model=folder, batch_size=b, seq_len=s, **KW)
    plain, ckpt = plan(**kw), plan(**kw, activation_checkpointing=True)
    assert plain.device_breakdown["activations (estimate)"] == int(layers * full + s * b * v * 6)
    assert ckpt.device_breakdown["activations (estimate)"] == int(
        layers * s * b * h * 2 + full + s * b * v * 6)
    # without checkpointing the activations alone (28.9 GiB) exceed the device: no "0.00B"
    assert plain.device_fits is False and plain.max_params_that_fit is None
    assert plain.max_params_blocked_by == "activations"
    assert [x["change"] for x in plain.suggestions] == ["--activation-checkpointing",
                                                        "--attention memory-efficient"]
    assert ckpt.fits and ckpt.max_params_that_fit > 6e9
    assert plan(model_info(folder)["params"], **KW).fits  # the weights alone fit
    flags = ["--model", str(folder / "config.json"), "--batch-size", "1", "--seq-len", "2048",
             *CLI]
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert "0.00B" not in text
    assert "largest model that fits: none at batch 1 x 2048: activations are the limit" in text
    assert ("  use --activation-checkpointing, --attention memory-efficient or a smaller "
            "--batch-size / --seq-len") in text
    assert main([*flags, "--activation-checkpointing"]) == 0
    text = capsys.readouterr().out
    assert "fits: yes" in text
    assert f"largest model that fits: {ckpt.max_params_that_fit / 1e9:.2f}B" in text


def test_smaller_batch_is_the_largest_that_fits(tmp_path):
    kw = dict(model=_llama7b(tmp_path), seq_len=2048, activation_checkpointing=True, **KW)
    p = plan(batch_size=16, **kw)
    assert p.short == [{"resource": "device", "needed": p.device_bytes,
                        "available": 24 * 2**30}]
    batches = [int(x["change"].split()[1]) for x in p.suggestions
               if x["change"].startswith("--batch-size")]
    assert len(batches) == 1 and 1 < batches[0] < 16
    assert plan(batch_size=batches[0], **kw).fits
    assert not plan(batch_size=batches[0] + 1, **kw).fits


def test_accumulate_figure_once_and_follows_plan_counts(capsys):
    flags = ["--params", "1e9", *CLI]
    assert main(flags) == 0
    text = capsys.readouterr().out
    # the fp32 gradient is budgeted only where the run accumulates: both figures, each once
    p, acc = plan(1e9, **KW), plan(1e9, accumulate=True, **KW)
    assert "grad_fp32" not in p.host_breakdown or p.host_breakdown["grad_fp32"] == 0
    assert p.host_bytes_accumulating == acc.host_bytes_per_rank \
        == p.host_bytes_per_rank + 4 * 1_000_000_000
    assert (f"host bytes per rank: {p.host_bytes_per_rank / 2**30:.2f} GiB (with "
            f"--accumulate: {acc.host_bytes_per_rank / 2**30:.2f} GiB)") in text
    assert text.count(f"{acc.host_bytes_per_rank / 2**30:.2f} GiB") == 1
    assert main([*flags, "--accumulate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accumulate"] is True
    assert out["host_bytes_per_rank"] == out["host_bytes_accumulating"] == acc.host_bytes_per_rank


def test_13b_fits_one_h200_host_at_the_floor() -> None:
    """Issue 19: with the host at the floor a 128 GiB host trains 13B (bf16 moments) on one
    GPU, 16B with int8 moments, 9B with fp32 ones; accumulating adds the fp32 gradient. That
    leaves 6.3 GiB for everything else: with the default 10% reserve 13B needs int8 moments.
    All of the optimizer state on the host (``offload_fraction=1.0``; "auto" is below)."""
    default = plan(13e9, moment_dtype="bf16", precision="bf16-mixed", device_memory="141GiB",
                   host_memory="128GiB", measure=False, offload_fraction=1.0)
    assert default.fits is False and default.host_fits is False
    assert "--moment-dtype int8" in {s["change"] for s in default.suggestions}
    kw = dict(precision="bf16-mixed", device_memory="141GiB", host_memory="128GiB",
              host_reserve=0, measure=False, offload_fraction=1.0)
    assert plan(13e9, moment_dtype="bf16", **kw).fits
    assert plan(13e9, moment_dtype="int8", **kw).max_params_that_fit >= 16e9
    assert plan(13e9, moment_dtype="fp32", **kw).max_params_that_fit >= 9e9
    acc = plan(13e9, moment_dtype="bf16", accumulate=True, **kw)
    assert acc.host_bytes_per_rank - plan(13e9, moment_dtype="bf16", **kw).host_bytes_per_rank \
        == 4 * 13_000_000_000


_CFG = json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "vocab_size": 300})
# (id, options, files in the model folder (then --model is the folder), the option or file the
# error must name, plan() keywords of the same bad value or None where the CLI alone has it)
BAD_INPUTS = [
    ("params-two-dots", ["--params", "1.5.3"], None, "--params", dict(params="1.5.3")),
    ("params-overflow", ["--params", "1e400"], None, "--params", dict(params="1e400")),
    ("params-inf", ["--params", "inf"], None, "--params", dict(params=float("inf"))),
    ("params-over-cap", ["--params", "2e12"], None, "--params", dict(params=2e12)),
    ("params-negative", ["--params", "-5"], None, "--params", dict(params=-5)),
    ("host-two-dots", ["--host-memory", "1.2.3GiB"], None, "--host-memory",
     dict(host_memory="1.2.3GiB")),
    ("host-overflow", ["--host-memory", "1e400"], None, "--host-memory",
     dict(host_memory="1e400")),
    ("device-zero", ["--device-memory", "0"], None, "--device-memory", dict(device_memory=0)),
    ("device-unit", ["--device-memory", "24 GiBs"], None, "--device-memory",
     dict(device_memory="24 GiBs")),
    ("bucket-inf", ["--bucket-size-mb", "inf"], None, "--bucket-size-mb",
     dict(bucket_size_mb=float("inf"))),
    ("bucket-zero", ["--bucket-size-mb", "0"], None, "--bucket-size-mb",
     dict(bucket_size_mb=0.0)),
    ("ranks-per-node", ["--world-size", "2", "--ranks-per-node", "3"], None, "--ranks-per-node",
     dict(world_size=2, ranks_per_node=3)),
    ("world-zero", ["--world-size", "0"], None, "--world-size", dict(world_size=0)),
    ("seq-zero", ["--seq-len", "0"], None, "--seq-len", dict(seq_len=0)),
    ("frozen-all", ["--params", "7e9", "--frozen-params", "8e9"], None, "--frozen-params",
     dict(params=7e9, frozen_params=8e9)),
    ("reserve-all", ["--host-memory", "64GiB", "--host-reserve", "100%"], None,
     "--host-reserve", dict(host_memory="64GiB", host_reserve="100%")),
    ("reserve-over", ["--host-memory", "64GiB", "--host-reserve", "80GiB"], None,
     "--host-reserve", dict(host_memory="64GiB", host_reserve="80GiB")),
    ("reserve-unit", ["--host-memory", "64GiB", "--host-reserve", "ten"], None,
     "--host-reserve", dict(host_memory="64GiB", host_reserve="ten")),
    ("fraction-over", ["--offload-fraction", "1.5"], None, "--offload-fraction",
     dict(offload_fraction=1.5)),
    ("fraction-negative", ["--offload-fraction", "-0.1"], None, "--offload-fraction",
     dict(offload_fraction=-0.1)),
    ("fraction-word", ["--offload-fraction", "half"], None, "--offload-fraction",
     dict(offload_fraction="half")),
    ("fraction-nan", ["--offload-fraction", "nan"], None, "--offload-fraction",
     dict(offload_fraction=float("nan"))),
    ("fraction-cpu", ["--device", "cpu", "--offload-fraction", "0.5"], None,
     "--offload-fraction", dict(device="cpu", offload_fraction=0.5)),
    ("headroom-one", ["--device-memory-headroom", "1"], None, "--device-memory-headroom",
     dict(device_memory_headroom=1.0)),
    ("headroom-word", ["--device-memory-headroom", "lots"], None, "--device-memory-headroom",
     dict(device_memory_headroom="lots")),
    ("config-not-json", [], {"config.json": "{not json"}, "config.json", {}),
    ("config-a-list", [], {"config.json": "[1, 2]"}, "config.json", {}),
    ("config-bad-shape", [], {"config.json": json.dumps({"hidden_size": "64"})}, "config.json",
     {}),
    ("safetensors-header", [], {"config.json": _CFG,
                                "model.safetensors": (20).to_bytes(8, "little") + b"{oops"},
     "model.safetensors", {}),
    ("safetensors-short", [], {"config.json": _CFG, "model.safetensors": b"abc"},
     "model.safetensors", {}),
    ("safetensors-no-shape", [], {"config.json": _CFG, "model.safetensors":
                                  (11).to_bytes(8, "little") + b'{"w": {}}  '},
     "model.safetensors", {}),
    ("model-missing", ["--model", "/nonexistent/model"], None, "/nonexistent/model", None),
]


@pytest.mark.parametrize("options,files,name,api", [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])
def test_bad_inputs_exit_2_naming_the_option(tmp_path, capsys, options, files, name, api):
    """Each bad value: ``lzo-plan`` exits 2 with ``lzo-plan: error:`` naming the option (or the
    file), never a traceback; ``plan()`` raises a ValueError naming the argument (or file)."""
    argv = ["--no-measure", *options]
    if files is not None:
        for fname, content in files.items():
            (tmp_path / fname).write_bytes(content if isinstance(content, bytes)
                                           else content.encode())
        argv += ["--model", str(tmp_path)]
    elif "--params" not in argv and "--model" not in argv:
        argv += ["--params", "7e9"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "lzo-plan: error:" in err and name in err and "Traceback" not in err, err
    if api is None:
        return
    kwargs = {"measure": False, **api}
    if files is not None:
        kwargs["model"] = tmp_path
    elif "params" not in kwargs:
        kwargs["params"] = 7e9
    argument = name.lstrip("-").replace("-", "_") if name.startswith("--") else name
    with pytest.raises(ValueError, match=re.escape(argument)):
        plan(**kwargs)


LLAMA_BIG_BATCH = dict(batch_size=4, seq_len=4096, precision="bf16-mixed",
                       device_memory="24GiB", host_memory="64GiB", measure=False)


def test_activations_the_limit_advises_reducing_them_not_a_larger_device(tmp_path, capsys):
    """Issue 29 item 9: Llama-7B at batch 4 x 4096: the weights (12.55 GiB) fit 24 GiB, the
    eager-attention activations (391 GiB) do not: the changes offered reduce activations (each
    re-planned to a fit, paired with a host change: 64 GiB is short too), never a larger
    device, and the output says the estimate assumes eager attention."""
    folder = _llama7b(tmp_path)
    p = plan(model=folder, **LLAMA_BIG_BATCH)
    assert p.device_bytes - p.activation_bytes <= 24 * 2**30 < p.device_bytes
    changes = [s["change"] for s in p.suggestions]
    assert changes and not any("--device-memory" in c for c in changes), changes
    assert any("--attention memory-efficient" in c for c in changes), changes
    assert all("--activation-checkpointing" in c for c in changes), changes
    for s in p.suggestions:
        again = plan(model=folder, **{**LLAMA_BIG_BATCH, **_replan_kwargs(s["change"])})
        assert again.fits and again.device_bytes == s["device_bytes"], s
    # memory-efficient attention drops the 5 a s / H term (the seq x seq scores)
    s, b, h, layers, v = 4096, 4, 4096, 32, 32000
    eff = plan(model=folder, **{**LLAMA_BIG_BATCH, "attention": "memory-efficient"})
    assert eff.activation_bytes == int(layers * s * b * h * 34 + s * b * v * 6)
    assert main(["--model", str(folder), "--batch-size", "4", "--seq-len", "4096",
                 "--device-memory", "24GiB", "--host-memory", "64GiB", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "eager attention: keeps batch x heads x seq^2 scores" in text
    assert "--device-memory" not in text.split("changes that fit:")[1]
    # the weights alone overflow the device: then a larger device is what is offered
    big = plan(13e9, device_memory="24GiB", host_memory="512GiB", measure=False)
    assert [s["change"] for s in big.suggestions] == ["--device-memory 25GiB"]


def test_params_alone_says_activations_are_left_out(capsys):
    assert main(["--params", "7e9", *CLI]) == 0
    text = capsys.readouterr().out
    assert "note: activations are not counted in the device bytes" in text
    assert "(same settings; activations not counted)" in text


def test_host_reserve_applies_to_fits_and_the_largest_model(capsys):
    """Issue 29 item 9: a run that takes 99% of the host does not "fit": 10% of it (default,
    ``--host-reserve``) is kept for the OS, Python and data loaders, in the fit and the search.
    All of the optimizer state on the host (``offload_fraction=1.0``)."""
    kw = dict(measure=False, offload_fraction=1.0)
    need = plan(7e9, **kw).host_bytes_per_node
    host = int(need / 0.99)
    tight = plan(7e9, device_memory="24GiB", host_memory=host, **kw)
    assert tight.host_reserve == int(0.1 * host) and tight.fits is False
    assert tight.short == [{"resource": "host", "needed": need,
                            "available": host - int(0.1 * host)}]
    assert plan(7e9, device_memory="24GiB", host_memory=host, host_reserve=0, **kw).fits
    largest = tight.max_params_that_fit
    assert plan(largest, device_memory="24GiB", host_memory=host, **kw).fits
    assert plan(largest, **kw).host_bytes_per_node <= host - tight.host_reserve
    assert main(["--params", "7e9", "--device-memory", "24GiB", "--host-memory", "128GiB",
                 "--host-reserve", "8GiB", "--no-measure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_reserve"] == 8 * 2**30
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--host-reserve" in capsys.readouterr().out


def test_small_figures_show_their_unit(capsys):
    """Small sizes print in KiB/MiB, not "0.00 GiB"."""
    assert main(["--params", "35000", "--device-memory", "1GiB", "--host-memory", "1GiB",
                 "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "0.00 GiB" not in text and " KiB" in text and " MiB" in text


@pytest.mark.parametrize("moment_dtype", ["fp32", "int8"])
def test_the_plan_says_what_an_asynchronous_save_copies_and_whether_it_fits(moment_dtype):
    from lightning_zero_offload.core.rules.adam import Adam

    n = 10**9
    kw = dict(precision="bf16-mixed", device="cuda", device_memory="80GiB", measure=False,
              moment_dtype=moment_dtype, offload_fraction=1.0, world_size=2, host_reserve=0)
    base = plan(n, host_memory="1TiB", **kw)
    shard = -(-base.trainable_params // 2)
    assert base.async_copy_sharded == 4 * shard + Adam().host_bytes(shard, moment_dtype)
    assert base.async_copy_consolidated == 12 * base.trainable_params  # fp32 master and moments
    run = base.host_bytes_per_node
    just = plan(n, host_memory=run + 2 * base.async_copy_sharded, **kw)  # the shards' copies fit
    assert just.fits and just.async_copy_fits["sharded"]
    assert just.async_copy_fits["consolidated"] is (
        base.async_copy_consolidated <= 2 * base.async_copy_sharded)
    tight = plan(n, host_memory=run + 2 * base.async_copy_sharded - 1, **kw)
    assert tight.fits and tight.async_copy_fits == {"sharded": False, "consolidated": False}
    assert "it saves blocking" in str(tight) and "holds no copy" in str(tight)
    assert plan(n, **kw).async_copy_fits == {"sharded": None, "consolidated": None}


def test_the_predicted_cpu_step_counts_the_host_part_only():
    kw = dict(precision="bf16-mixed", device="cuda", device_memory="141GiB",
              host_memory="128GiB", host_reserve=0)
    whole = plan(13e9, offload_fraction=1.0, **kw)
    half = plan(13e9, offload_fraction=0.5, **kw)
    none = plan(13e9, offload_fraction=0.0, **kw)
    rate = whole.kernel_params_per_second
    assert whole.cpu_step_seconds == pytest.approx(-(-whole.trainable_params // 1) / rate)
    assert half.cpu_step_seconds == pytest.approx(
        whole.trainable_params * half.offload_fraction / half.kernel_params_per_second)
    assert 0.4 < half.offload_fraction < 0.6 and none.cpu_step_seconds == 0.0
    assert "the host part, " in str(half) and "device part's step: " in str(half)


def test_help_imports_no_torch_and_every_option_says_what_it_is():
    """``lzo-plan --help`` answers without importing torch (it took 2 s for the help text),
    and every option has its help."""
    from lightning_zero_offload.planner import cli

    code = ("import sys\nfrom lightning_zero_offload.planner.cli import main\ntry:\n"
            "    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e\n"
            "print('torch imported:', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--offload-fraction" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "torch imported: False", proc.stdout[-500:]
    parser = cli._parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []


def test_the_optimizer_is_any_rule_of_the_registry_and_another_is_named(capsys) -> None:
    """``--optimizer`` takes every key of the engine's registry (none is listed twice, in the
    CLI and the registry); another is refused naming them all."""
    from lightning_zero_offload.core.rules.rules import RULES
    from lightning_zero_offload.planner import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--params", "1e8", "--no-measure", "--optimizer", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizer" in err and all(repr(r.KEY) in err for r in RULES), err
    for r in RULES:
        assert cli.main(["--params", "1e8", "--no-measure", "--json", "--optimizer", r.KEY]) in (
            0, None)
