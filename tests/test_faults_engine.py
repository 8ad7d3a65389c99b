"""Engine faults: failing or diverging ranks end every rank with a clear error within the
collective timeout; bad hyperparameters change nothing; dropped engines free their memory."""

from __future__ import annotations

import copy
import gc
import time
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _helpers import rel_err, setup_error_with_rank_1_short, tiny_engine, train
from _tiny_gpt import batches, lm_loss, make, param_groups

from lightning_zero_offload import ZeroOffload
from lightning_zero_offload.core.dist.collectives import CollectiveError

TIMEOUT = 5.0  # collective_timeout_s of the 2-rank failure cases
MARGIN = 25.0  # process start, gloo connection teardown, a loaded 2-core machine


def _engine(seed: int = 0, **kw: Any) -> ZeroOffload:
    kw.setdefault("precision", "32-true")
    return tiny_engine(seed, max_grad_norm=1.0, collective_timeout_s=TIMEOUT, **kw)


def _rank_data(rank: int, world: int, n: int) -> list:
    return [(x[rank::world], y[rank::world]) for x, y in batches(n)]


def _one_extra_step(rank: int, world: int) -> dict:
    engine = _engine()
    data = _rank_data(rank, world, 3)
    train(engine, data[:2])
    if rank == 0:  # stops stepping but stays alive: only the timeout can end rank 1's wait
        time.sleep(TIMEOUT + MARGIN + 5)
        return {"ok": True}
    start = time.monotonic()
    try:
        train(engine, data[2:])
    except CollectiveError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
def test_a_rank_that_steps_once_more_fails_within_the_timeout():
    _, late = run_ranks(_one_extra_step, 2, timeout=120)
    assert late["error"] is not None and late["seconds"] < TIMEOUT + MARGIN
    assert "on rank 1 failed or timed out" in late["error"]
    assert "the same number of times" in late["error"]


def _raises_mid_training(rank: int, world: int) -> dict:
    engine = _engine()
    data = _rank_data(rank, world, 4)
    start = time.monotonic()
    try:
        try:
            train(engine, data[:1])
            if rank == 1:
                raise RuntimeError("user code failed on rank 1")
            train(engine, data[1:])  # rank 0 waits in a reduce-scatter rank 1 never joins
        finally:
            engine.teardown()  # during the exception: starts no collective on rank 1
    except CollectiveError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    except RuntimeError as e:
        time.sleep(2)  # stay alive a moment: rank 0 must fail by the timeout, not our exit
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_other_naming_it():
    first, second = run_ranks(_raises_mid_training, 2, timeout=120)
    assert second["error"] == "user code failed on rank 1" and second["seconds"] < 10
    assert first["error"] is not None and first["seconds"] < TIMEOUT + MARGIN
    assert "rank 1 failed first" in first["error"] and "user code failed" in first["error"]


def _different_models(rank: int, world: int, what: str) -> str:
    model = make(layers=2 if rank == 0 or what != "layers" else 1)
    if what == "shape" and rank == 1:  # same numel, another shape
        model.head.weight = torch.nn.Parameter(model.head.weight.detach().reshape(32, 64))
    try:
        ZeroOffload(model, torch.optim.AdamW(model.parameters()), collective_timeout_s=TIMEOUT)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("what", ["shape", "layers"])
def test_ranks_with_different_models_are_refused_on_every_rank(what: str):
    errors = run_ranks(_different_models, 2, what, timeout=120)
    for e in errors:
        assert "the ranks hold different models: rank 1 has" in e, e
        if what == "shape":
            assert "'head.weight': shape (32, 64)" in e and "shape (64, 32)" in e


def _different_starts(rank: int, world: int) -> list:
    engine = _engine(seed=rank)  # each rank initialised differently: rank 0's start wins
    train(engine, _rank_data(rank, world, 3))
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.slow
def test_ranks_start_from_rank_zero_weights():
    got = run_ranks(_different_starts, 2, timeout=120)
    ref = make(0)
    opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    for x, y in batches(3):
        lm_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for r in range(2):
        for a, b in zip(ref.parameters(), got[r], strict=True):
            assert rel_err(b, a) < 1e-5


def _memory_on_one_rank(rank: int, world: int) -> str:
    return setup_error_with_rank_1_short(rank, _engine)


@pytest.mark.slow
def test_not_enough_host_memory_on_one_rank_stops_every_rank():
    for e in run_ranks(_memory_on_one_rank, 2, timeout=120):
        assert e.startswith("ZeroOffload: rank 1 failed its setup checks (MemoryError")


def test_a_bad_hyperparameter_set_after_setup_changes_nothing():
    engine = _engine()
    data = batches(3)
    train(engine, data[:1])
    before = copy.deepcopy(engine.state_dict())
    weights = [p.detach().clone() for p in engine.module.parameters()]
    x, y = data[1]
    engine.backward(lm_loss(engine.module(x), y))
    engine.optimizer.param_groups[1]["weight_decay"] = -0.1
    with pytest.raises(ValueError, match=r"param group 1 has weight_decay=-0.1.*Nothing was"):
        engine.step()
    after = engine.state_dict()
    for a, b in zip(before["groups"], after["groups"], strict=True):
        assert a["step"] == b["step"]
        assert all(torch.equal(a[k], b[k]) for k in ("master", "exp_avg", "exp_avg_sq"))
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters(),
                                                 strict=True))
    engine.optimizer.param_groups[1]["weight_decay"] = 0.0  # fixed: the retry equals torch
    engine.step()
    engine.zero_grad()
    train(engine, data[2:])
    ref = make(0)
    opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    for x, y in data:
        lm_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), engine.module.parameters(), strict=True):
        assert ((a - b).norm() / a.norm()).item() < 1e-5


@pytest.mark.parametrize(("key", "value", "message"), [
    ("betas", (0.9, 1.0), "betas\\[1\\]=1.0"), ("lr", float("nan"), "lr=nan"),
    ("maximize", True, "now uses maximize=True")])
def test_unsupported_or_invalid_group_options_after_setup(key, value, message):
    engine = _engine()
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x), y))
    engine.optimizer.param_groups[0][key] = value
    with pytest.raises(ValueError, match=message):
        engine.step()


def test_the_fp16_loss_scale_cannot_fall_to_zero():
    engine = _engine(precision="16-mixed", initial_loss_scale=1.0)
    x, y = batches(1)[0]
    with pytest.raises(FloatingPointError, match="the fp16 loss scale fell below"):
        for _ in range(40):
            engine.backward(lm_loss(engine.module(x), y) * float("inf"))
            engine.step()
            engine.zero_grad()


def test_state_calls_after_teardown_say_so():
    engine = _engine()
    train(engine, batches(1))
    engine.teardown()
    for call in (engine.state_dict, engine.synchronize, engine.full_state_dict):
        with pytest.raises(RuntimeError, match="torn down .* save before teardown"):
            call()


def _live_bytes() -> int:
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # tensors without storage
            pass
    return sum(seen.values())


def test_dropped_engines_free_their_memory():
    """The module's hooks hold the engine weakly: 20 engines built and dropped without
    teardown leave nothing behind."""
    base = _live_bytes()
    for i in range(20):
        model = make(i, d=128)
        engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()), precision="32-true")
        train(engine, batches(1))
        del engine, model
    assert _live_bytes() - base < 2**20


def _drop_engines(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    alive = []
    for i in range(3):  # dropped without teardown
        model = make(i, d=32)
        engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()), precision="32-true")
        train(engine, batches(1))
        group = engine.process_group
        assert group is not dist.group.WORLD
        del engine, model
        gc.collect()
        alive.append(group in dist.distributed_c10d._world.pg_map)
    return alive


def test_dropped_engines_release_their_process_groups():
    """Each engine's own group (with the collective timeout) goes with the engine."""
    assert run_ranks(_drop_engines, 2) == [[False] * 3] * 2


def test_inputs_that_would_break_in_backward_or_forward_are_refused_at_setup():
    model = make()
    twice = [{"params": list(model.parameters())}, {"params": [model.head.weight]}]
    with pytest.raises(ValueError, match="'head.weight' appears twice"):
        ZeroOffload(model, torch.optim.AdamW(twice[0]["params"] + twice[1]["params"]))
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="already driven by another ZeroOffload engine"):
        ZeroOffload(model, torch.optim.AdamW(model.parameters()))
    engine.module.half()
    x, _ = batches(1)[0]
    with pytest.raises(RuntimeError, match="no longer lives in the engine's flat buffer"):
        engine.module(x)
    with torch.device("meta"):
        meta = make()
    with pytest.raises(ValueError, match="on the meta device"):
        ZeroOffload(meta, torch.optim.AdamW(meta.parameters()))


def _raised_in_torch_distributed(error: BaseException) -> BaseException:
    """``error`` raised from a frame whose file is torch.distributed's (as DTensor ops are)."""
    code = compile("raise error", "/site-packages/torch/distributed/tensor/_fake.py", "exec")
    try:
        exec(code, {"error": error})
    except BaseException as e:
        return e
    raise AssertionError("not raised")


def test_reported_rewraps_a_lost_peer_but_not_a_local_error() -> None:
    """Under tensor parallelism a local error in a DTensor op (a shape mismatch, an OOM) passes
    through torch.distributed's code: it surfaces as itself; a lost peer's words from there
    become the engine's CollectiveError."""
    from lightning_zero_offload.core.dist import collectives

    local = _raised_in_torch_distributed(RuntimeError("a and b must have same reduction dim"))
    with pytest.raises(RuntimeError, match="same reduction dim") as info:
        with collectives.reported("the forward", None):
            raise local
    assert info.type is RuntimeError
    oom = _raised_in_torch_distributed(torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        with collectives.reported("the forward", None):
            raise oom
    lost = _raised_in_torch_distributed(RuntimeError("[gloo] Connection reset by peer"))
    with pytest.raises(collectives.CollectiveError, match="the forward on rank 0 failed"):
        with collectives.reported("the forward", None):
            raise lost


def test_the_first_failure_note_stays_when_two_ranks_fail_at_once(monkeypatch) -> None:
    """Two ranks failing together both leave a note: the first one written stays. The store
    here never shows a key to ``check``, as a peer's note in flight would not be seen yet; a
    check-then-set would let the second note overwrite the first."""
    import torch.distributed as dist

    from lightning_zero_offload.core.dist import collectives

    class InFlight(dist.HashStore):
        def check(self, keys: list[str]) -> bool:  # the peer's note is not seen yet
            return False

    store = InFlight()
    monkeypatch.setattr(collectives, "_store", lambda: store)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for rank, error in ((1, MemoryError("host short")), (0, ValueError("later"))):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        collectives.report_failure(error)
    assert store.get(collectives._KEY).decode() == "rank 1: MemoryError: host short"
