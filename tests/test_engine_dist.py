"""Multi-rank engine tests (gloo, spawned CPU processes): N ranks equal 1 rank."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _helpers import rel_err, tiny_engine, train
from _tiny_gpt import batches
from torch import nn

from lightning_zero_offload import ZeroOffload

pytestmark = pytest.mark.slow


def _engine(precision: str = "32-true", seed: int = 0, **cfg) -> ZeroOffload:
    return tiny_engine(seed, precision=precision, max_grad_norm=0.5, **cfg)


def _split(data, rank: int, world: int):
    per = data[0][0].shape[0] // world
    return [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in data]


def _params(engine: ZeroOffload) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _close(a: list, b: list, tol: float = 1e-5) -> None:
    assert rel_err(b, a) <= tol  # relative to ``a``, tensor by tensor


def _one_rank(engine: ZeroOffload, data: list, micro: int = 1, world: int = 2) -> None:
    """``engine`` on one rank as ``world`` ranks split ``data``: each rank's part of a batch
    (and of its ``micro`` micro-batches) as a micro-batch of its own. The BLAS then multiplies
    the shapes the ranks do; on the full batch it splits the matmuls its own way, which differs
    by CPU and MKL_CBWR (3e-6 under MKL_CBWR=COMPATIBLE) and says nothing of the engine. Split
    alike, the ranks are 4.2e-7 (AMD EPYC) to 5.4e-7 (COMPATIBLE) from it: `_close`'s 1e-5
    leaves a margin of 18."""
    train(engine, data, micro=micro * world, accumulate=True)


def _ranks_train(rank: int, world: int) -> dict:
    out = {}
    for micro in (1, 2):
        engine = _engine()
        train(engine, _split(batches(6), rank, world), micro=micro, accumulate=True)
        out[micro] = {"params": _params(engine), "shard": engine.layout.shard_numel,
                      "norm": engine.last_grad_norm, "full": engine.full_state_dict(),
                      "weights": engine.full_state_dict(optimizer=False),
                      "moments": engine.full_state_dict(model=False)}
    engine = _engine("bf16-mixed")
    train(engine, _split(batches(4), rank, world))
    out["bf16"] = _params(engine)
    master = engine.full_state_dict(optimizer=False)["model"]
    try:
        raise KeyError("the caller's own error, handled")
    except KeyError:  # a run that ended well, torn down inside the caller's handler
        engine.teardown(copy_weights_to_module=True, keep_state=True, failure=None)
    out["restored"] = [torch.equal(p, master[n]) for n, p in engine.module.named_parameters()]
    out["readable"] = engine.full_state_dict(optimizer=False)["model"].keys() == master.keys()
    return out


def test_two_ranks_equal_one_rank():
    """Also: accumulation with sync_gradients=False (micro=2) and bf16 ranks agreeing exactly."""
    two = run_ranks(_ranks_train, 2)
    for micro in (1, 2):
        one = _engine()
        _one_rank(one, batches(6), micro)
        for r in range(2):
            got = two[r][micro]
            _close(_params(one), got["params"])
            assert got["norm"] == pytest.approx(one.last_grad_norm, rel=1e-5)
        assert two[0][micro]["shard"] * 2 == pytest.approx(one.layout.shard_numel, rel=0.1)
        ref, full = one.full_state_dict(), two[1][micro]["full"]
        names = list(ref["model"])
        _close([ref["model"][k] for k in names], [full["model"][k] for k in names])
        ref_m = [s["exp_avg"] for s in ref["optimizer"]["state"].values()]
        _close(ref_m, [s["exp_avg"] for s in full["optimizer"]["state"].values()], 1e-4)
        assert ref["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]
        for r in range(2):  # the weights-only and moments-only gathers equal the whole
            got = two[r][micro]
            assert "optimizer" not in got["weights"] and "model" not in got["moments"]
            assert got["weights"]["model"].keys() == got["full"]["model"].keys()
            for k, v in got["full"]["model"].items():
                assert torch.equal(got["weights"]["model"][k], v)
            state = got["full"]["optimizer"]["state"]
            assert got["moments"]["optimizer"]["state"].keys() == state.keys()
            for i, st in state.items():
                assert all(torch.equal(got["moments"]["optimizer"]["state"][i][k], st[k])
                           for k in st)
    for a, b in zip(two[0]["bf16"], two[1]["bf16"], strict=True):
        assert torch.equal(a, b)
    for r in range(2):  # teardown(failure=None) in a handler: fp32 weights back, state readable
        assert two[r]["restored"] and all(two[r]["restored"]) and two[r]["readable"]


def _save_then_continue(rank: int, world: int, path: str) -> list:
    engine = _engine()
    train(engine, _split(batches(3), rank, world))
    engine.save_checkpoint(path)
    train(engine, _split(batches(3, seed=1), rank, world))
    return _params(engine)


def _load_then_continue(rank: int, world: int, path: str) -> list:
    engine = _engine(seed=7)
    engine.load_checkpoint(path)
    train(engine, _split(batches(3, seed=1), rank, world))
    return _params(engine)


def test_sharded_checkpoint_two_ranks_to_one_and_back(tmp_path):
    path = str(tmp_path / "ckpt")
    two = run_ranks(_save_then_continue, 2, path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "shard-00000-of-00002.pt", "shard-00001-of-00002.pt", "zero_offload.json"]
    one = _engine(seed=7)
    one.load_checkpoint(path)
    _one_rank(one, batches(3, seed=1))
    _close(two[0], _params(one))
    # the reverse: one rank writes, two ranks resume
    path1 = str(tmp_path / "ckpt1")
    single = _engine()
    _one_rank(single, batches(3))
    single.save_checkpoint(path1)
    _one_rank(single, batches(3, seed=1))
    resumed = run_ranks(_load_then_continue, 2, path1)
    _close(_params(single), resumed[1])


class Branchy(nn.Module):
    """Rank 0 uses branch ``a``, rank 1 branch ``b``: unused parameters differ across ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        return self.out((self.a if branch == 0 else self.b)(x))


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 2 + rank))


def _on_ranks(rank: int, world: int, cls: type, use, steps: int, hp: dict,
              bucket_size_mb: float) -> list:
    """This rank's engine on ``cls``, whose forward takes ``use(rank, step)``."""
    torch.manual_seed(0)
    model = cls()
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters(), **hp),
                         precision="32-true", bucket_size_mb=bucket_size_mb)
    for step in range(steps):
        engine.backward(engine.module(_x(step, rank), use(rank, step)).square().mean())
        engine.step()
        engine.zero_grad()
    return _params(engine)


def _torch_on_ranks(cls: type, use, steps: int, hp: dict, world: int = 2) -> list:
    """torch's AdamW on the ranks' mean loss (a parameter no rank used keeps grad None)."""
    torch.manual_seed(0)
    ref = cls()
    opt = torch.optim.AdamW(ref.parameters(), **hp)
    for step in range(steps):
        loss = sum(ref(_x(step, r), use(r, step)).square().mean() for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in ref.parameters()]


def _branch_of_rank(rank: int, step: int) -> int:
    return rank


def test_unused_parameters_differ_across_ranks():
    args = (Branchy, _branch_of_rank, 3, {"lr": 0.1})
    got = run_ranks(_on_ranks, 2, *args, 0.0001)
    _close(_torch_on_ranks(*args), got[0])
    _close(got[0], got[1], tol=0)


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.out((self.b(self.a(x)) if use_b else self.a(x)).tanh())


def _b_early_on_rank_1(rank: int, step: int) -> bool:
    return rank == 1 and step < 2  # b: used by rank 1 at steps 0 and 1 only; c: by no rank


def test_a_parameter_without_gradient_on_every_rank_is_left_untouched():
    args = (Three, _b_early_on_rank_1, 4, {"lr": 0.1, "weight_decay": 0.5})
    got = run_ranks(_on_ranks, 2, *args, 1.0)
    _close(_torch_on_ranks(*args), got[0])  # steps 2-3: torch skips b (grad None), always c
    _close(got[0], got[1], tol=0)


def _ranks_delayed(rank: int, world: int) -> list:
    engine = _engine(delayed_update=True, delayed_update_warmup=2)
    train(engine, _split(batches(6), rank, world))
    engine.gather_weights()  # collective: the last step's update, gathered from both ranks
    return _params(engine)


def test_two_ranks_delayed_update_equal_one_rank():
    """The worker writes this rank's shard of the spare weights; the gather runs at the swap."""
    two = run_ranks(_ranks_delayed, 2)
    one = _engine(delayed_update=True, delayed_update_warmup=2)
    _one_rank(one, batches(6))
    one.synchronize()
    for r in range(2):
        _close(_params(one), two[r])
