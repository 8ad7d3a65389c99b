"""ZeroOffloadTrainer with the Trainer's FSDP2 (``fsdp="full_shard"``, ``fsdp_version`` 2)
against the plain Trainer's FSDP2 run (torch AdamW), on 2 gloo processes.

Accelerate never takes its FSDP2 path on a machine without a GPU (its state says ``MULTI_CPU``
there); :class:`_AsOnAGpu` sets the state as Accelerate sets it on a GPU machine, right after
the Trainer builds its Accelerator, and everything else (the Trainer's FSDP2 branch, Accelerate's
``fully_shard`` by the Trainer's ``transformer_layer_cls_to_wrap``, its optimizer switch) runs
as it is. The real path on CUDA runs in ``benchmarks/device_check.sh``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from _accelerate_state import reset_accelerate  # noqa: E402
from test_transformers import _clean_state  # noqa: E402, F401  (autouse: no ZERO_OFFLOAD*, Accelerate reset)

FSDP2 = {"fsdp": "full_shard",
         "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}




def _as_on_a_gpu(base: type) -> type:
    """``base`` (a Trainer class) whose Accelerator's state holds the FSDP plugin the Trainer
    asked for, as Accelerate's state does on a GPU machine."""

    class _AsOnAGpu(base):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            from accelerate.utils import FullyShardedDataParallelPlugin
            from test_accelerate_fsdp2 import as_on_a_gpu

            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            if self.accelerator.mixed_precision != "no":
                plugin.set_mixed_precision(self.accelerator.mixed_precision)
            as_on_a_gpu(plugin)
            self.is_fsdp_enabled = True

    return _AsOnAGpu


def _train(out: str, offload: bool, cuda: bool, **kw: object) -> dict:
    """The Trainer's FSDP2 run, with ZeRO-Offload or without (torch AdamW); on CUDA as
    Accelerate sets it up itself, on the CPU as it would on a GPU machine."""
    from test_transformers import _args, _Data, _history, _model
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer

    from lightning_zero_offload.transformers import ZeroOffloadTrainer, ZeroOffloadTrainingArguments

    kw = {**FSDP2, **kw, "use_cpu": not cuda}
    if offload:
        cls: type = ZeroOffloadTrainer
        args = _args(out, ZeroOffloadTrainingArguments, zero_offload=True, **kw)
    else:
        cls, args = Trainer, _args(out, **kw)
    cls = cls if cuda else _as_on_a_gpu(cls)
    trainer = cls(model=_model(), args=args, train_dataset=_Data())
    trainer.train()
    engine = getattr(trainer, "zero_offload_engine", None)
    names = [n for n, _ in trainer.model.named_parameters()]
    if engine is not None:
        master = engine.full_state_dict(optimizer=False)["model"]
        weights = {n: master[n].float().cpu() for n in names}
    else:
        weights = {n: p.full_tensor().detach().float().cpu()
                   for n, p in trainer.model.named_parameters()}
    units = [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
    return {"history": _history(trainer), "weights": weights, "units": units,
            "engine": engine is not None}


def _both(rank: int, world: int, out: str, kw: dict, cuda: bool = False) -> dict:
    if cuda:
        from test_accelerate_fsdp2 import nccl_from_accelerate

        nccl_from_accelerate(rank)
    else:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    want = _train(f"{out}/plain", False, cuda, **kw)
    reset_accelerate()
    return {"want": want, "got": _train(f"{out}/zo", True, cuda, **kw)}


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    return (num / sum(float(want[k].double().norm() ** 2) for k in want)) ** 0.5


@pytest.mark.slow
def test_fp32_equals_the_trainers_fsdp2_with_torch_adamw(tmp_path) -> None:
    from _dist import run_ranks

    for r in run_ranks(_both, 2, str(tmp_path), {}, timeout=400):
        got, want = r["got"], r["want"]
        assert got["engine"] and not want["engine"]
        assert got["units"] == want["units"]
        assert "model.layers.0" in got["units"]  # sharded per decoder layer, as asked
        assert got["history"][0] == pytest.approx(want["history"][0], rel=1e-5)  # losses
        assert got["history"][1] == pytest.approx(want["history"][1], rel=1e-5)  # grad norms
        assert max(want["history"][1]) > 0.5  # the Trainer's max_grad_norm clipped
        assert _rel(got["weights"], want["weights"]) < 1e-6


@pytest.mark.slow
def test_bf16_tracks_the_trainers_fsdp2(tmp_path) -> None:
    from _dist import run_ranks

    for r in run_ranks(_both, 2, str(tmp_path), {"bf16": True}, timeout=400):
        got, want = r["got"], r["want"]
        # bf16 weights from masters that differ by fp32 rounding may round a bf16 unit apart
        # (2**-8), and so may the gradients they give: two units after 6 steps (measured 3e-3)
        assert got["history"][0] == pytest.approx(want["history"][0], rel=2**-8)
        assert _rel(got["weights"], want["weights"]) < 2**-7


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_trainers_fsdp2_under_the_engine_tracks_its_own(tmp_path) -> None:
    """What only a GPU shows: the Trainer and Accelerate choosing FSDP2 themselves (NCCL, one
    process per GPU, at most 2), bf16 shards on the device, FSDP2's CUDA streams against the
    engine's copies."""
    from _dist import run_ranks

    world = min(2, torch.cuda.device_count())
    for r in run_ranks(_both, world, str(tmp_path), {"bf16": True}, True, timeout=300):
        got, want = r["got"], r["want"]
        assert got["engine"] and got["units"] == want["units"]
        assert got["history"][0] == pytest.approx(want["history"][0], rel=2**-7)
        assert _rel(got["weights"], want["weights"]) < 2**-7


def _resume(rank: int, world: int, out: str) -> tuple:
    from test_transformers import _args, _Data, _history, _model

    from lightning_zero_offload.transformers import ZeroOffloadTrainer, ZeroOffloadTrainingArguments

    os.environ["ACCELERATE_USE_CPU"] = "true"

    def run(folder: str, resume: str | None = None) -> tuple:
        reset_accelerate()
        trainer = _as_on_a_gpu(ZeroOffloadTrainer)(
            model=_model(), train_dataset=_Data(),
            args=_args(folder, ZeroOffloadTrainingArguments, zero_offload=True,
                       save_strategy="steps", save_steps=3, **FSDP2))
        trainer.train(resume_from_checkpoint=resume)
        engine = trainer.zero_offload_engine
        return engine.full_state_dict(optimizer=False)["model"], _history(trainer)[0]

    straight, losses = run(f"{out}/a")
    resumed, resumed_losses = run(f"{out}/b", f"{out}/a/checkpoint-3")
    return max(float((straight[k] - resumed[k]).abs().max()) for k in straight), losses, \
        resumed_losses


@pytest.mark.slow
def test_resume_from_checkpoint_equals_straight_run(tmp_path) -> None:
    """The Trainer's FSDP branch would load the weights from FSDP's own files after the
    engine is built; the engine's shards hold them (the mixin skips that load)."""
    from _dist import run_ranks

    for diff, losses, resumed in run_ranks(_resume, 2, str(tmp_path), timeout=400):
        assert diff == 0.0
        assert resumed == losses  # the first 3 come from the checkpoint's log history
    assert (tmp_path / "a" / "checkpoint-3" / "zero_offload").is_dir()

