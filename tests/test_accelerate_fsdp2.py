"""ZeroOffloadPlugin with Accelerate's FSDP2 (``fsdp_version=2``), on 2 gloo processes.

Accelerate never takes its FSDP2 path on a machine without a GPU: its state sets the FSDP
distributed type only for GPU-like devices (on the CPU it says ``MULTI_CPU``). Everything after
that choice runs on the CPU, so these tests set the state's distributed type to FSDP after the
``Accelerator`` is built (:func:`_fsdp2_accelerator`, the one step that stands in for a GPU) and
run Accelerate's own ``prepare`` (its auto-wrap policy, mixed precision policy, optimizer switch)
and loop (``accumulate``, ``backward``, ``clip_grad_norm_``) as they are. The real path on CUDA
runs in ``benchmarks/device_check.sh``.
"""

from __future__ import annotations

import os

import pytest
import torch
from _tiny_llama import batch, lm_loss, make, param_groups

pytest.importorskip("accelerate")

from _accelerate_state import reset_accelerate  # noqa: E402
from test_accelerate import _clean_state  # noqa: E402, F401  (autouse: no ZERO_OFFLOAD*, Accelerate reset)

STEPS, ACCUM, LR, MAX_NORM = 10, 2, 1e-2, 0.5




def _fsdp2_accelerator(mixed_precision: str = "no", cuda: bool = False, **plugin_kw: object):
    """An Accelerator set up for FSDP2: on CUDA by Accelerate itself, on the CPU as on a GPU
    machine (the FSDP plugin as Accelerate's state would hold it there, ``set_mixed_precision``
    being what the state calls)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    kw = {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap",
          "transformer_cls_names_to_wrap": ["Block"], **plugin_kw}
    plugin = FullyShardedDataParallelPlugin(**kw)  # type: ignore[arg-type]
    accelerator = Accelerator(cpu=not cuda, fsdp_plugin=plugin, mixed_precision=mixed_precision,
                              gradient_accumulation_steps=ACCUM)
    if not cuda:
        if mixed_precision != "no":
            plugin.set_mixed_precision(mixed_precision)
        as_on_a_gpu(plugin)
    return accelerator


def as_on_a_gpu(plugin: object) -> None:
    """Accelerate's state as its ``AcceleratorState.__init__`` leaves it on a GPU machine with
    an FSDP plugin: the FSDP distributed type (also in ``PartialState``'s, which every later
    ``AcceleratorState()`` copies) and the plugin."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    PartialState().distributed_type = DistributedType.FSDP
    state = AcceleratorState()
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin


def nccl_from_accelerate(rank: int) -> None:
    """Leave the process group to Accelerate, which starts NCCL itself as under ``accelerate
    launch`` (at a port rank 0 chose, the gloo group's store still holding its own)."""
    import torch.distributed as dist
    from _dist import free_port

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


def _train(rank: int, world: int, offload: bool, mixed_precision: str, cuda: bool) -> dict:
    """Accelerate's FSDP2 loop over the tiny Llama (two parameter groups, the final norm
    frozen, accumulation 2, clip 0.5), through ZeroOffloadPlugin or Accelerate alone (torch
    AdamW); the whole weights and the step norms."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_zero_offload.accelerate import ZeroOffloadPlugin

    accelerator = _fsdp2_accelerator(mixed_precision, cuda)
    assert accelerator.is_fsdp2
    model = make(0)
    model.norm.weight.requires_grad_(False)
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]}
              for g in param_groups(model, LR)]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    plugin = ZeroOffloadPlugin(enabled=offload, bucket_size_mb=0.002)
    model, optimizer = plugin.prepare(accelerator, model, optimizer)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            with accelerator.accumulate(model):
                x, y = (t.to(accelerator.device) for t in batch(step, m, rank))
                accelerator.backward(lm_loss(model(x), y))
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor")
                                       else norm))
                optimizer.step()
                optimizer.zero_grad()
    assert accelerator.is_fsdp2  # still: the whole loop ran on Accelerate's FSDP2 path
    engine = plugin.engine
    if engine is not None:
        shard_dtypes = {p.to_local().dtype for p in model.parameters()}  # type: ignore
        weights = {k: v.float().cpu() for k, v in accelerator.get_state_dict(model).items()}
        engine.teardown()
    else:
        shard_dtypes = set()
        weights = {n: p.full_tensor().detach().float().cpu()  # type: ignore[attr-defined]
                   for n, p in model.named_parameters()}
    return {"weights": weights, "norms": norms, "units": units, "shard_dtypes": shard_dtypes}


def _both(rank: int, world: int, mixed_precision: str, cuda: bool = False) -> dict:
    if cuda:
        nccl_from_accelerate(rank)
    else:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    want = _train(rank, world, False, mixed_precision, cuda)
    reset_accelerate()
    return {"want": want, "got": _train(rank, world, True, mixed_precision, cuda)}


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    return (num / sum(float(want[k].double().norm() ** 2) for k in want)) ** 0.5


@pytest.mark.slow
def test_fp32_equals_accelerate_fsdp2_with_torch_adamw() -> None:
    from _dist import run_ranks

    start = {n: p.detach().float() for n, p in make(0).named_parameters()}
    for r in run_ranks(_both, 2, "no", timeout=400):
        got, want = r["got"], r["want"]
        # Accelerate sharded per block (its auto-wrap policy), the final norm and the root
        assert got["units"] == want["units"] == ["", "layers.0", "layers.1", "norm"]
        assert _rel(want["weights"], start) > 1e-2  # training moved the weights
        assert sorted(got["weights"]) == sorted(want["weights"])
        assert _rel(got["weights"], want["weights"]) < 1e-6
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
        assert max(want["norms"]) > MAX_NORM  # clipping was active


@pytest.mark.slow
def test_bf16_shards_in_bf16_and_track_accelerate_fsdp2() -> None:
    """bf16: Accelerate upcasts to fp32 and computes in bf16 (its MixedPrecisionPolicy); the
    engine keeps the device shards in bf16 and the fp32 master on the host."""
    from _dist import run_ranks

    for r in run_ranks(_both, 2, "bf16", timeout=400):
        got, want = r["got"], r["want"]
        assert got["shard_dtypes"] == {torch.bfloat16}
        # as tests/test_fsdp2.py's bf16 bound: bf16 weights from masters that differ by fp32
        # rounding may round apart by one bf16 unit, and so may the gradients they give
        assert _rel(got["weights"], want["weights"]) < 2**-8
        assert got["norms"] == pytest.approx(want["norms"], rel=2**-8)


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accelerate_takes_fsdp2_and_the_engine_equals_torch_adamw() -> None:
    """What only a GPU shows: Accelerate choosing FSDP2 itself (NCCL, one process per GPU, at
    most 2), FSDP2's CUDA streams against the engine's copies, the shards in bf16 on the
    device. fp32 within 1e-5 (CUDA kernels against the host's), bf16 within two bf16 units."""
    from _dist import run_ranks

    world = min(2, torch.cuda.device_count())
    for mixed_precision, bound in (("no", 1e-5), ("bf16", 2**-7)):
        for r in run_ranks(_both, world, mixed_precision, True, timeout=300):
            got, want = r["got"], r["want"]
            assert got["units"] == want["units"] == ["", "layers.0", "layers.1", "norm"]
            if mixed_precision == "bf16":
                assert got["shard_dtypes"] == {torch.bfloat16}
            assert _rel(got["weights"], want["weights"]) < bound
            assert got["norms"] == pytest.approx(want["norms"], rel=bound)


def _resume(rank: int, world: int, folder: str) -> float:
    """6 steps straight, saving after the 3rd, against the last 3 from that checkpoint, through
    ``accelerator.save_state``/``load_state``; the largest weight difference."""
    os.environ["ACCELERATE_USE_CPU"] = "true"
    from lightning_zero_offload.accelerate import ZeroOffloadPlugin

    def run(first: int, load: bool) -> dict:
        reset_accelerate()
        accelerator = _fsdp2_accelerator("no")
        model = make(0)
        optimizer = torch.optim.AdamW(param_groups(model, LR), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        plugin = ZeroOffloadPlugin(enabled=True)
        model, optimizer, scheduler = plugin.prepare(accelerator, model, optimizer, scheduler)
        if load:
            accelerator.load_state(folder)
        for step in range(first, 6):
            for m in range(ACCUM):
                with accelerator.accumulate(model):
                    x, y = batch(step, m, rank)
                    accelerator.backward(lm_loss(model(x), y))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            if step == 2 and not load:
                accelerator.save_state(folder)
        assert accelerator.is_fsdp2
        return accelerator.get_state_dict(model)

    straight, resumed = run(0, False), run(3, True)
    return max(float((straight[k] - resumed[k]).abs().max()) for k in straight)


@pytest.mark.slow
def test_save_state_and_load_state_resume_bit_for_bit(tmp_path) -> None:
    """Accelerate's FSDP branches never see the engine's model and optimizer (torch's DCP
    would step the engine to create an optimizer state): the engine's shards hold both."""
    from _dist import run_ranks

    assert run_ranks(_resume, 2, str(tmp_path / "ckpt"), timeout=400) == [0.0, 0.0]
    assert (tmp_path / "ckpt" / "zero_offload").is_dir()
    assert not list(tmp_path.glob("ckpt/*fsdp*"))


@pytest.mark.parametrize("plugin_kw, match", [
    ({"fsdp_version": 1}, "not FSDP1"),
])
def test_what_cannot_combine_is_refused_by_name(plugin_kw: dict, match: str) -> None:
    from lightning_zero_offload.accelerate import ZeroOffloadPlugin

    accelerator = _fsdp2_accelerator("no", **plugin_kw)
    model = make(0)
    with pytest.raises(ValueError, match=match):
        ZeroOffloadPlugin(enabled=True).prepare(
            accelerator, model, torch.optim.AdamW(model.parameters()))
