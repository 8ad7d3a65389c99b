"""The CUDA path of the engine (side stream, pinned staging, device memory released): on a GPU the
same training must give what the CPU path gives, and the host memory really allocated must be
what the engine budgets.

The comparisons are functions (``compare_runs``, ``host_budget_problems``) that the tests without
the ``cuda`` mark check here on the CPU. In the device check's rehearsal
(``LZO_DEVICE_CHECK=rehearse``, no GPU) the ``cuda``-marked comparisons run with the emulated
asynchronous device standing in for CUDA, so the rehearsal runs them end to end.

Tolerances (``TOLERANCE``) are a stated multiple of what a kernel change does on the CPU alone:
the same 6-step training of ``_tiny_gpt`` (lr=1e-2, bucket 0.01 MB, delayed update off and on)
with the attention kernel changed (flash vs math ``scaled_dot_product_attention``). Measured on
the plain CPU path (2026-12-01, torch 2.13, the larger of delayed update off/on; turning oneDNN
off changed nothing in half precision and 1.2e-6 of the update in fp32):

=========== ======================== ============================ ================ ==========
precision   per tensor (worst)       whole model, weights         whole model,     loss curve
                                                                  update since
                                                                  initialisation
=========== ======================== ============================ ================ ==========
32-true     < 1e-4                   1.7e-7                       1.9e-6           1.1e-7
bf16-mixed  0.077 (a LayerNorm bias) 2.3e-3                       2.6e-2           3.1e-4
16-mixed    0.137 (a LayerNorm bias) 6.5e-4                       7.3e-3           2.9e-5
=========== ======================== ============================ ================ ==========

Per tensor is not stable (zero-initialised biases differ by 8-14% between two CPU kernels), so
the tests compare the whole model's update since initialisation (``||a - b|| / ||a - a0||``,
10x more sensitive than the weights themselves) and the loss curve, with ``TOLERANCE = MARGIN
(4) x`` the measured change: a GPU changes every kernel at once (matmul reduction order, fused
attention), hence the margin. In fp32 the measured change is float rounding, so a floor of 1e-4
(update) and 1e-5 (loss) applies. A real fault (a skipped step, a wrong learning rate or scale, a
missed wait's stale or NaN data) moves the update by far more: see
``test_compare_runs_flags_a_wrong_update``.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

import pytest
import torch
from _tiny_gpt import batches, lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.testing import emulated_async_device

REHEARSE = os.environ.get("LZO_DEVICE_CHECK") == "rehearse"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # "cpu" (rehearsal): the emulated asynchronous device
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_device = pytest.mark.skipif(not (CUDA or REHEARSE), reason="needs a CUDA device (or the "
                                  "device check's --rehearse, which runs it on the emulated one)")

# Measured CPU-vs-CPU kernel change (module docstring): the larger of the two changes.
UPDATE_MEASURED = {"32-true": 1.9e-6, "bf16-mixed": 2.6e-2, "16-mixed": 7.3e-3}
LOSS_MEASURED = {"32-true": 1.1e-7, "bf16-mixed": 3.1e-4, "16-mixed": 2.9e-5}
MARGIN = 4.0
TOLERANCE = {p: (MARGIN * UPDATE_MEASURED[p], MARGIN * LOSS_MEASURED[p]) for p in UPDATE_MEASURED}
# fp32's measured change is float rounding: a floor keeps the test about faults, not sum order.
FLOOR = (1e-4, 1e-5)


@dataclass
class Run:
    """A training run's initial and final weights (fp32, by name) and its losses."""

    init: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    losses: list[float]


def compare_runs(a: Run, b: Run) -> tuple[float, float]:
    """(whole-model relative error of the update since initialisation, largest relative
    difference of the loss curves) between two runs of the same training."""
    if a.final.keys() != b.final.keys() or len(a.losses) != len(b.losses):
        raise AssertionError(f"not the same training: {sorted(a.final)[:3]}... "
                             f"{len(a.losses)} vs {len(b.losses)} steps")
    flat = lambda d: torch.cat([d[k].double().flatten() for k in sorted(d)])  # noqa: E731
    fa, fb, f0 = flat(a.final), flat(b.final), flat(a.init)
    update = ((fa - fb).norm() / (fa - f0).norm()).item()
    loss = max(abs(x - y) / abs(x) for x, y in zip(a.losses, b.losses, strict=True))
    return update, loss


def assert_runs_agree(a: Run, b: Run, precision: str) -> None:
    update, loss = compare_runs(a, b)
    tol_u, tol_l = (max(t, f) for t, f in zip(TOLERANCE[precision], FLOOR, strict=True))
    assert update == update and update <= tol_u, (  # NaN fails too
        f"whole-model update differs by {update:.3g} (tolerance {tol_u:.3g}, {precision})")
    assert loss == loss and loss <= tol_l, (
        f"loss curves differ by {loss:.3g} (tolerance {tol_l:.3g}, {precision})")


def _device(device: str) -> contextlib.AbstractContextManager:
    """The engine's device for ``device``: CUDA as is; "cpu" as the emulated one."""
    return emulated_async_device(seed=1) if device == "cpu" else contextlib.nullcontext()


def train_run(device: str, precision: str, *, steps: int = 6, micro: int = 1,
              delayed: bool = False, lr: float = 1e-2,
              context: contextlib.AbstractContextManager | None = None) -> Run:
    """The tests' training: ``_tiny_gpt`` on ``device`` (its own context: a kernel choice, the
    emulated device), ``steps`` optimizer steps of ``micro`` micro-batches each."""
    model = make()
    init = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    with context or contextlib.nullcontext():
        engine = ZeroOffload(model, torch.optim.AdamW(param_groups(model, lr=lr), lr=lr),
                             device=device, precision=precision, max_grad_norm=0.5,
                             bucket_size_mb=0.01, delayed_update=delayed,
                             delayed_update_warmup=2)
        losses = []
        for x, y in batches(steps):
            total = 0.0
            for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
                loss = lm_loss(engine.module(xs.to(engine.device)), ys.to(engine.device)) / micro
                engine.backward(loss)
                total += loss.item()
            engine.step()
            engine.zero_grad()
            losses.append(total)
        engine.synchronize()
        if delayed:
            assert [r.step for r in engine.profile] == list(range(1, steps + 1))
            assert engine.profile[-1].weight_copy > 0 or device == "cpu"
        final = {k: v.float() for k, v in engine.full_state_dict()["model"].items()}
        engine.teardown()
    return Run(init, final, losses)


def _plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference runs on the plain CPU path, even where the suite runs emulated."""
    monkeypatch.delenv("LZO_EMULATED_DEVICE_SEED", raising=False)


# -- the comparison on the CPU ----------------------------------------------------------------
def _sdpa(backend: str) -> contextlib.AbstractContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_compare_runs_passes_a_cpu_kernel_change(precision, monkeypatch):
    """The measurement the tolerances come from: another attention kernel stays within them, and
    moves the update by more than nothing (else the tolerance would rest on no measurement)."""
    _plain_cpu(monkeypatch)
    a = train_run("cpu", precision, context=_sdpa("FLASH_ATTENTION"))
    b = train_run("cpu", precision, context=_sdpa("MATH"))
    assert_runs_agree(a, b, precision)
    assert compare_runs(a, b)[0] > 0


@pytest.mark.parametrize("change", ["lr", "steps"])
def test_compare_runs_flags_a_wrong_update(change, monkeypatch):
    """A learning rate 30% off, or one step fewer on the same data, fails the comparison."""
    _plain_cpu(monkeypatch)
    a = train_run("cpu", "bf16-mixed")
    b = (train_run("cpu", "bf16-mixed", lr=1.3e-2) if change == "lr" else
         train_run("cpu", "bf16-mixed", steps=5))
    if change == "steps":  # same curve length; the last step of b repeats nothing
        b.losses.append(a.losses[-1])
    with pytest.raises(AssertionError, match="whole-model update differs"):
        assert_runs_agree(a, b, "bf16-mixed")


# -- CPU vs the device ------------------------------------------------------------------------
@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("micro", [1, 2])
def test_cuda_fp32_equals_cpu_path(micro, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    _plain_cpu(monkeypatch)
    ref = train_run("cpu", "32-true", micro=micro)
    other = train_run(DEVICE, "32-true", micro=micro, context=_device(DEVICE))
    assert_runs_agree(ref, other, "32-true")


@pytest.mark.cuda
@needs_device
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("delayed", [False, True])
def test_cuda_half_precision_follows_the_cpu_path(precision, delayed, monkeypatch):
    """The step reads half-precision gradients straight from pinned staging (one micro-batch)
    and, with delayed update, writes the spare device weights from the worker thread."""
    _plain_cpu(monkeypatch)
    ref = train_run("cpu", precision, delayed=delayed)
    other = train_run(DEVICE, precision, delayed=delayed, context=_device(DEVICE))
    assert_runs_agree(ref, other, precision)


# -- host memory: what is allocated against what is budgeted ----------------------------------
def live_host_storages() -> dict[int, torch.UntypedStorage]:
    """Every CPU storage a live tensor holds, by data pointer, found by walking the garbage
    collector's objects (independent of the engine's own accounting). Holding the result keeps
    those storages alive, so a later allocation cannot reuse an address and hide as "old"."""
    gc.collect()
    out: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == (
                torch.strided):
            s = obj.untyped_storage()
            if s.data_ptr() and s.nbytes():
                out[s.data_ptr()] = s
    return out


def _reserved(s: torch.UntypedStorage) -> tuple[int, bool]:
    """(bytes the host really holds for ``s``, pinned): CUDA's pinned allocator hands out a
    power of two for every block."""
    if CUDA and s.is_pinned():
        return 1 << max(0, s.nbytes() - 1).bit_length(), True
    return s.nbytes(), False


def new_host_bytes(before: dict[int, torch.UntypedStorage]) -> tuple[int, int]:
    """(bytes, pinned bytes) of the CPU storages alive now that were not in ``before``."""
    new = [_reserved(s) for p, s in live_host_storages().items() if p not in before]
    return sum(n for n, _ in new), sum(n for n, pin in new if pin)


# Parts allocated on first use (may still be absent): the fp32 gradient on an asynchronous
# device (first accumulating backward), the CPU device's pooled bucket buffers (backward).
LAZY = ("grad_fp32", "buckets_in_flight")
SLACK = 16 * 2**10  # bytes: the engine's small bookkeeping tensors (norms, flags, counters)


def host_budget_problems(budget: dict[str, int], allocated: int, pinned: int,
                         pinned_planned: int, lazy: tuple[str, ...] = LAZY) -> list[str]:
    """What is wrong with ``allocated`` host bytes (``pinned`` of them pinned) against the
    engine's ``host_budget``: more than budgeted, less than the parts that must exist by now
    (all but ``lazy``), pinned bytes that are not the planned staging."""
    total, eager = sum(budget.values()), sum(v for k, v in budget.items() if k not in lazy)
    out = []
    if allocated > total + SLACK:
        out.append(f"allocated {allocated} B > budget {total} B ({budget})")
    if allocated < eager - SLACK:
        out.append(f"allocated {allocated} B < the {eager} B that must exist by now ({budget})")
    if abs(pinned - pinned_planned) > SLACK:
        out.append(f"pinned {pinned} B, planned {pinned_planned} B")
    return out


def _check_host_budget(device: str, precision: str, micro: int) -> ZeroOffload:
    """Build an engine and train two steps; after each, what lives on the host is checked
    against ``engine.host_budget``."""
    gc.collect()
    model = make(d=64, vocab=128)
    before = live_host_storages()
    engine = ZeroOffload(model, torch.optim.AdamW(param_groups(model), lr=1e-2), device=device,
                         precision=precision, bucket_size_mb=0.01, delayed_update=True)
    assert sum(engine.host_budget.values()) == engine.host_bytes
    pinned_planned = 0
    if CUDA:
        pinned_planned = engine.host_budget["staging"] + (
            engine.host_budget["master"] if precision == "32-true" else 0)
    for step in range(3):
        if step:
            for x, y in batches(1):
                for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
                    engine.backward(lm_loss(engine.module(xs.to(engine.device)),
                                            ys.to(engine.device)) / micro)
            engine.step()
            engine.zero_grad()
            engine.synchronize()
        # once a step accumulated, the fp32 gradient exists (only the CPU pool may be partial)
        lazy = LAZY if step == 0 or micro == 1 else ("buckets_in_flight",)
        problems = host_budget_problems(engine.host_budget, *new_host_bytes(before),
                                        pinned_planned, lazy)
        assert not problems, f"after {step} steps: {problems}"
    return engine


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("micro", [1, 2])
def test_cpu_host_allocation_within_budget(emulated, micro, monkeypatch):
    _plain_cpu(monkeypatch)
    with emulated_async_device(seed=1) if emulated else contextlib.nullcontext():
        _check_host_budget("cpu", "bf16-mixed", micro).teardown()


def test_host_budget_problems_names_each_excess():
    budget = {"master": 400, "moments": 800, "grad_fp32": 400, "staging": 2**20}
    assert host_budget_problems(budget, 2**20 + 1200, 2**20, 2**20) == []
    assert "> budget" in host_budget_problems(budget, 2**21, 2**20, 2**20)[0]
    assert "must exist" in host_budget_problems(budget, 2**19, 2**19, 2**20)[0]
    assert "pinned" in host_budget_problems(budget, 2**20 + 1200, 2**21, 2**20)[-1]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_cuda_host_buffers_are_pinned_and_within_budget(precision):
    """Staging and output slices live in pinned blocks: the pinned bytes alive are the planned
    staging, and all host bytes alive are within the engine's budget (measured, not planned)."""
    engine = _check_host_budget("cuda", precision, micro=2)
    host = engine._host
    staging = [s[0] for s in host.staging if s is not None]  # bucket 0's, in each set
    assert len(staging) == 2 and all(t.is_pinned() for t in staging)
    assert host.master[0].is_pinned() == (precision == "32-true")
    engine.teardown()


@pytest.mark.cuda
@needs_cuda
def test_cuda_bf16_grad_memory_released():
    model = make()
    engine = ZeroOffload(model, torch.optim.AdamW(param_groups(model), lr=1e-2), device="cuda",
                         precision="bf16-mixed", max_grad_norm=0.5, bucket_size_mb=0.01)
    weights = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    for x, y in batches(3):
        engine.backward(lm_loss(engine.module(x.cuda()), y.cuda()))
        engine.step()
        engine.zero_grad()
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
