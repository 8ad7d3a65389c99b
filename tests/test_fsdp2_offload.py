"""FSDP2's ``CPUOffloadPolicy`` under ZeRO-Offload: the host shards are the master, stepped in
place under the next forward. Against the same ``fully_shard(..., offload_policy=...)`` model
stepped by torch's own optimizer (+ ``clip_grad_norm_``), on 1 and 2 gloo processes: two
parameter groups, a frozen parameter, accumulation 2, clip 1.0; the overlapped step against the
unoverlapped one, bit for bit."""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_ranks
from _tiny_llama import batch, lm_loss, make
from test_fsdp2 import _full, _optimizer
from test_fsdp2 import _reference as fsdp2_reference
from torch import nn

from lightning_zero_offload import ZeroOffload

pytestmark = pytest.mark.slow  # every test spawns gloo processes

STEPS, ACCUM, LR = 20, 2, 1e-2


def _offloaded(world: int, half: torch.dtype | None = None) -> nn.Module:
    """The tiny Llama ``fully_shard``-ed per block and at the root with its weights on the host
    (no pinning: this machine has no CUDA), its final norm frozen; ``half``: FSDP2 computes and
    reduces in that dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = make(0)
    model.norm.weight.requires_grad_(False)
    kw = dict(mesh=init_device_mesh("cpu", (world,)),
              mp_policy=MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half),
              offload_policy=CPUOffloadPolicy(pin_memory=False))
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _reference(rank: int, world: int, kind: str, half: torch.dtype | None) -> dict:
    """FSDP2 with ``CPUOffloadPolicy`` and torch's optimizer, as its users run it."""
    return fsdp2_reference(rank, world, kind, half, build=_offloaded)


def _engine(rank: int, world: int, kind: str, cfg: dict, steps: int = STEPS) -> dict:
    half = torch.bfloat16 if cfg.get("precision") == "bf16-mixed" else None
    model = _offloaded(world, half)
    engine = ZeroOffload(model, _optimizer(model, kind), device="cpu", max_grad_norm=1.0,
                         bucket_size_mb=0.002, offload_weights=True,
                         **{"precision": "32-true", **cfg})
    norms = []
    for step in range(steps):
        for m in range(ACCUM):
            x, y = batch(step, m, rank)
            engine.backward(lm_loss(model(x), y) / ACCUM, sync_gradients=m == ACCUM - 1)
        norms.append(float(engine.step()))  # type: ignore[arg-type]
        engine.zero_grad()
    engine.synchronize()
    out = {"weights": _full(model), "norms": norms, "budget": engine.host_budget,
           "shard_dtypes": {p.to_local().dtype for p in model.parameters()}}
    engine.teardown()
    return out


def _cases(rank: int, world: int, kind: str, cfg: dict) -> dict:
    half = torch.bfloat16 if cfg.get("precision") == "bf16-mixed" else None
    return {"want": _reference(rank, world, kind, half),
            "overlapped": _engine(rank, world, kind, cfg),
            "unoverlapped": _engine(rank, world, kind, {**cfg, "overlap_host_step": False})}


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in b)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


def _check(out: list[dict], bound: float, norms: float = 1e-5, *,
           of_displacement: bool = False) -> None:
    """Every rank: the overlapped weights bit for bit the unoverlapped ones, within ``bound``
    of the reference (relative to the weights, or ``of_displacement`` to how far the reference
    moved them), the same step norms; the master is FSDP2's (no host master of the engine's)."""
    start = {n: p.detach().float() for n, p in make(0).named_parameters()}
    for r in out:
        want, got, slow = r["want"], r["overlapped"], r["unoverlapped"]
        assert _rel(want["weights"], start) > 1e-2  # the run does change the weights
        assert all(torch.equal(got["weights"][k], slow["weights"][k]) for k in start)
        assert got["norms"] == slow["norms"]
        scale = ({k: want["weights"][k] - start[k] for k in start} if of_displacement
                 else want["weights"])
        diff = {k: got["weights"][k] - want["weights"][k] for k in start}
        num = sum(float(d.double().norm() ** 2) for d in diff.values()) ** 0.5
        den = sum(float(s.double().norm() ** 2) for s in scale.values()) ** 0.5
        assert num / den < bound
        assert got["norms"] == pytest.approx(want["norms"], rel=norms)
        assert got["budget"]["master"] == 0 and "device_weights" not in got["budget"]
        assert got["shard_dtypes"] == {torch.float32}


@pytest.mark.parametrize("world", [1, 2])
def test_fp32_equals_fully_shard_offload_with_torch_adamw(world: int) -> None:
    _check(run_ranks(_cases, world, "adamw", {}, timeout=400), 1e-6)


@pytest.mark.parametrize("kind", ["lion", "sgd"])
def test_lion_and_sgd_equal_fully_shard_offload_with_torch(kind: str) -> None:
    _check(run_ranks(_cases, 2, kind, {}, timeout=400), 1e-6)


def test_int8_moments_track_fully_shard_offload_with_torch_adamw() -> None:
    # the compact moments' own bound (tests/test_moments_engine.py TRACK["int8"]), and their
    # rounding moves the norms of later steps; int8 blocks end inside parameters here (the
    # tail of each goes through the kernel's buffer)
    out = run_ranks(_cases, 2, "adamw", {"moment_dtype": "int8"}, timeout=400)
    _check(out, 0.2, norms=0.2, of_displacement=True)


def test_bf16_mixed_trains_as_fully_shard_offload_does() -> None:
    # FSDP2 casts the same fp32 shards to bf16 for both; the masters differ by fp32 rounding
    # (the kernel against torch), so the bf16 weights may round one unit (2**-8) apart
    _check(run_ranks(_cases, 2, "adamw", {"precision": "bf16-mixed"}, timeout=400),
           2**-8, norms=2**-8)


def _slow_kernel() -> None:
    """Each bucket's host update takes 10 ms more, so the next forward catches up with it."""
    from lightning_zero_offload.core.buckets import shard

    step = shard.HostShard.step

    def slow(self: object, *args: object, **kwargs: object) -> None:
        time.sleep(0.01)
        step(self, *args, **kwargs)  # type: ignore[arg-type]
    shard.HostShard.step = slow  # type: ignore[method-assign]


def _train(rank: int, world: int, steps: int, cfg: dict, *, no_waits: bool = False) -> dict:
    """``steps`` steps with the slowed kernel; the profile and the weights ``state_dict()``
    reads right after the last ``step()`` (the update may still run)."""
    from lightning_zero_offload.core.step import overlap

    _slow_kernel()
    if no_waits:  # the mutation: each unit's forward no longer waits for its update
        overlap.OverlappedStep._waiter = lambda self, u: lambda *_: None  # type: ignore
    model = _offloaded(world)
    engine = ZeroOffload(model, _optimizer(model, "adamw"), device="cpu", bucket_size_mb=0.002,
                         offload_weights=True, precision="32-true", **cfg)
    for step in range(steps):
        x, y = batch(step, 0, rank)
        engine.backward(lm_loss(model(x), y))
        engine.step()
        engine.zero_grad()
    read = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    spans = {r.step: r.spans for r in engine.profile}
    engine.teardown()
    return {"read": read, "spans": spans}


def _timelines(rank: int, world: int) -> dict:
    return {"overlapped": _train(rank, world, 3, {}),
            "unoverlapped": _train(rank, world, 3, {"overlap_host_step": False})}


def test_the_update_runs_under_the_next_forward_in_its_order() -> None:
    for r in run_ranks(_timelines, 2, timeout=400):
        # step 2's update and step 3's forward (both recorded under step 2)
        spans = r["overlapped"]["spans"][2]
        updates = sorted((s, e, int(n.split(":")[1])) for n, s, e in spans
                         if n.startswith("unit_update:"))
        forwards = {int(n.split(":")[1]): e for n, s, e in spans if n.startswith("unit_wait:")}
        units = [u for _, _, u in updates]
        assert units == sorted(units) and len(set(units)) == 3  # root, block 0, block 1
        assert forwards[0] < max(e for _, e, _ in updates)  # the forward began before the end
        for u, began in forwards.items():  # and each unit's forward after its own update
            assert began >= max(e for _, e, v in updates if v in (u, u + 1))
        # what state_dict() read right after step() includes the whole update
        read, want = r["overlapped"]["read"], r["unoverlapped"]["read"]
        assert all(torch.equal(read[k], want[k]) for k in want)


def _without_waits(rank: int, world: int) -> dict:
    return {"no_waits": _train(rank, world, 3, {}, no_waits=True)["read"],
            "unoverlapped": _train(rank, world, 3, {"overlap_host_step": False})["read"]}


def test_without_the_waits_the_forward_reads_stale_weights() -> None:
    # the mutation the test above guards: the forward runs on weights the worker is still
    # writing, so the run departs from the unoverlapped one
    for r in run_ranks(_without_waits, 1, timeout=400):
        got, want = r["no_waits"], r["unoverlapped"]
        assert not all(torch.equal(got[k], want[k]) for k in want)


def _resume(rank: int, world: int, path: str, sharded: bool, moments: str) -> dict:
    def engine_for(model: nn.Module) -> ZeroOffload:
        return ZeroOffload(model, _optimizer(model, "adamw"), device="cpu", max_grad_norm=1.0,
                           bucket_size_mb=0.002, offload_weights=True, precision="32-true",
                           moment_dtype=moments)

    def steps(engine: ZeroOffload, model: nn.Module, begin: int, end: int) -> None:
        for step in range(begin, end):
            x, y = batch(step, 0, rank)
            engine.backward(lm_loss(model(x), y))
            engine.step()
            engine.zero_grad()

    model = _offloaded(world)
    engine = engine_for(model)
    steps(engine, model, 0, 10)
    engine.save_checkpoint(path, sharded=sharded)
    steps(engine, model, 10, 16)
    engine.synchronize()  # the last update may still run: reading the shards directly waits
    straight = _full(model)
    engine.teardown()
    model = _offloaded(world)
    engine = engine_for(model)
    engine.load_checkpoint(path)
    steps(engine, model, 10, 16)
    engine.synchronize()
    resumed = _full(model)
    engine.teardown()
    return {"straight": straight, "resumed": resumed}


# sharded files keep the int8 codes as they are; the consolidated file is torch AdamW's format
# (fp32 moments), which int8 moments would round again on load
@pytest.mark.parametrize("sharded, moments", [(True, "int8"), (False, "fp32")])
def test_a_resume_is_bit_for_bit(tmp_path: object, sharded: bool, moments: str) -> None:
    for r in run_ranks(_resume, 2, str(tmp_path) + "/ckpt", sharded, moments, timeout=400):
        assert all(torch.equal(r["resumed"][k], r["straight"][k]) for k in r["straight"])


def _refused(rank: int, world: int, what: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cfg: dict = {"offload_weights": True}
    if what == "plain":
        model = make(0)
    elif what == "bf16 shards":
        model = make(0).to(torch.bfloat16)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)),
                    offload_policy=CPUOffloadPolicy(pin_memory=False))
    else:
        model = _offloaded(world)
        cfg.update({"delayed_update": {"delayed_update": True},
                    "fraction": {"offload_fraction": 0.5}}[what])
    try:
        ZeroOffload(model, torch.optim.AdamW(model.parameters()), device="cpu", **cfg)
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("what, words", [
    ("plain", ["CPUOffloadPolicy", "offload_weights"]),
    ("bf16 shards", ["fp32 master", "torch.bfloat16", "MixedPrecisionPolicy"]),
    ("delayed_update", ["delayed_update=False"]), ("fraction", ["offload_fraction=0.5"])])
def test_what_cannot_combine_with_host_weights_is_refused(what: str, words: list[str]) -> None:
    for msg in run_ranks(_refused, 1, what):
        assert all(w in msg for w in words), msg
