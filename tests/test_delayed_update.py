"""Delayed parameter update: exactly one step stale after the warm-up, nothing dropped.

The reference is plain torch: fp32 master weights with ``torch.optim.AdamW`` + clipping, and a
separate copy of the weights the forward pass uses. Steps 1..W copy the new master weights to the
forward copy; after that step k copies the master weights from *before* step k (so step k+1's
forward runs on weights through k-1), and a flush copies the latest.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from _helpers import rel_err, tiny_engine
from _tiny_gpt import batches, lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
W = 3
STEPS = 9
LR_DECAY = 0.9  # a scheduler: each step's lr must be the one in force when it was launched


class StaleAdamW:
    """Plain-torch one-step-stale AdamW with global-norm clipping."""

    def __init__(self, model: torch.nn.Module, warmup: int, max_norm: float | None) -> None:
        self.dev = model  # the weights forward/backward use
        self.master = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(param_groups(self.master))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda k: LR_DECAY**k)
        self.warmup, self.max_norm, self.k = warmup, max_norm, 0

    def step(self, loss: torch.Tensor) -> None:
        self.k += 1
        loss.backward()
        for d, m in zip(self.dev.parameters(), self.master.parameters(), strict=True):
            m.grad = d.grad.clone()
            d.grad = None
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.max_norm)
        before = [m.detach().clone() for m in self.master.parameters()]
        self.opt.step()
        self.sched.step()
        src = self.master.parameters() if self.k <= self.warmup else before
        self.flush(src)

    @torch.no_grad()
    def flush(self, src: object = None) -> None:
        for d, m in zip(self.dev.parameters(), src or self.master.parameters(), strict=True):
            d.copy_(m)


def _engine(model: torch.nn.Module, max_norm: float | None, **kw: Any) -> tuple:
    """The engine StaleAdamW models (AdamW's defaults, one bucket) and its decaying lr."""
    kw.setdefault("device", "cpu")
    eng = tiny_engine(model=model, lr=None, bucket_size_mb=None, precision="32-true",
                      max_grad_norm=max_norm, delayed_update=True, delayed_update_warmup=W, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda k: LR_DECAY**k)
    return eng, sched


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_delayed_update_equals_one_step_stale_adamw(max_norm: float | None, device: str) -> None:
    ref = StaleAdamW(make().to(device), W, max_norm)
    eng, sched = _engine(make(), max_norm, device=device)
    data = [(x.to(device), y.to(device)) for x, y in batches(STEPS)]
    flush_at = 6  # a synchronize() mid-run applies the pending update early, as validation does
    for k, (x, y) in enumerate(data, start=1):
        ref_loss = lm_loss(ref.dev(x), y)
        loss = lm_loss(eng.module(x), y)
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), k
        ref.step(ref_loss)
        eng.backward(loss)
        eng.step()
        sched.step()
        eng.zero_grad()
        if k == flush_at:
            eng.synchronize()
            ref.flush()
            for p, q in zip(eng.module.parameters(), ref.dev.parameters(), strict=True):
                assert rel_err(p.detach(), q.detach()) < 1e-5
    full = eng.full_state_dict()  # flushes the last pending update
    ref_sd = ref.master.state_dict()
    for name, t in full["model"].items():
        assert rel_err(t, ref_sd[name].cpu()) < 1e-5, name
    ref_opt = ref.opt.state_dict()["state"]
    for i, st in full["optimizer"]["state"].items():
        assert rel_err(st["exp_avg_sq"], ref_opt[i]["exp_avg_sq"].cpu()) < 1e-5
        assert int(st["step"]) == STEPS
    eng.teardown()


def test_flush_on_state_dict_and_teardown() -> None:
    ref = StaleAdamW(make(), W, None)
    eng, sched = _engine(make(), None)
    for x, y in batches(W + 3):
        ref.step(lm_loss(ref.dev(x), y))
        eng.backward(lm_loss(eng.module(x), y))
        eng.step()
        sched.step()
        eng.zero_grad()
    ref_master = [p.detach().clone() for p in ref.master.parameters()]
    shard = eng.state_dict()  # flushes: the shard holds every update
    assert shard["groups"][0]["step"] == W + 3
    eng.teardown(copy_weights_to_module=True)
    for p, m in zip(eng.module.parameters(), ref_master, strict=True):
        assert p.dtype == torch.float32 and rel_err(p.detach(), m) < 1e-5


def test_delayed_off_is_unchanged_and_profile_is_recorded() -> None:
    engine_model = make()
    plain = ZeroOffload(engine_model, torch.optim.AdamW(param_groups(engine_model)),
                        precision="32-true")
    model = make()
    ref_opt = torch.optim.AdamW(param_groups(model))
    for x, y in batches(3):
        lm_loss(model(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        plain.backward(lm_loss(plain.module(x), y))
        plain.step()
        plain.zero_grad()
    for p, q in zip(plain.module.parameters(), model.parameters(), strict=True):
        assert rel_err(p.detach(), q.detach()) < 1e-5
    recs = plain.profile
    assert [r.step for r in recs] == [1, 2, 3] and plain.last_profile is recs[-1]
    assert all(r.cpu_step > 0 and r.fwd_bwd > 0 for r in recs)


def test_delayed_profile_has_a_worker_lane_and_stall() -> None:
    eng, _ = _engine(make(), None)
    for x, y in batches(W + 4):
        eng.backward(lm_loss(eng.module(x), y))
        eng.step()
        eng.zero_grad()
    eng.synchronize()
    recs = eng.profile
    assert [r.step for r in recs] == list(range(1, W + 5))
    late = recs[W + 1]
    assert late.cpu_step > 0 and any(s[0] == "stall" for s in late.spans)
    eng.teardown()


def test_worker_error_is_raised_on_the_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_zero_offload.ops.adamw as step_mod

    eng, _ = _engine(make(), None)
    data = batches(W + 3)
    for x, y in data[:W]:
        eng.backward(lm_loss(eng.module(x), y))
        eng.step()
        eng.zero_grad()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(step_mod, "fused_adamw_", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        for x, y in data[W:]:
            eng.backward(lm_loss(eng.module(x), y))
            eng.step()
            eng.zero_grad()
        eng.synchronize()


def test_bf16_delayed_matches_a_stale_reference_using_the_same_kernel() -> None:
    """bf16 weights: the worker writes the spare weight buffer, swapped in at the next step."""
    from lightning_zero_offload.ops import fused_adamw_

    model = make()
    dev = copy.deepcopy(model).to(torch.bfloat16)
    master = [p.detach().clone() for p in model.parameters()]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in master]
    hp = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    eng = ZeroOffload(model, torch.optim.AdamW(model.parameters(), **hp), precision="bf16-mixed",
                      delayed_update=True, delayed_update_warmup=W)
    for k, (x, y) in enumerate(batches(STEPS), start=1):
        ref_loss = lm_loss(dev(x), y)
        loss = lm_loss(eng.module(x), y)
        assert torch.equal(loss, ref_loss), k
        ref_loss.backward()
        before = [m.clone() for m in master]
        for p, m, (ea, eas) in zip(dev.parameters(), master, moments, strict=True):
            fused_adamw_(m, p.grad.float().contiguous(), ea, eas, step=k, **hp)
            p.grad = None
        with torch.no_grad():
            for p, m in zip(dev.parameters(), master if k <= W else before, strict=True):
                p.copy_(m)
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
    full = eng.full_state_dict()["model"]
    for (name, _), m in zip(dev.named_parameters(), master, strict=True):
        assert torch.equal(full[name], m), name
    eng.synchronize()
    for p, m in zip(eng.module.parameters(), master, strict=True):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    eng.teardown()


def test_cpu_affinity_binds_the_step_and_bad_cores_are_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    from pathlib import Path

    # The CPU step's threads on the CPU device: under LZO_EMULATED_DEVICE_SEED the emulated
    # streams would add threads of their own, which cpu_affinity does not (and should not) bind.
    monkeypatch.delenv("LZO_EMULATED_DEVICE_SEED", raising=False)

    def thread_affinities() -> dict[int, set[int]]:  # Linux: every thread of this process
        return {int(t.name): os.sched_getaffinity(int(t.name))
                for t in Path("/proc/self/task").iterdir()}

    cores = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="cpu_affinity"):
        ZeroOffload(make(), torch.optim.AdamW(make().parameters()), cpu_affinity=[max(cores) + 1])
    if len(cores) < 2:
        pytest.skip("binding is only visible with two or more usable cores")
    results, bound = [], []
    for kw in ({}, {"cpu_affinity": cores[-1:]}):
        before = set(thread_affinities())
        model = make()
        eng = ZeroOffload(model, torch.optim.AdamW(param_groups(model)), precision="32-true", **kw)
        for x, y in batches(3):
            eng.backward(lm_loss(eng.module(x), y))
            eng.step()
            eng.zero_grad()
        # the threads the engine started for its CPU step, and the cores each may run on
        bound.append([a for t, a in thread_affinities().items() if t not in before])
        results.append([p.detach().clone() for p in eng.module.parameters()])
        eng.teardown()
    assert os.sched_getaffinity(0) == set(cores)  # the caller's thread is left alone
    assert all(a == set(cores) for a in bound[0])  # unbound: nothing restricted
    assert bound[1] and all(a == set(cores[-1:]) for a in bound[1])  # the step's threads
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_default_threads_share_this_process_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from lightning_zero_offload.core.step.threads import default_threads

    cpu = torch.device("cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's setting must not decide
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads(1, cpu, False) == 16 and default_threads(1, cpu, True) == 15
    assert default_threads(4, cpu, False) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads(8, cpu, False) == 8 and default_threads(8, cpu, True) == 7


@pytest.mark.parametrize("delayed", [True, False])
def test_warmup_is_logged_once(caplog: pytest.LogCaptureFixture, delayed: bool) -> None:
    """A run shorter than the warm-up never overlaps: the first step says so, once."""
    eng = tiny_engine(precision="32-true", delayed_update=delayed, delayed_update_warmup=W)
    caplog.set_level(logging.WARNING, logger="lightning_zero_offload")
    for x, y in batches(W + 2):  # past the warm-up too: still one line
        eng.backward(lm_loss(eng.module(x), y))
        eng.step()
        eng.zero_grad()
    eng.teardown()
    said = [r for r in caplog.records if "warm-up" in r.getMessage()]
    if not delayed:
        assert said == []
        return
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert said[0].getMessage() == (f"delayed update starts after {W} warm-up steps "
                                    f"(delayed_update_warmup={W}); until then each step runs "
                                    "synchronously")
