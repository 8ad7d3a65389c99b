"""FSDP2 (``fully_shard``) under the engine: what a rank holds (issue 46, "Memory").

A tiny Llama whose every first dimension divides by 4, so ``fully_shard`` cuts each parameter
evenly, trained 2 steps in ``bf16-mixed`` without accumulation on the emulated asynchronous
device, at 1 and at 4 gloo ranks: a rank's host bytes are a quarter of one rank's but for the
engine's fixed buffers, its floor is master + moments + gradient staging per local parameter,
the device holds FSDP2's shards in bf16 and nothing in fp32, and the engine's own device bytes
are what ``lzo-plan --fsdp`` counts."""

from __future__ import annotations

import functools

import pytest
import torch
from _dist import run_ranks
from _tiny_llama import batch, lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.core.limits import BUCKET_BUFFERS

pytestmark = pytest.mark.slow  # every test reads what spawned gloo processes measured

MOMENTS = ("fp32", "int8")
VOCAB, DIM, HIDDEN, LAYERS = 128, 64, 128, 4
# the largest parameters in bf16 (the MLP's 128 x 64 matrices, the embedding, the output), so
# the engine's buckets, which never cut a parameter, fill to the size the planner assumes
BUCKET_MB = HIDDEN * DIM * 2 / 2**20
# what exists only because the CPU is the compute device (benchmarks/host_memory.CPU_ONLY)
CPU_ONLY = ("device_weights", "device_untrained", "buckets_in_flight", "device_state")


def _sharded(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make(0, vocab=VOCAB, dim=DIM, layers=LAYERS, hidden=HIDDEN)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _probe(rank: int, world: int) -> dict[str, dict]:
    """Per moment format: the engine's host budget, its layout's sizes, the emulated device's
    peak and what the shards are after 2 steps."""
    from lightning_zero_offload.testing import emulated_async_device

    out = {}
    for moment_dtype in MOMENTS:
        model = _sharded(world)
        with emulated_async_device(seed=1 + rank, max_delay_ms=0.5) as made:
            engine = ZeroOffload(model, torch.optim.AdamW(param_groups(model)), device="cpu",
                                 precision="bf16-mixed", moment_dtype=moment_dtype,
                                 accumulate=False, bucket_size_mb=BUCKET_MB)
            for step in range(2):
                x, y = batch(step, 0, rank, vocab=VOCAB)
                engine.backward(lm_loss(model(x), y))
                engine.step()
                engine.zero_grad()
            engine.synchronize()
            shards = [p.to_local() for p in model.parameters()]
            out[moment_dtype] = {
                "budget": dict(engine.host_budget), "host_bytes": engine.host_bytes,
                "laid": engine.layout.shard_numel, "params": engine.layout.param_numel,
                "buckets": len(engine.layout.buckets),
                "max_bucket": max(b.numel for b in engine.layout.buckets),
                "device_peak": made[0].peak_bytes,
                "shard_dtypes": {t.dtype for t in shards},
                "shard_bytes": sum(t.numel() * t.element_size() for t in shards)}
            engine.teardown()
    return out


@functools.cache
def _runs() -> dict[int, list[dict]]:
    """One run at 1 rank and one at 4, shared by the tests of this module."""
    return {world: run_ranks(_probe, world, timeout=400) for world in (1, 4)}


def _floor(r: dict) -> int:
    return sum(v for k, v in r["budget"].items() if k not in CPU_ONLY)


def _padding(r: dict) -> float:
    """What the layout's padding costs in the floor (its bytes per laid-out element), plus a
    64-byte line per staging slice."""
    return _floor(r) / r["laid"] * (r["laid"] - r["params"]) + 64 * r["buckets"]


def _fixed(r: dict) -> float:
    """The bytes of an engine that do not scale with its parameters: the bucket buffers in
    flight (with the CPU as the device; three buckets' worth on a GPU) and the padding."""
    return r["budget"]["buckets_in_flight"] + _padding(r)


@pytest.mark.parametrize("moment_dtype", MOMENTS)
def test_a_ranks_host_bytes_at_4_ranks_are_a_quarter_of_one_ranks_within_the_fixed_buffers(
        moment_dtype: str) -> None:
    one = _runs()[1][0][moment_dtype]
    four = [r[moment_dtype] for r in _runs()[4]]
    for r in four:
        assert 4 * r["params"] == one["params"]  # every parameter cut evenly
        # the floor (master, moments, staging) is the rank's share but for the padding, and so
        # is all the engine holds but for its fixed buffers: nothing of the whole model
        assert abs(_floor(r) - _floor(one) / 4) <= _padding(r) + _padding(one) / 4
        assert abs(r["host_bytes"] - one["host_bytes"] / 4) <= _fixed(r) + _fixed(one) / 4
    # the ranks step distinct shards: together they hold one rank's floor but for the padding
    assert abs(sum(_floor(r) for r in four) - _floor(one)) <= sum(
        _padding(r) for r in four) + _padding(one)


@pytest.mark.parametrize("moment_dtype, floor", [("fp32", 4 + 8 + 2), ("int8", 4 + 2 + 2)])
def test_the_host_floor_is_master_moments_and_staging_per_local_parameter(
        moment_dtype: str, floor: int) -> None:
    """Without accumulation: the fp32 master (4), the moments (fp32 8, int8 2 and an fp32
    scale per 256 elements of each) and the bf16 gradient staging (2) per laid-out element,
    each staging slice on a 64-byte line."""
    scales = 2 * 4 / 256 if moment_dtype == "int8" else 0
    for world in (1, 4):
        for r in (x[moment_dtype] for x in _runs()[world]):
            assert r["budget"]["grad_fp32"] == 0
            per = floor + scales
            assert per * r["laid"] <= _floor(r) <= per * r["laid"] + 64 * r["buckets"] + 8


def _planned(world: int, moment_dtype: str):  # noqa: ANN202
    from lightning_zero_offload.planner import plan

    total = sum(p.numel() for p in make(0, vocab=VOCAB, dim=DIM, layers=LAYERS,
                                        hidden=HIDDEN).parameters())
    return plan(total, world_size=world, fsdp=True, precision="bf16-mixed",
                moment_dtype=moment_dtype, offload_fraction=1.0, bucket_size_mb=BUCKET_MB,
                measure=False)


@pytest.mark.parametrize("world", [1, 4])
def test_the_device_holds_fsdp2s_shards_in_bf16_only(world: int) -> None:
    """No fp32 shard: FSDP2's local shards are bf16, 2 bytes per local parameter, which is
    ``lzo-plan --fsdp``'s count of the sharded weights within 5% (it cuts the count evenly,
    FSDP2 cuts each parameter's rows)."""
    for moment_dtype in MOMENTS:
        planned = _planned(world, moment_dtype)
        for r in (x[moment_dtype] for x in _runs()[world]):
            assert r["shard_dtypes"] == {torch.bfloat16}
            assert r["shard_bytes"] == 2 * r["params"]
            assert r["shard_bytes"] == pytest.approx(planned.device_weight_bytes, rel=0.05)


# FSDP2 hands a unit's reduced gradients over in the unit's registration order, all at once;
# the layout follows that order (core.dist.fsdp.Fsdp.backward_order), so a unit's buckets complete
# one after the other and the ring's slots suffice (laid out in reverse, at 1 rank every bucket
# of a block opened at once and the device held twice the ring).
@pytest.mark.parametrize("world", [1, 4])
def test_the_engines_device_bytes_are_its_bf16_ring_as_the_planner_counts(world: int) -> None:
    """The engine's own device allocations (the emulated device's peak) are its ring of bf16
    bucket buffers, exactly, and ``lzo-plan --fsdp``'s count of them within 5%."""
    for moment_dtype in MOMENTS:
        planned = _planned(world, moment_dtype)
        for r in (x[moment_dtype] for x in _runs()[world]):
            assert r["device_peak"] == BUCKET_BUFFERS * 2 * r["max_bucket"]
            assert r["device_peak"] == pytest.approx(planned.device_engine_bytes, rel=0.05)
