"""The CUDA path of the engine (side stream, pinned staging, device memory released): skipped
without a GPU; on one, the same training must give what the CPU path gives."""

from __future__ import annotations

import pytest
import torch
from _tiny_gpt import batches, lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(device: str, precision: str) -> ZeroOffload:
    model = make()
    return ZeroOffload(model, torch.optim.AdamW(param_groups(model), lr=1e-2), device=device,
                       precision=precision, max_grad_norm=0.5, bucket_size_mb=0.01)


def _train(engine: ZeroOffload, steps: int, micro: int) -> None:
    for x, y in batches(steps):
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            engine.backward(lm_loss(engine.module(xs.to(engine.device)), ys.to(engine.device))
                            / micro)
        engine.step()
        engine.zero_grad()


@pytest.mark.parametrize("micro", [1, 2])
def test_cuda_fp32_equals_cpu_path(micro):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = _engine("cpu", "32-true"), _engine("cuda", "32-true")
    _train(cpu, 6, micro)
    _train(gpu, 6, micro)
    gpu.synchronize()
    for a, b in zip(cpu.module.parameters(), gpu.module.parameters(), strict=True):
        assert ((a - b.cpu()).norm() / a.norm()).item() < 1e-4
    assert gpu.last_grad_norm == pytest.approx(cpu.last_grad_norm, rel=1e-4)


def test_cuda_host_buffers_are_pinned_and_within_budget():
    """Staging and output slices live in pinned blocks, within what the preflight budgets."""
    from lightning_zero_offload.core.host import HostBuffers

    engine = _engine("cuda", "bf16-mixed")
    host = HostBuffers(engine.layout, torch.bfloat16, asynchronous=True, delayed=True,
                       pinned=True, out_direct=False)
    assert host.out(0).is_pinned() and host.grads.stage(0).is_pinned()
    assert host.spare.stage(0).is_pinned() and not host.master[0].is_pinned()
    assert host.allocated_bytes() <= host.sizes.total


def test_cuda_bf16_grad_memory_released():
    engine = _engine("cuda", "bf16-mixed")
    weights = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    _train(engine, 3, 1)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x.cuda()), y.cuda()))
    engine.synchronize()
    torch.cuda.synchronize()
    assert all(p.grad is None for p in engine.module.parameters())
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps MiBs of workspace in the allocator
    assert torch.cuda.memory_allocated() < weights + 2**20  # no gradient buffers left behind
    engine.step()
    full = engine.full_state_dict()["model"]
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.cpu(), full[name].to(torch.bfloat16))
    engine.teardown()
    assert all(p.dtype == torch.float32 and p.is_cuda for p in engine.module.parameters())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("delayed", [False, True])
def test_cuda_half_precision_follows_the_cpu_path(precision, delayed):
    """The step reads half-precision gradients straight from pinned staging (one micro-batch)
    and, with delayed update, writes the spare device weights from the worker thread."""
    runs = []
    for device in ("cpu", "cuda"):
        model = make()
        engine = ZeroOffload(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                             device=device, precision=precision, bucket_size_mb=0.01,
                             delayed_update=delayed, delayed_update_warmup=2)
        _train(engine, 6, 1)
        runs.append(engine.full_state_dict()["model"])
        if delayed:
            assert [r.step for r in engine.profile] == list(range(1, 7))
            assert engine.profile[-1].weight_copy > 0 or device == "cpu"
        engine.teardown()
    for name, t in runs[0].items():
        assert ((t - runs[1][name]).norm() / t.norm()).item() < 2e-2, name
