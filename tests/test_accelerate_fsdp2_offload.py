"""Accelerate's FSDP2 with ``fsdp_offload_params`` (FSDP2's ``CPUOffloadPolicy``: the weights
live on the host) through ZeroOffloadPlugin, and the transformers Trainer's FSDP2 with
``offload`` through ZeroOffloadTrainer, against the same runs without ZeRO-Offload (torch
AdamW on FSDP2's host shards), fp32, 2 gloo processes, in one spawn.

As tests/test_accelerate_fsdp2.py and tests/test_transformers_fsdp2.py do on the CPU (their
loops are reused here), Accelerate's state is set as on a GPU machine; one more step stands in
for the GPU: Accelerate's ``CPUOffloadPolicy()`` pins the host shards, which needs CUDA, so the
plugin's policy is swapped for ``CPUOffloadPolicy(pin_memory=False)`` (:func:`_unpinned`).
The offload is asked for the way each front end asks: ``FSDP_OFFLOAD_PARAMS=true`` (what
``accelerate launch`` sets from ``fsdp_offload_params: true``) and ``fsdp="full_shard offload"``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

import test_accelerate_fsdp2 as accel  # noqa: E402
import test_transformers_fsdp2 as trainer  # noqa: E402
from _accelerate_state import reset_accelerate  # noqa: E402
from test_accelerate import _clean_state  # noqa: E402, F401  (autouse: no ZERO_OFFLOAD*, Accelerate reset)


def _unpinned(as_on_a_gpu):
    """``as_on_a_gpu`` whose plugin keeps its host shards unpinned (no CUDA here)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    def call(plugin) -> None:
        assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # the offload was asked for
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        as_on_a_gpu(plugin)
    return call


def _master_bytes(built: list[int]):
    """ZeroOffload whose every engine appends the host bytes of its own weight copy to
    ``built`` (0: FSDP2's host shards are the master)."""
    from lightning_zero_offload.core import ZeroOffload

    init = ZeroOffload.__init__

    def spy(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        built.append(self.host_budget["master"])
    return spy


def _all(rank: int, world: int, out: str) -> dict:
    from lightning_zero_offload.core import ZeroOffload

    accel.as_on_a_gpu = _unpinned(accel.as_on_a_gpu)  # read by both loops at call time
    built: list[int] = []
    ZeroOffload.__init__ = _master_bytes(built)  # type: ignore[method-assign]
    os.environ["FSDP_OFFLOAD_PARAMS"] = "true"
    results = {"accelerate": accel._both(rank, world, "no")}
    del os.environ["FSDP_OFFLOAD_PARAMS"]
    reset_accelerate()
    results["trainer"] = trainer._both(rank, world, out, {"fsdp": "full_shard offload"})
    return {**results, "master_bytes": built}


@pytest.mark.slow  # gloo processes
def test_offload_params_equal_accelerate_and_the_trainers_fsdp2_with_torch_adamw(tmp_path):
    from _dist import run_ranks
    from _helpers import total_rel_err

    for r in run_ranks(_all, 2, str(tmp_path), timeout=500):
        assert r["master_bytes"] == [0, 0]  # one engine each, stepping FSDP2's host shards
        got, want = r["accelerate"]["got"], r["accelerate"]["want"]
        assert got["units"] == want["units"] == ["", "layers.0", "layers.1", "norm"]
        rel = total_rel_err(got["weights"], want["weights"])
        print(f"Accelerate FSDP2 + fsdp_offload_params, 2 processes: rel {rel:.3g}")
        assert rel < 1e-6
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
        assert max(want["norms"]) > accel.MAX_NORM  # clipping was active
        got, want = r["trainer"]["got"], r["trainer"]["want"]
        assert got["engine"] and not want["engine"] and got["units"] == want["units"]
        rel = total_rel_err(got["weights"], want["weights"])
        print(f"Trainer FSDP2 + offload, 2 processes: rel {rel:.3g}")
        assert rel < 1e-6
        assert got["history"][0] == pytest.approx(want["history"][0], rel=1e-5)  # losses
        assert got["history"][1] == pytest.approx(want["history"][1], rel=1e-5)  # grad norms
        assert max(want["history"][1]) > 0.5  # the Trainer's max_grad_norm clipped


def test_offload_weights_false_with_offload_params_is_refused() -> None:
    import torch
    from _tiny_llama import make
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_zero_offload import ZeroOffloadConfig
    from lightning_zero_offload.accelerate import ZeroOffloadPlugin

    accelerator = accel._fsdp2_accelerator("no", cpu_offload=CPUOffloadPolicy(pin_memory=False))
    model = make(0)
    plugin = ZeroOffloadPlugin(enabled=True, config=ZeroOffloadConfig(offload_weights=False))
    with pytest.raises(ValueError, match="offload_weights=False contradicts.*fsdp_offload_params"):
        plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters()))
