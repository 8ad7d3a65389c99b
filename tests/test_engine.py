"""Single-rank engine tests: the engine against torch.optim.AdamW on the same model and data."""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import rel_err, train
from _helpers import tiny_engine as engine_for  # the name the tests here always used
from _tiny_gpt import batches, lm_loss, make, param_groups
from torch import nn

from lightning_zero_offload import ZeroOffload, ZeroOffloadConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(steps: int, clip: float | None = None, optim=torch.optim.AdamW, seed: int = 0,
              sched=None, **kw):
    model = make(seed)
    opt = optim(param_groups(model), lr=1e-2, weight_decay=0.1, **kw)
    scheduler = sched(opt) if sched else None
    norms = []
    for x, y in batches(steps):
        lm_loss(model(x), y).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        if scheduler:
            scheduler.step()
    return model, opt, norms


def test_fp32_matches_torch_adamw_with_clipping():
    ref, _, ref_norms = reference(20, clip=0.5)
    engine = engine_for(precision="32-true", max_grad_norm=0.5)
    assert len(engine.layout.buckets) > 3
    norms = train(engine, batches(20)).norms
    assert rel_err(engine.module, ref) < 1e-5
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert engine.last_grad_norm == pytest.approx(ref_norms[-1], rel=1e-5)


def test_clip_grad_norm_method_matches_torch():
    ref, _, ref_norms = reference(10, clip=0.3)
    engine = engine_for(precision="32-true")
    norms = []
    for x, y in batches(10):
        engine.backward(lm_loss(engine.module(x), y))
        norms.append(engine.clip_grad_norm_(0.3).item())
        engine.step()
        engine.zero_grad()
    assert rel_err(engine.module, ref) < 1e-5
    assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_no_clipping_and_adam_l2_decay():
    ref, _, _ = reference(10, optim=torch.optim.Adam)
    engine = engine_for(precision="32-true", optim=torch.optim.Adam)
    assert train(engine, batches(10)).norms == [None] * 10
    assert rel_err(engine.module, ref) < 1e-5


@pytest.mark.parametrize("sched", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
])
def test_lr_schedulers_on_facade(sched):
    ref, ref_opt, _ = reference(8, clip=1.0, sched=sched)
    engine = engine_for(precision="32-true", max_grad_norm=1.0)
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    train(engine, batches(8), sched=sched(engine.optimizer))
    assert rel_err(engine.module, ref) < 1e-5
    assert [g["lr"] for g in engine.optimizer.param_groups] == pytest.approx(
        [g["lr"] for g in ref_opt.param_groups])


def test_bf16_mixed_weights_are_views_and_track_fp32():
    ref, _, _ = reference(10, clip=1.0)
    engine = engine_for(precision="bf16-mixed", max_grad_norm=1.0)
    assert engine.compute_dtype == torch.bfloat16
    for p in engine.module.parameters():
        assert p.dtype == torch.bfloat16
    for group in engine.optimizer.param_groups:  # one flat device buffer per group
        assert len({p.untyped_storage().data_ptr() for p in group["params"]}) == 1
    train(engine, batches(10))
    full = engine.full_state_dict()["model"]
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, full[name].to(torch.bfloat16))  # device copy = rounded master
    # Against fp32 torch, not the engine's arithmetic: bf16 forwards and backwards round by the
    # CPU's path (oneDNN's and ATen's kernels), 2.7e-2 (ATEN_CPU_CAPABILITY=default) to 3.0e-2
    # (AVX-512) here after 10 steps; the bound leaves that spread a margin of about 2.
    assert rel_err(engine.module, ref) < 6e-2
    assert engine.module.blocks[0].ln1.weight.dtype == torch.bfloat16
    out = engine.module(batches(1)[0][0])  # inputs are cast by the pre-hook; ints untouched
    assert out.dtype == torch.bfloat16


def test_full_state_dict_is_torch_format_and_round_trips():
    engine = engine_for(precision="32-true", max_grad_norm=1.0)
    train(engine, batches(5))
    full = engine.full_state_dict()
    plain = make(1)
    plain.load_state_dict(full["model"])
    opt = torch.optim.AdamW(param_groups(plain), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(full["optimizer"])
    data = batches(5, seed=1)
    for x, y in data:
        lm_loss(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    train(engine, data)
    assert rel_err(engine.module, plain) < 1e-5
    # and a plain pair loads into a fresh engine, which then continues like the plain run
    fresh = engine_for(seed=3, precision="32-true", max_grad_norm=1.0)
    fresh.load_full_state_dict({"model": plain.state_dict(), "optimizer": opt.state_dict()})
    assert rel_err(fresh.module, plain) == 0
    data = batches(3, seed=2)
    train(fresh, data)
    for x, y in data:
        lm_loss(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert rel_err(fresh.module, plain) < 1e-5


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_resume_from_state_dict_is_bit_identical(precision):
    data = batches(8)
    whole = engine_for(precision=precision, max_grad_norm=1.0)
    train(whole, data)
    first = engine_for(precision=precision, max_grad_norm=1.0)
    train(first, data[:4])
    saved = copy.deepcopy(first.state_dict())
    train(first, batches(2, seed=9))  # training on must not change what was saved
    second = engine_for(seed=5, precision=precision, max_grad_norm=1.0)
    second.optimizer.load_state_dict(saved)
    train(second, data[4:])
    for a, b in zip(whole.module.parameters(), second.module.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(whole.state_dict()["groups"], second.state_dict()["groups"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("master", "exp_avg", "exp_avg_sq"))
    assert whole.loss_scale == second.loss_scale


def test_accumulation_equals_big_batch():
    big = [(torch.cat([x for x, _ in batches(4, seed=s)]), torch.cat([y for _, y in
            batches(4, seed=s)])) for s in range(3)]
    one = engine_for(precision="32-true", max_grad_norm=0.5)
    train(one, big)
    four = engine_for(precision="32-true", max_grad_norm=0.5)
    for s in range(3):
        for x, y in batches(4, seed=s):
            four.backward(lm_loss(four.module(x), y) / 4)
        four.step()
        four.zero_grad()
    assert rel_err(four.module, one.module) < 1e-5
    # no_sync (local accumulation on the device) gives the same result at one rank
    ns = engine_for(precision="32-true", max_grad_norm=0.5)
    for s in range(3):
        mb = batches(4, seed=s)
        with ns.no_sync():
            for x, y in mb[:3]:
                ns.backward(lm_loss(ns.module(x), y) / 4)
        ns.backward(lm_loss(ns.module(mb[3][0]), mb[3][1]) / 4)
        ns.step()
        ns.zero_grad()
    assert rel_err(ns.module, one.module) < 1e-5


def test_a_backward_that_does_not_sync_keeps_its_gradients_on_the_device():
    """``sync_gradients=False`` and ``no_sync()`` send nothing (no bucket flushed, every
    ``.grad`` kept); the next backward that syncs sends each bucket once, with them; a plain
    ``loss.backward()`` outside ``no_sync()`` sends too."""
    engine = engine_for(precision="32-true")
    streamer, params = engine._streamer, list(engine.module.parameters())
    (x, y), (x2, y2), (x3, y3) = batches(3)
    engine.backward(lm_loss(engine.module(x), y), sync_gradients=False)
    with engine.no_sync():
        lm_loss(engine.module(x2), y2).backward()
    assert streamer.flushes == [0] * len(streamer.flushes)
    assert all(p.grad is not None for p in params)
    engine.backward(lm_loss(engine.module(x3), y3))
    assert streamer.flushes == [1] * len(streamer.flushes)
    assert all(p.grad is None for p in params)
    lm_loss(engine.module(x), y).backward()
    assert streamer.flushes == [2] * len(streamer.flushes)


def test_fp16_overflow_skips_exactly_that_step():
    engine = engine_for(precision="16-mixed", max_grad_norm=1.0, initial_loss_scale=1024.0)
    data = batches(5)
    train(engine, data[:2])
    before = copy.deepcopy(engine.state_dict())
    weights = [p.detach().clone() for p in engine.module.parameters()]
    x, y = data[2]
    loss = lm_loss(engine.module(x), y)
    engine.backward(loss * float("inf"))
    engine.step()
    engine.zero_grad()
    assert engine.last_step_skipped and engine.loss_scale == 512.0
    after = engine.state_dict()
    for a, b in zip(before["groups"], after["groups"], strict=True):
        assert a["step"] == b["step"]
        assert all(torch.equal(a[k], b[k]) for k in ("master", "exp_avg", "exp_avg_sq"))
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.module.parameters(), strict=True))
    train(engine, data[2:])
    assert not engine.last_step_skipped and engine.state_dict()["groups"][0]["step"] == 5
    assert engine.state_dict()["scaler"]["scale"] == 512.0


def test_fp16_scaler_grows_and_is_checkpointed():
    engine = engine_for(precision="16-mixed", initial_loss_scale=8.0, loss_scale_growth_interval=2)
    train(engine, batches(4))
    assert engine.loss_scale == 32.0
    other = engine_for(precision="16-mixed", initial_loss_scale=8.0)
    other.load_state_dict(copy.deepcopy(engine.state_dict()))
    assert other.loss_scale == 32.0


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(torch.tanh(self.mid(self.emb(x)))))


def test_tied_frozen_and_unused_parameters():
    torch.manual_seed(0)
    ref = Tied()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                         precision="32-true", bucket_size_mb=0.001)
    assert len(engine.layout.slots) == 5  # emb/head once, mid w+b, unused w+b; frozen not managed
    frozen = [p.detach().clone() for p in model.frozen.parameters()]
    unused = [p.detach().clone() for p in model.unused.parameters()]
    for _ in range(5):
        x = torch.randint(0, 10, (4, 3))
        loss = ref(x).square().mean()
        loss.backward()
        ref_opt.step()  # the unused layer has no grad: torch leaves it (and its state) alone
        ref_opt.zero_grad()
        engine.backward(engine.module(x).square().mean())
        engine.step()
        engine.zero_grad()
    assert engine.module.head.weight is engine.module.emb.weight
    assert rel_err(engine.module, ref) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.frozen.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(unused, model.unused.parameters(), strict=True))
    full = engine.full_state_dict()
    assert torch.equal(full["model"]["head.weight"], full["model"]["emb.weight"])
    assert full["optimizer"]["state"].keys() == ref_opt.state_dict()["state"].keys()


def test_frozen_parameters_keep_their_exact_values_in_half_precision(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    frozen = {k: v.detach().clone() for k, v in model.frozen.named_parameters()}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in frozen.values())  # would round
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                         precision="bf16-mixed")
    assert engine.module.frozen.weight.dtype == torch.bfloat16  # forward runs in bf16
    engine.backward(engine.module(torch.randint(0, 10, (4, 3))).float().square().mean())
    engine.step()
    full = engine.full_state_dict()["model"]
    for k, v in frozen.items():
        assert torch.equal(full[f"frozen.{k}"], v)
    engine.save_checkpoint(tmp_path / "ckpt")
    other_model = Tied()
    other = ZeroOffload(other_model, torch.optim.AdamW(other_model.parameters(), lr=0.05),
                        precision="bf16-mixed")
    other.load_checkpoint(tmp_path / "ckpt")
    other.teardown()
    for k, v in frozen.items():
        assert torch.equal(getattr(other_model.frozen, k), v)
    engine.teardown()
    for k, v in frozen.items():
        assert torch.equal(getattr(model.frozen, k), v)


def test_module_zero_grad_clears_the_engines_gradients():
    """Loops that zero through the model (the transformers Trainer) must not accumulate."""
    model = make()
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                         precision="32-true")
    ref_model = make()
    ref = ZeroOffload(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=0.05),
                      precision="32-true")
    (x1, y1), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine.module(x1), y1))
    engine.module.zero_grad()  # discards the first batch's gradients
    engine.backward(lm_loss(engine.module(x2), y2))
    engine.step()
    ref.backward(lm_loss(ref.module(x2), y2))
    ref.step()
    assert rel_err(engine.module, ref.module) == 0.0
    engine.teardown()
    assert "zero_grad" not in model.__dict__


_STRANGER = nn.Parameter(torch.zeros(3))
_SETUP_ERRORS = {  # name: (build the engine or config, error, message)
    "rmsprop": (lambda m: ZeroOffload(m, torch.optim.RMSprop(m.parameters(), lr=0.1)), TypeError,
            "AdamW and torch.optim.Adam"),
    "amsgrad": (lambda m: ZeroOffload(m, torch.optim.AdamW(m.parameters(), amsgrad=True)),
                ValueError, "amsgrad"),
    "maximize": (lambda m: ZeroOffload(m, torch.optim.Adam(m.parameters(), maximize=True)),
                 ValueError, "maximize"),
    "stranger": (lambda m: ZeroOffload(m, torch.optim.AdamW([*m.parameters(), _STRANGER])),
                 ValueError, "not a parameter of the module"),
    "sparse": (lambda m: ZeroOffload(s := nn.Embedding(4, 4, sparse=True),
                                     torch.optim.Adam(s.parameters())), ValueError, "sparse"),
    "precision": (lambda m: ZeroOffload(m, torch.optim.AdamW(m.parameters()),
                                        precision="bf16-true"), ValueError, "precision"),
    "typo": (lambda m: ZeroOffload(m, torch.optim.AdamW(m.parameters()), max_grad_nrom=1.0),
             TypeError, "unknown option"),
    "max_grad_norm": (lambda m: ZeroOffloadConfig(max_grad_norm=-1.0), ValueError,
                      "max_grad_norm"),
    "bucket_size_mb": (lambda m: ZeroOffloadConfig(bucket_size_mb=0), ValueError,
                       "bucket_size_mb"),
}


@pytest.mark.parametrize("case", sorted(_SETUP_ERRORS))
def test_bad_setup_inputs_raise_clear_errors(case):
    build, error, match = _SETUP_ERRORS[case]
    with pytest.raises(error, match=match):
        build(make())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_cuda_options_without_cuda_raise():
    with pytest.raises(ValueError, match="pin_memory"):
        ZeroOffloadConfig(pin_memory=True)
    model = make()
    with pytest.raises(ValueError, match="CUDA"):
        ZeroOffload(model, torch.optim.AdamW(model.parameters()), device="cuda")


def test_bad_uses_of_a_built_engine_raise_clear_errors():
    model = make()
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="already belongs"):
        ZeroOffload(model, engine.optimizer)
    with pytest.raises(RuntimeError, match="cannot be added"):
        engine.optimizer.add_param_group({"params": [_STRANGER]})
    with pytest.raises(ValueError, match="not a ZeroOffload shard"):
        engine.load_state_dict({"foo": 1})
    with pytest.raises(ValueError, match="model keys"):
        engine.load_full_state_dict({"model": {"x": torch.zeros(1)}})


def test_parameters_added_after_setup_fail_at_step():
    engine = engine_for(precision="32-true")
    engine.inner_optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine.module(x), y))
    with pytest.raises(RuntimeError, match="changed after setup"):
        engine.step()
    engine = engine_for(precision="32-true")
    engine.module.extra = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="gained or lost parameters"):
        engine.step()
    engine = engine_for(precision="bf16-mixed")
    engine.module.float()
    with pytest.raises(RuntimeError, match="flat buffer"):
        engine.step()


def test_grad_norm_paths_agree_with_torch():
    """The device-side sum of squares (one flush per bucket), the host pass (two micro-batches)
    and the inf-norm all equal torch's clip_grad_norm_ on the whole model."""
    x, y = batches(1)[0]
    ref = make()
    lm_loss(ref(x), y).backward()
    want = {p: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, p).item()
            for p in (2.0, float("inf"))}
    for micro in (1, 2):
        for norm_type, expected in want.items():
            engine = engine_for(precision="32-true")
            for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
                engine.backward(lm_loss(engine.module(xs), ys) * xs.shape[0] / x.shape[0])
            got = engine.clip_grad_norm_(1e9, norm_type).item()
            assert got == pytest.approx(expected, rel=1e-5), (micro, norm_type)


def test_checkpoint_files_are_atomic_and_corruption_is_reported(tmp_path, monkeypatch):
    from lightning_zero_offload.core import CheckpointError
    from lightning_zero_offload.core.checkpoint import files

    engine = engine_for(precision="32-true")
    train(engine, batches(2))
    good = tmp_path / "full.pt"
    engine.save_checkpoint(good, sharded=False)
    saved = [p.detach().clone() for p in engine.module.parameters()]
    train(engine, batches(1, seed=3))

    def crash(obj, path):  # the checkpoint writer dies after writing part of the file
        path.write_bytes(b"PK\x03\x04 partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(files.stream, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(good, sharded=False)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path / "sharded")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]  # a failed save leaves none
    with pytest.raises(CheckpointError, match="no checkpoint"):
        engine.load_checkpoint(tmp_path / "sharded")
    engine.load_checkpoint(good)  # the old file is intact
    assert all(torch.equal(a, b) for a, b in zip(saved, engine.module.parameters(), strict=True))

    engine.save_checkpoint(tmp_path / "sharded")  # a stale .tmp folder is replaced
    engine.load_checkpoint(tmp_path / "sharded")
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        engine.load_checkpoint(bad)
    torch.save({"x": 1}, bad)
    with pytest.raises(CheckpointError, match="not a lightning_zero_offload checkpoint"):
        engine.load_checkpoint(bad)


def test_preflight_reports_both_numbers_and_changes_nothing(monkeypatch):
    from lightning_zero_offload.core.buckets import preflight

    class Mem:
        available = 1000

    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: Mem())
    model = make()
    before = [(p.data_ptr(), p.dtype) for p in model.parameters()]
    # a small figure in the unit that shows it (not "0.00 GiB"), with the exact byte count
    with pytest.raises(MemoryError, match=r"needs \d+\.\d\d [KM]iB \(\d+ bytes\) .* only "
                       r"1000 bytes is available"):
        ZeroOffload(model, torch.optim.AdamW(model.parameters()))
    assert [(p.data_ptr(), p.dtype) for p in model.parameters()] == before
    ZeroOffload(model, torch.optim.AdamW(model.parameters()), check_host_memory=False)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_teardown_returns_ordinary_fp32_parameters(precision):
    engine = engine_for(precision=precision)
    train(engine, batches(2))
    master = engine.full_state_dict()["model"]
    model = engine.module
    engine.teardown()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.untyped_storage().nbytes() == p.numel() * 4
        assert torch.equal(p.detach(), master[name])
    x, y = batches(1)[0]
    lm_loss(model(x), y).backward()  # hooks are gone: plain autograd fills .grad
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="torn down"):
        engine.step()


def test_full_state_dict_parts_equal_the_whole_and_gather_only_their_part(monkeypatch):
    from lightning_zero_offload.core.buckets.shard import HostShard

    engine = engine_for(precision="bf16-mixed", max_grad_norm=1.0)
    train(engine, batches(3))
    full = engine.full_state_dict()
    gathered = []
    read = HostShard.export
    monkeypatch.setattr(HostShard, "export",
                        lambda shard, kind: gathered.append(kind) or read(shard, kind))
    buckets = len(engine.layout.buckets)
    weights = engine.full_state_dict(optimizer=False)
    assert gathered == ["master"] * buckets and "optimizer" not in weights  # each bucket once
    assert weights["model"].keys() == full["model"].keys()
    for k, v in full["model"].items():
        assert v.dtype == torch.float32 and torch.equal(weights["model"][k], v)
    opt = engine.full_state_dict(model=False)
    assert sorted(set(gathered[buckets:])) == ["exp_avg", "exp_avg_sq"]  # the two moments
    assert len(gathered) == 3 * buckets and "model" not in opt
    assert opt["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]
    assert opt["optimizer"]["state"].keys() == full["optimizer"]["state"].keys()
    for i, st in full["optimizer"]["state"].items():
        assert all(torch.equal(opt["optimizer"]["state"][i][k], st[k]) for k in st)


def test_facade_is_named_after_the_wrapped_optimizer():
    """Frameworks name optimizers by class (LearningRateMonitor logs "lr-AdamW")."""
    from lightning_zero_offload.core.optimizer import OffloadOptimizer

    for optim in (torch.optim.AdamW, torch.optim.Adam):
        facade = engine_for(optim=optim).optimizer
        assert type(facade).__name__ == optim.__name__
        assert isinstance(facade, torch.optim.Optimizer) and isinstance(facade, OffloadOptimizer)
        assert not isinstance(facade, optim)
    assert type(engine_for().optimizer) is type(engine_for().optimizer)  # one class per name


def test_finished_profile_is_the_last_landed_step_on_the_cpu():
    engine = engine_for(precision="32-true")
    assert engine.finished_profile() is None
    train(engine, batches(2))
    prof = engine.finished_profile()
    assert prof is engine.last_profile and prof.step == 2 and prof.cpu_step > 0


def test_facade_closure_state_dict_and_mismatched_shard():
    engine = engine_for(precision="32-true")
    x, y = batches(1)[0]

    def closure():
        loss = lm_loss(engine.module(x), y)
        engine.backward(loss)
        return loss

    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine.optimizer.step(closure)
    assert loss is not None and [g["step"] for g in engine.state_dict()["groups"]] == [1, 1]
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(),
                                                         strict=True))
    shard = engine.optimizer.state_dict()
    assert shard["groups"][0]["step"] == 1
    small = make(layers=1)
    other = ZeroOffload(small, torch.optim.AdamW(param_groups(small)))
    with pytest.raises(ValueError, match="different model"):
        other.load_state_dict(shard)
    with pytest.raises(ValueError, match="optimizer state does not match"):
        engine.load_full_state_dict({"model": engine.full_state_dict()["model"],
                                     "optimizer": {"state": {}, "param_groups": []}})


def test_pinned_staging_is_budgeted_after_rounding():
    """F1: torch's pinned allocator rounds each block up to a power of two; staging slices are
    packed into power-of-two blocks, so the budget is what is reserved and close to the bytes
    used, where one pinned buffer per group would reserve up to twice as much."""
    from lightning_zero_offload.core.buckets.host_plan import arena_blocks as _arena_blocks
    from lightning_zero_offload.core.buckets.host_plan import pinned_size

    assert [pinned_size(n) for n in (1, 2, 3, 1000, 2**20 + 1)] == [1, 2, 4, 1024, 2**21]
    slices = [25 * 2**20] * 537 + [7 * 2**20]  # a 6.7B-parameter model's bf16 bucket shards
    blocks, places = _arena_blocks(slices)
    reserved, used = sum(blocks), sum(slices)
    assert all(n & (n - 1) == 0 for n in blocks) and reserved < 1.03 * used
    assert all(off + s <= blocks[b] for (b, off), s in zip(places, slices, strict=True))
    assert len({p for p in places}) == len(places)  # no two slices at one place
    assert pinned_size(used) > 1.1 * reserved  # what a single rounded buffer would cost


def test_fwd_bwd_is_timed_when_a_submodule_is_called():
    """A training_step that calls ``self.backbone(x)`` never runs the wrapped module's forward;
    the profile still measures forward+backward."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make()

    model = Wrapper()
    engine = ZeroOffload(model, torch.optim.AdamW(model.parameters()), precision="32-true")
    for x, y in batches(2):
        engine.backward(lm_loss(engine.module.net(x), y))
        engine.step()
        engine.zero_grad()
    assert [r.step for r in engine.profile] == [1, 2]
    assert all(r.fwd_bwd > 0 for r in engine.profile)
