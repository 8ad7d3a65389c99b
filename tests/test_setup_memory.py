"""Setup never holds the model twice on the host (issue 19, item 4).

An fp32 model built on the CPU: the master is filled first, the device weights then take the
parameters over (their fp32 storage is freed) and only then are the moments, gradients and
staging allocated. A model in another dtype (a bf16 model; on a GPU, one already there) fills
the master through one bounded buffer; the peak figures are in benchmarks/host_memory.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _helpers import tiny_engine
from _tiny_gpt import make

from lightning_zero_offload.core import setup as setup_mod
from lightning_zero_offload.core.buckets import master_fill as host


def _storages(model: torch.nn.Module) -> list[weakref.ref]:
    return [weakref.ref(p.untyped_storage()) for p in model.parameters()]


def _alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_fp32_cpu_model_is_released_before_the_other_host_buffers(monkeypatch, precision):
    model = make(0)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    refs = _storages(model)
    alive_at_allocation: list[int] = []
    real = setup_mod.HostBuffers.allocate

    def spy(self):
        alive_at_allocation.append(_alive(refs))
        return real(self)

    monkeypatch.setattr(setup_mod.HostBuffers, "allocate", spy)
    engine = tiny_engine(model=model, precision=precision)
    # when the moments, gradients and staging are allocated, no user fp32 storage is left
    assert alive_at_allocation == [0]
    assert _alive(refs) == 0
    got = engine.full_state_dict(optimizer=False)["model"]  # the master: the exact fp32 values
    for name, w in want.items():
        assert torch.equal(got[name], w), name


class _EmptySpy:
    """``torch`` for core.buckets.host, recording each ``torch.empty`` (the fill's bounded
    buffer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.dtype]] = []

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def empty(self, n: int, *, dtype: torch.dtype, **kw):
        self.calls.append((n, dtype))
        return torch.empty(n, dtype=dtype, **kw)


def test_bf16_model_fills_master_through_a_bounded_buffer(monkeypatch):
    model = make(0, d=24, seq=8).to(torch.bfloat16)  # odd sizes: pieces end mid-chunk
    want = {n: p.detach().float() for n, p in model.named_parameters()}
    monkeypatch.setattr(host, "_FILL_CHUNK", 100)
    engine = tiny_engine(model=model, precision="bf16-mixed")
    got = engine.full_state_dict(optimizer=False)["model"]
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    # the same fill again, over the engine's (bf16, host) parameters: one buffer of 100 elements
    spy = _EmptySpy()
    master = [t.clone() for t in engine._host.master]
    monkeypatch.setattr(host, "torch", spy)
    host.fill_master(engine.layout, 0, False, engine._buckets)
    monkeypatch.setattr(host, "torch", torch)
    assert spy.calls == [(100, torch.bfloat16)]
    assert all(torch.equal(a, b) for a, b in zip(master, engine._host.master, strict=True))
    assert max(p.numel() for p in model.parameters()) > 100  # so the chunking was exercised


def test_fp32_host_parameters_are_copied_without_a_buffer(monkeypatch):
    engine = tiny_engine(model=make(0), precision="32-true")
    spy = _EmptySpy()
    master = [t.clone() for t in engine._host.master]
    monkeypatch.setattr(host, "torch", spy)
    host.fill_master(engine.layout, 0, False, engine._buckets)
    monkeypatch.setattr(host, "torch", torch)
    assert spy.calls == []
    assert all(torch.equal(a, b) for a, b in zip(master, engine._host.master, strict=True))
