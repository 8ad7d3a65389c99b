"""FSDP2's ``CPUOffloadPolicy`` under the engine: what the host and the device hold (issue 47,
"Memory"), measured in spawned processes.

Host: FSDP2's fp32 host shards are the master, so the engine adds only its rule's state, its fp32
gradient (FSDP2 hands its reduced gradient over in fp32 and the engine takes it: the 16 / 12 /
10.03 bytes-per-parameter floor with fp32 / bf16 / int8 moments in 32-true, not 14 / 10 / 8.03)
and fixed buffers beside FSDP2's own tensors: the RSS growth of setup + one step stays within that,
well below a second fp32 copy of the weights (4 more bytes per parameter).

Device (the emulated asynchronous device with a capacity of half the model's half weights):
training with host weights runs within it (the engine's own device bytes are its gradient ring);
without ``offload_weights`` the same model is refused at setup (its weights counted on the device),
and the model unsharded runs out of memory placing its weights."""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from torch import nn

from lightning_zero_offload import ZeroOffload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _gpt import GPT, gpt_config, random_batch  # noqa: E402
from fsdp2_cpu import _groups  # noqa: E402
from fsdp2_offload_cpu import offloaded_gpt  # noqa: E402

pytestmark = pytest.mark.slow  # every test reads what a spawned gloo process measured

# the GPT of benchmarks/_gpt.py, 6 x 512, vocabulary 1024: 19.5M parameters, so the engine's
# fixed buffers are small beside them
CFG = gpt_config((6, 512), vocab_size=1024, seq_len=32)
BUCKET_MB = 1.0
STATE = {"fp32": 8.0, "bf16": 4.0, "int8": 2 + 2 * 4 / 256}  # AdamW's bytes per parameter
FLOOR = {"fp32": 16.0, "bf16": 12.0, "int8": 10.03}  # + the fp32 weights and gradient
SLACK = 4 * 2**20  # the allocator's and the autograd graph's, beside the engine's fixed buffers


def _steps(engine: ZeroOffload, model: nn.Module, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(*random_batch(CFG, 2, seed=step))
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    return losses


def _host(rank: int, world: int, moment_dtype: str) -> dict:
    """RSS growth of the engine's setup and one 32-true step, beside the engine's budget; from
    after one forward and backward of FSDP2 alone (its lazy initialisation and first-iteration
    buffers are FSDP2's own, paid with torch's optimizer too), its gradients dropped."""
    import psutil

    # freed large blocks go back to the system at once, so RSS tracks live memory
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    model = offloaded_gpt(CFG, 1)  # pin_memory=False: no CUDA here
    model(*random_batch(CFG, 2)).backward()
    model.zero_grad(set_to_none=True)
    proc = psutil.Process()
    before = proc.memory_info().rss
    engine = ZeroOffload(model, torch.optim.AdamW(_groups(model)), device="cpu",
                         precision="32-true", moment_dtype=moment_dtype, offload_weights=True,
                         bucket_size_mb=BUCKET_MB)
    _steps(engine, model, 1)
    out = {"growth": proc.memory_info().rss - before, "budget": dict(engine.host_budget),
           "params": sum(p.to_local().numel() for p in model.parameters()),
           "weights": sum(p.to_local().nbytes for p in model.parameters()),
           "grads_left": sum(p.grad is not None for p in model.parameters())}
    engine.teardown()
    return out


@functools.cache
def _host_runs() -> dict[str, dict]:
    return {m: run_ranks(_host, 1, m, timeout=400)[0] for m in STATE}


@pytest.mark.parametrize("moment_dtype", list(STATE))
def test_the_engine_adds_its_state_and_gradient_beside_fsdp2s_host_weights(
        moment_dtype: str) -> None:
    r = _host_runs()[moment_dtype]
    n, b = r["params"], r["budget"]
    assert r["weights"] == 4 * n  # FSDP2's fp32 host shards: the master
    assert b["master"] == 0  # no copy of the engine's
    assert b["grad_fp32"] == 4 * n  # FSDP2's reduced gradient is fp32; the engine takes it
    assert r["grads_left"] == 0  # and FSDP2 keeps no gradient of its own after the copy
    own = STATE[moment_dtype] + 4  # state + gradient, bytes per parameter
    assert b["moments"] == pytest.approx(STATE[moment_dtype] * n, rel=1e-3)
    # the floor reached: FSDP2's weights + the state + the fp32 gradient
    assert (r["weights"] + b["moments"] + b["grad_fp32"]) / n == pytest.approx(
        FLOOR[moment_dtype], abs=0.01)
    # measured: the state and gradient are allocated (touched), plus only fixed buffers (the
    # CPU-as-device's bucket buffers) and slack, under a quarter of what a second fp32 copy of
    # the weights (4 B/param) would add
    allowance = b["buckets_in_flight"] + SLACK
    assert allowance < n
    assert own * n <= r["growth"] <= own * n + allowance


def _device(rank: int, world: int, mode: str) -> dict:
    """Two bf16-mixed steps on the emulated device with a capacity of half the half weights:
    ``host`` (CPUOffloadPolicy, offload_weights=True), ``unsaid`` (the same model, offload
    weights unset and the optimizer state on the host), ``plain`` (the model unsharded,
    ``offload_fraction="auto"``)."""
    from lightning_zero_offload.testing import emulated_async_device

    model = GPT(CFG) if mode == "plain" else offloaded_gpt(CFG, 1, torch.bfloat16)
    half = 2 * sum(p.numel() for p in model.parameters())
    capacity = half // 2
    cfg = {"host": {"offload_weights": True}, "unsaid": {"offload_fraction": 1.0}}.get(mode, {})
    with emulated_async_device(seed=1, memory_bytes=capacity) as made:
        try:
            engine = ZeroOffload(model, torch.optim.AdamW(_groups(model)), device="cpu",
                                 precision="bf16-mixed", bucket_size_mb=BUCKET_MB, **cfg)
            losses = _steps(engine, model, 2)
        except (MemoryError, torch.OutOfMemoryError) as e:
            return {"error": f"{type(e).__name__}: {e}", "capacity": capacity, "half": half}
        out = {"losses": losses, "peak": made[0].peak_bytes, "capacity": capacity,
               "half": half}
        engine.teardown()
    return out


def test_host_weights_train_within_a_device_smaller_than_the_half_weights() -> None:
    r = run_ranks(_device, 1, "host", timeout=400)[0]
    assert r["capacity"] < r["half"]
    assert "error" not in r, r.get("error")
    assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert 0 < r["peak"] <= r["capacity"]  # the gradient ring only: no weights on the device


@pytest.mark.parametrize("mode, error, words", [
    ("unsaid", "MemoryError", ["all of the optimizer state on the host (weights 37.1"]),
    ("plain", "OutOfMemoryError", ["device weights needs"])])
def test_without_host_weights_the_same_model_does_not_fit(mode: str, error: str,
                                                          words: list[str]) -> None:
    r = run_ranks(_device, 1, mode, timeout=400)[0]
    assert r["capacity"] < r["half"]
    assert r.get("error", "").startswith(error), r
    assert all(w in r["error"] for w in words), r["error"]
