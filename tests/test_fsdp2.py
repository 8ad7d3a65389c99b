"""FSDP2 (``fully_shard``) under ZeRO-Offload: FSDP2 shards the weights, the engine holds and
steps each rank's local shards on the host. Against the same ``fully_shard`` model stepped by
torch's own optimizer (+ ``clip_grad_norm_``), on 2 and 4 gloo processes: two parameter groups,
a frozen parameter, accumulation 2, clip 1.0."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _dist import run_ranks
from _helpers import total_rel_err
from _tiny_llama import batch, lm_loss, make, param_groups
from torch import nn

from lightning_zero_offload import ZeroOffload

pytestmark = pytest.mark.slow  # every test spawns gloo processes

STEPS, ACCUM, LR = 20, 2, 1e-2


def _sharded(world: int, half: torch.dtype | None = None) -> nn.Module:
    """The tiny Llama, ``fully_shard``-ed per block and at the root, its final norm frozen;
    ``half``: computed and reduced in that dtype (FSDP2's own mixed precision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make(0)
    model.norm.weight.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    groups = param_groups(model, LR)
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=LR, momentum=0.9)
    if kind == "lion":
        from lion_pytorch import Lion

        return Lion(groups, lr=LR / 10)
    return torch.optim.AdamW(groups, lr=LR)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}


def _reference(rank: int, world: int, kind: str, half: torch.dtype | None,
               build: Callable[[int, torch.dtype | None], nn.Module] | None = None) -> dict:
    """``fully_shard`` + torch's optimizer: FSDP2 accumulates (no reduction until the last
    micro-batch), ``clip_grad_norm_`` over the DTensor gradients; ``build``: the model
    (default :func:`_sharded`)."""
    model = (build or _sharded)(world, half)
    opt = _optimizer(model, kind)
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            model.set_requires_gradient_sync(m == ACCUM - 1)
            x, y = batch(step, m, rank)
            (lm_loss(model(x), y) / ACCUM).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()))
        opt.step()
        opt.zero_grad()
    return {"weights": _full(model), "norms": norms}


def _engine(rank: int, world: int, kind: str, cfg: dict, fsdp: bool = True) -> dict:
    """``cfg["every"]``: every micro-batch reduced (the engine adds them up in fp32), else
    FSDP2 accumulates them unreduced as in the reference; ``fsdp=False``: the same model
    without ``fully_shard`` (the engine's own ZeRO-2)."""
    cfg = dict(cfg)
    every = cfg.pop("every", False)
    model = _sharded(world) if fsdp else make(0).requires_grad_(True)
    if not fsdp:
        model.norm.weight.requires_grad_(False)
    engine = ZeroOffload(model, _optimizer(model, kind), device="cpu", max_grad_norm=1.0,
                         bucket_size_mb=0.002, **cfg)
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            x, y = batch(step, m, rank)
            engine.backward(lm_loss(model(x), y) / ACCUM,
                            sync_gradients=every or m == ACCUM - 1)
        norms.append(float(engine.step()))  # type: ignore[arg-type]
        engine.zero_grad()
    engine.gather_weights()
    whole = _full if fsdp else _full_plain
    dtypes = {n: (p.to_local() if fsdp else p).dtype for n, p in model.named_parameters()}
    engine.teardown()
    return {"weights": whole(model), "norms": norms, "dtypes": dtypes}


def _both(rank: int, world: int, kind: str, cfg: dict) -> dict:
    half = torch.bfloat16 if cfg.get("precision") == "bf16-mixed" else None
    return {"want": _reference(rank, world, kind, half), "got": _engine(rank, world, kind, cfg)}


def _check(out: list[dict], bound: float, norms: float = 1e-5, *,
           of_displacement: bool = False) -> None:
    """Every rank's weights within ``bound`` of the reference's, relative to their size (or,
    ``of_displacement``, to how far the reference moved them), and the same step norms."""
    start = _full_plain(make(0))
    for r in out:
        got, want = r["got"], r["want"]
        moved = {k: want["weights"][k] - start[k] for k in start}
        assert total_rel_err(want["weights"], start) > 1e-2  # the run does change the weights
        diff = {k: got["weights"][k] - want["weights"][k] for k in start}
        scale = moved if of_displacement else want["weights"]
        assert _norm(diff) / _norm(scale) < bound
        assert got["norms"] == pytest.approx(want["norms"], rel=norms)


def _norm(tensors: dict) -> float:
    return sum(float(t.double().norm() ** 2) for t in tensors.values()) ** 0.5


def _full_plain(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_equals_fully_shard_with_torch_adamw(world: int) -> None:
    _check(run_ranks(_both, world, "adamw", {"precision": "32-true"}, timeout=400), 1e-6)


@pytest.mark.parametrize("kind, cfg", [
    ("lion", {}), ("sgd", {}),
    ("adamw", {"offload_fraction": 0.5}), ("adamw", {"offload_fraction": 0.0}),
    ("adamw", {"every": True}),
])
def test_rules_and_placements_equal_fully_shard_with_torch(kind: str, cfg: dict) -> None:
    out = run_ranks(_both, 2, kind, {"precision": "32-true", **cfg}, timeout=400)
    _check(out, 1e-6)


def test_int8_moments_track_fully_shard_with_torch_adamw() -> None:
    # the compact moments' own bound (tests/test_moments_engine.py TRACK["int8"]: parameters
    # within 0.2 of the displacement); their rounding also moves the norms of later steps
    out = run_ranks(_both, 2, "adamw", {"precision": "32-true", "moment_dtype": "int8"},
                    timeout=400)
    _check(out, 0.2, norms=0.2, of_displacement=True)


def _delayed(rank: int, world: int) -> dict:
    cfg = {"precision": "32-true", "delayed_update": True, "delayed_update_warmup": 3}
    return {"want": _engine(rank, world, "adamw", cfg, fsdp=False),
            "got": _engine(rank, world, "adamw", cfg)}


def test_delayed_update_equals_the_engines_own_without_fully_shard() -> None:
    # the same updates, one step stale alike; only the gradients' reduction differs (FSDP2's
    # reduce-scatter against the engine's), by fp32 rounding
    _check(run_ranks(_delayed, 2, timeout=400), 1e-6)


def test_bf16_mixed_shards_are_half_and_train_as_fully_shard_does() -> None:
    out = run_ranks(_both, 2, "adamw", {"precision": "bf16-mixed"}, timeout=400)
    for r in out:
        assert set(r["got"]["dtypes"].values()) == {torch.bfloat16}
    # bf16 weights computed from masters that differ by fp32 rounding (the kernel against torch)
    # may round apart by one bf16 unit (2**-8 relative), and so may the gradients they give
    _check(out, 2**-8, norms=2**-8)


def _mixed_policy(rank: int, world: int) -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make(0)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()), device="cpu",
                         precision="bf16-mixed")
    try:
        model(batch(0, 0, rank)[0])
    except ValueError as e:
        return str(e)
    finally:
        engine.teardown(copy_weights_to_module=False)
    return "trained"


def test_a_mixed_precision_policy_that_disagrees_is_refused_naming_both() -> None:
    for msg in run_ranks(_mixed_policy, 2):
        assert "torch.float16" in msg and "torch.bfloat16" in msg and "param_dtype" in msg


def _unsupported(rank: int, world: int, what: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make(0)
    if what == "hsdp":
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif what == "unmanaged":
        for layer in model.layers:
            fully_shard(layer)
    elif what == "placement":
        from torch.distributed.tensor import Shard

        fully_shard(model, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    try:
        ZeroOffload(model, torch.optim.AdamW(model.parameters()), device="cpu")
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("what, words", [
    ("hsdp", ["HSDP"]), ("unmanaged", ["not sharded by fully_shard", "tok_emb"]),
    ("placement", ["Shard(0)", "shard_placement_fn"])])
def test_what_cannot_combine_is_refused_at_setup(what: str, words: list[str]) -> None:
    for msg in run_ranks(_unsupported, 2, what):
        assert all(w in msg for w in words), msg


def _race(rank: int, world: int, skip: set[str]) -> str:
    """Three bf16 steps of the ``fully_shard`` model on the emulated asynchronous device,
    ``skip`` waits dropped: "clean", or the race detector's message."""
    import contextlib

    from lightning_zero_offload.testing import StreamOrderError, emulated_async_device

    with emulated_async_device(seed=1 + rank, skip_waits=skip):
        model = _sharded(world)
        engine = ZeroOffload(model, _optimizer(model, "adamw"), device="cpu",
                             precision="bf16-mixed", bucket_size_mb=0.002)
        try:
            for step in range(3):
                x, y = batch(step, 0, rank)
                engine.backward(lm_loss(model(x), y))
                engine.step()
                engine.zero_grad()
            engine.synchronize()
        except StreamOrderError as e:
            return str(e)
        finally:
            with contextlib.suppress(Exception):
                engine.teardown(copy_weights_to_module=False)
    return "clean"


# wait kind -> what the race detector names when it is dropped (the shards FSDP2 all-gathers
# are the device weights here)
RACES = {
    "": "clean",
    "compute_waits": r"device weights.*h2d stream.*compute stream",
    "stream_waits_compute:d2h": r"bucket buffer on the d2h stream.*compute stream.*rule 3",
    "event_wait": r"staging slice on the (host|h2d) stream.*d2h stream.*rule 1",
}


@pytest.mark.parametrize("kind", sorted(RACES))
def test_each_wait_around_fsdp2s_shards_is_needed(kind: str) -> None:
    import re

    [got] = run_ranks(_race, 1, {kind} if kind else set())
    assert re.search(RACES[kind], got), got


def _streaming(rank: int, world: int) -> dict:
    """When the first block's reduced gradients arrive (FSDP2 reduces that unit last but the
    root's), how many buckets the engine has already sent to the host; and how many
    reduce-scatters a backward with ``sync_gradients=False`` makes."""
    model = _sharded(world)
    engine = ZeroOffload(model, _optimizer(model, "adamw"), device="cpu", bucket_size_mb=0.002)
    flushed: list[int] = []
    first = next(model.layers[0].parameters())
    first.register_post_accumulate_grad_hook(
        lambda p: flushed.append(sum(engine._streamer.flushes)))
    reductions = []
    for unit in [*model.layers, model]:
        unit.set_all_reduce_hook(lambda t: reductions.append(t.numel()))
    x, y = batch(0, 0, rank)
    engine.backward(lm_loss(model(x), y), sync_gradients=False)
    unsynced = len(reductions)
    engine.backward(lm_loss(model(x), y))
    engine.step()
    buckets = len(engine.layout.buckets)
    engine.teardown()
    return {"flushed": flushed, "buckets": buckets, "unsynced": unsynced,
            "synced": len(reductions) - unsynced}


def test_gradients_stream_to_the_host_as_fsdp2_reduces_each_unit() -> None:
    for r in run_ranks(_streaming, 2):
        # the second block's buckets went before the first block's gradients arrived (the
        # root unit's parameters, reduced after the whole backward, are laid out last)
        assert r["flushed"] and 0 < r["flushed"][0] < r["buckets"]
        # no_sync reaches FSDP2: no reduce-scatter until the synchronizing backward
        assert r["unsynced"] == 0 and r["synced"] == 3


def _two_d(rank: int, world: int, engine_run: bool, names: tuple = (), carried: bool = False
           ) -> dict:
    """FSDP2 over "data_parallel" x tensor parallelism over "tensor_parallel" (2 x 2), the
    torchtitan layout; torch's AdamW + clip_grad_norm_, or the engine. ``names``: the mesh's
    dimensions; ``carried``: the engine is not given the mesh (it finds it on the parameters, as
    on a Hugging Face model loaded with fsdp x tp)."""
    from _tiny_llama import parallelize
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp, tp = names or ("data_parallel", "tensor_parallel")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(dp, tp))
    model = make(0)
    model.norm.weight.requires_grad_(False)
    parallelize(model, mesh[tp])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh[dp])
    fully_shard(model, mesh=mesh[dp])
    opt = _optimizer(model, "adamw")
    part = mesh[dp].get_local_rank()
    engine = (ZeroOffload(model, opt, device="cpu", device_mesh=None if carried else mesh,
                          max_grad_norm=1.0, bucket_size_mb=0.002, precision="32-true")
              if engine_run else None)
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            x, y = batch(step, m, part)
            loss = lm_loss(model(x), y) / ACCUM
            if engine is not None:
                engine.backward(loss, sync_gradients=m == ACCUM - 1)
            else:
                model.set_requires_gradient_sync(m == ACCUM - 1)
                loss.backward()
        if engine is not None:
            norms.append(float(engine.step()))  # type: ignore[arg-type]
            engine.zero_grad()
        else:  # torch's clip_grad_norm_ cannot stack norms of two meshes: the same, by hand
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = sum(float(g.full_tensor().double().pow(2).sum()) for g in grads) ** 0.5
            for g in grads:
                g.mul_(min(1.0, 1.0 / (norm + 1e-6)))
            norms.append(norm)
            opt.step()
            opt.zero_grad()
    if engine is not None:
        engine.teardown()
    return {"weights": _full(model), "norms": norms}


def _two_d_both(rank: int, world: int, names: tuple = (), carried: bool = False) -> dict:
    return {"want": _two_d(rank, world, False, names, carried),
            "got": _two_d(rank, world, True, names, carried)}


def test_fsdp2_over_data_parallel_times_tensor_parallel_equals_torch_adamw() -> None:
    _check(run_ranks(_two_d_both, 4, timeout=400), 1e-6)


def test_a_2d_mesh_the_model_carries_counts_tensor_parallel_copies_once() -> None:
    # Hugging Face's DistributedConfig(fsdp_size=2, tp_size=2) gives a ("fsdp", "tp") mesh the
    # engine is not told about: the norms' weights, alike on both tensor-parallel ranks, count once
    _check(run_ranks(_two_d_both, 4, ("fsdp", "tp"), True, timeout=400), 1e-6)


def _evaluated_between(rank: int, world: int, cfg: dict) -> dict:
    """backward, a no-grad forward (metrics), step, forward: the last forward's output, with
    the engine and with torch's AdamW after FSDP2's ``reshard()`` (the fresh weights)."""
    out = {}
    for who in ("engine", "torch"):
        model = _sharded(world)
        opt = _optimizer(model, "adamw")
        engine = (ZeroOffload(model, opt, device="cpu", precision="32-true", **cfg)
                  if who == "engine" else None)
        x, y = batch(0, 0, rank)
        loss = lm_loss(model(x), y)
        engine.backward(loss) if engine is not None else loss.backward()
        with torch.no_grad():
            model(x)  # FSDP2 keeps the root unit gathered after this forward
        if engine is not None:
            engine.step()
        else:
            model.reshard()
            opt.step()
        with torch.no_grad():
            out[who] = model(x)
        if engine is not None:
            engine.teardown()
    return out


@pytest.mark.parametrize("cfg", [{}, {"offload_fraction": 0.0}])
def test_a_forward_between_backward_and_step_does_not_leave_stale_weights(cfg: dict) -> None:
    for r in run_ranks(_evaluated_between, 2, cfg):
        assert torch.allclose(r["engine"], r["torch"], rtol=1e-5, atol=1e-6)
