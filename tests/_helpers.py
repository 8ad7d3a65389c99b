"""Helpers the test files share: engine builders, the training loop, relative errors, a user's
AdamW subclass, and the kernel/ISA helpers. One copy each, so a fix reaches every test."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from _tiny_gpt import lm_loss, make, param_groups
from torch import nn

from lightning_zero_offload import ZeroOffload, ops
from lightning_zero_offload.ops import _build

# -- engines -----------------------------------------------------------------------------------


def tiny_engine(seed: int = 0, *, model: nn.Module | None = None, model_kw: dict | None = None,
                optim: type[torch.optim.Optimizer] = torch.optim.AdamW, lr: float | None = 1e-2,
                opt_kw: dict | None = None, bucket_size_mb: float | None = 0.01,
                **cfg: Any) -> ZeroOffload:
    """The tiny GPT (``make(seed, **model_kw)``, or ``model``) under ``optim`` with its two GPT
    parameter groups at ``lr`` and weight decay 0.1; ``cfg`` goes to ``ZeroOffload``.

    ``lr=None``: ``optim(param_groups(model))``, the optimizer's own lr and weight decay outside
    what the groups set. The small default buckets give several buckets even for the tiny model
    (``bucket_size_mb=None``: the engine's default).
    """
    if model is None:
        model = make(seed, **(model_kw or {}))
    if lr is None:
        opt = optim(param_groups(model), **(opt_kw or {}))
    else:
        opt = optim(param_groups(model, lr=lr), lr=lr, weight_decay=0.1, **(opt_kw or {}))
    if bucket_size_mb is not None:
        cfg["bucket_size_mb"] = bucket_size_mb
    return ZeroOffload(model, opt, **cfg)


class Trained(NamedTuple):
    losses: list[float]  # one per micro-batch, as backpropagated (divided by ``micro``)
    norms: list[float | None]  # what each ``step()`` returned


def train(engine: ZeroOffload, data: Sequence, *, micro: int = 1, accumulate: bool = False,
          sched: Any = None, gather: bool = False) -> Trained:
    """One ``step()`` per ``(x, y)`` batch of the tiny GPT, each batch cut into ``micro``
    micro-batches; ``accumulate``: ``sync_gradients=False`` on all but the last of them;
    ``sched`` steps after each step; ``gather`` ends with ``gather_weights()``."""
    losses: list[float] = []
    norms: list[float | None] = []
    for x, y in data:
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            loss = lm_loss(engine.module(xs), ys)
            if micro > 1:
                loss = loss / micro
            losses.append(loss.item())
            engine.backward(loss, sync_gradients=not accumulate or i == micro - 1)
        norm = engine.step()
        norms.append(None if norm is None else norm.item())
        engine.zero_grad()
        if sched is not None:
            sched.step()
    if gather:
        engine.gather_weights()
    return Trained(losses, norms)


class BufferNet(nn.Module):
    """Small model with buffers (BatchNorm statistics, a plain buffer) besides the parameters."""

    def __init__(self, d: int = 8, extra: int = 4) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Linear(d, 1)
        self.register_buffer("extra", torch.arange(extra, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.fc(x)))


def buffer_engine(seed: int = 0, **net_kw: int) -> ZeroOffload:
    """A ``BufferNet`` engine with one bucket per tensor or so: the checkpoint tests' engine."""
    torch.manual_seed(seed)
    net = BufferNet(**net_kw)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    return ZeroOffload(net, opt, precision="32-true", bucket_size_mb=0.0005, cpu_threads=1)


def train_buffer_net(engine: ZeroOffload, steps: int = 2, seed: int = 0) -> None:
    """``steps`` steps of a ``buffer_engine`` on random regression data from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    d = engine.module.fc.in_features
    for _ in range(steps):
        x, y = torch.randn(16, d, generator=g), torch.randn(16, 1, generator=g)
        engine.backward(nn.functional.mse_loss(engine.module(x), y))
        engine.step()
        engine.zero_grad()


def snapshot(engine: ZeroOffload) -> dict:
    """Everything a load may change: the module's tensors and the engine's host state."""
    shard = engine.state_dict()
    return {
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "groups": [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items()}
                   for g in shard["groups"]],
    }


def same_state(a: dict, b: dict) -> bool:
    """Whether two ``snapshot``s are equal to the bit."""
    return (a["module"].keys() == b["module"].keys()
            and all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"])
            and len(a["groups"]) == len(b["groups"])
            and all(ga["step"] == gb["step"] and all(torch.equal(ga[k], gb[k]) for k in
                                                     ("master", "exp_avg", "exp_avg_sq"))
                    for ga, gb in zip(a["groups"], b["groups"], strict=True)))


def equal_nested(a: object, b: object) -> bool:
    """Whether two nested dicts/lists of tensors and plain values are equal to the bit (a
    state_dict, a shard, a consolidated checkpoint)."""
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(equal_nested(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(equal_nested(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a, b))
    return a == b


def clone_nested(obj: object) -> object:
    """A copy of a nested dict/list whose tensors are cloned (a shard of live buffers)."""
    if isinstance(obj, dict):
        return {k: clone_nested(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_nested(v) for v in obj]
    return obj.clone() if isinstance(obj, torch.Tensor) else obj


class Payload:
    """Unpickling this runs code (touches a file): what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def dead_pid() -> int:
    """The id of a process that has exited (what a killed save leaves in its names)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class SubAdamW(torch.optim.AdamW):
    """A user's AdamW subclass: the engine runs it as the AdamW it is."""


# -- relative errors ----------------------------------------------------------------------------


def rel_err(got: torch.Tensor | nn.Module | Sequence[torch.Tensor],
            want: torch.Tensor | nn.Module | Sequence[torch.Tensor]) -> float:
    """``|got - want| / |want|`` in float64 for two tensors; for two modules (their parameters) or
    two lists, the largest over the pairs."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        g, w = got.detach().double(), want.detach().double()
        return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
    pg = list(got.parameters()) if isinstance(got, nn.Module) else list(got)
    pw = list(want.parameters()) if isinstance(want, nn.Module) else list(want)
    assert len(pg) == len(pw), f"{len(pg)} tensors against {len(pw)}"
    return max(rel_err(g, w) for g, w in zip(pg, pw, strict=True))


def total_rel_err(got: dict, want: dict) -> float:
    """``|got - want| / |want|`` over every entry of ``want`` as one vector (float64)."""
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    den = sum(float(want[k].double().norm() ** 2) for k in want)
    return (num / den) ** 0.5


# -- the kernel and its SIMD paths --------------------------------------------------------------

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")  # every path the kernel has, on some CPU


def compiled_kernel() -> ModuleType:
    """The compiled extension, or a skip when the pure-torch reference is in use on purpose
    (``LZO_KERNEL=reference``) or for want of a compiler; a failed build is an error."""
    if ops.backend() != "cpp":
        pytest.skip("the C++ kernel is not in use (no compiler, or LZO_KERNEL=reference)")
    ext = _build.load()
    assert ext is not None
    return ext


def force_isa(name: str) -> AbstractContextManager[None]:
    """``ops.force_isa(name)``, or a skip when this CPU lacks that path; a name that is no path
    of the kernel fails, so a typo or a removed path cannot pass as a skip."""
    assert name in ISAS, f"{name!r} is not a SIMD path of the kernel (they are {ISAS})"
    if name not in ops.available_isas():
        pytest.skip(f"this CPU has no {name} (available: {ops.available_isas()})")
    return ops.force_isa(name)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN payloads and signed zeros compare as they are)."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    return t.view(ints[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, f"{what}{diff.numel()} elements differ, first at {diff[:5].flatten()}"


def assert_same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    """Two lists of tensors equal to the bit, pair by pair."""
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_bits_equal(x, y, f"tensor {k}: ")


def setup_error_with_rank_1_short(rank: int, build: Callable[[], object]) -> str:
    """``build()`` (an engine's setup) with rank 1's host-memory check refusing: the setup error
    this rank raised, or "no error"."""
    # where setup checks host memory
    import lightning_zero_offload.core.buckets.resident as resident

    if rank == 1:
        def refuse(needed: int, r: int) -> None:
            raise MemoryError(f"rank {r} needs {needed} bytes (test)")
        resident.check_host_memory = refuse
    try:
        build()
    except MemoryError as e:
        return str(e)
    return "no error"


def resumes_bit_for_bit(engine: Callable[..., ZeroOffload], path: Path, **cfg: Any) -> None:
    """A rule's checkpoint resumes bit for bit: ``engine(seed, **cfg)`` trained 4 steps and
    saved (``cfg``'s ``sharded`` goes to the save), then it and a fresh engine that loaded it
    train 4 more."""
    from _tiny_gpt import batches

    sharded = cfg.pop("sharded")
    data, more = batches(4), batches(4, seed=1)
    a = engine(0, **cfg)
    train(a, data)
    a.save_checkpoint(path, sharded=sharded)
    b = engine(5, **cfg)
    b.load_checkpoint(path)
    train(a, more, gather=True)
    train(b, more, gather=True)
    for x, y in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(bits(x), bits(y))


def continues_in_plain_torch(engine: ZeroOffload, make_opt: Callable[[nn.Module], Any],
                             clip: float = 1.0) -> None:
    """The engine's full state, trained 4 steps, loads into a plain model and optimizer
    (``make_opt(model)``), which then continue 4 steps within 1e-6 of the engine."""
    from _tiny_gpt import batches

    data, more = batches(4), batches(4, seed=1)
    train(engine, data, micro=2)
    full = engine.full_state_dict()
    model = make(3)
    model.load_state_dict(full["model"])
    opt = make_opt(model)
    opt.load_state_dict(full["optimizer"])
    train_plain(model, opt, more, micro=2, clip=clip)
    train(engine, more, micro=2)
    assert rel_err(engine.module, model) < 1e-6


def train_plain(model: nn.Module, opt: Any, data: Sequence, *, micro: int = 2,
                clip: float = 1.0) -> Any:
    """Plain torch: each batch as ``micro`` micro-batches, the norm clipped to ``clip``, one
    ``opt`` step; returns ``opt``."""
    for x, y in data:
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            (lm_loss(model(xs), ys) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return opt
