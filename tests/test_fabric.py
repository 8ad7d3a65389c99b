"""Fabric(strategy="zero_offload") against plain Fabric, save/load, and its errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _helpers import SubAdamW
from lightning.fabric import Fabric, seed_everything
from torch import nn
from torch.multiprocessing import ProcessExitedException

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")
from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy

ACCUMULATE = 2


pytestmark = pytest.mark.usefixtures("isolated_process_group")


def batches(n: int = 16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def make(strategy="auto", precision="32-true", optimizer_cls=torch.optim.AdamW):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = optimizer_cls(model.parameters(), lr=5e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def train(fabric, model, optimizer, data, steps: int) -> list[float]:
    """Accumulation over ACCUMULATE micro-batches and clipping by norm, as a user writes it."""
    norms = []
    for step in range(steps):
        for micro in range(ACCUMULATE):
            x, y = data[(step * ACCUMULATE + micro) % len(data)]
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = nn.functional.mse_loss(model(x).float(), y) / ACCUMULATE
                fabric.backward(loss)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=1.0)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def test_matches_plain_fabric_fp32():
    data = batches()
    plain = make("auto")
    plain_norms = train(*plain, data, steps=5)
    offload = make("zero_offload")
    assert isinstance(offload[0].strategy, ZeroOffloadFabricStrategy)
    offload_norms = train(*offload, data, steps=5)
    torch.testing.assert_close(
        torch.tensor(offload_norms), torch.tensor(plain_norms), rtol=1e-5, atol=0
    )
    offload[0].strategy.teardown()  # hands the fp32 masters back to the module
    ref = weights(plain[1])
    for k, v in weights(offload[1]).items():
        assert (v - ref[k]).norm() / ref[k].norm() < 1e-5, k


@pytest.mark.parametrize("sharded", [False, True])
def test_save_load_resumes_exactly(tmp_path, sharded):
    data = batches()
    strategy = ZeroOffloadFabricStrategy(sharded_checkpoint=sharded)
    fabric, model, optimizer = make(strategy)
    train(fabric, model, optimizer, data, steps=2)
    path = tmp_path / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    train(fabric, model, optimizer, data[4:], steps=2)
    expected = weights(model)

    fabric2, model2, optimizer2 = make(ZeroOffloadFabricStrategy(sharded_checkpoint=sharded))
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    remainder = fabric2.load(path, state)
    assert state["step"] == 2 and remainder == {}
    train(fabric2, model2, optimizer2, data[4:], steps=2)
    for k, v in weights(model2).items():
        assert torch.equal(v, expected[k]), k
    if not sharded:  # a consolidated file is plain PyTorch: fp32 weights, AdamW state
        saved = torch.load(path, weights_only=True)
        plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        plain.load_state_dict(saved["model"])
        torch.optim.AdamW(plain.parameters()).load_state_dict(saved["optimizer"])


class OwnStepAdamW(torch.optim.AdamW):
    def step(self, closure=None):  # a different update the fused CPU step would not run
        return super().step(closure)


def _matches_plain_fabric(optimizer_cls: type) -> None:
    data = batches()
    plain = make("auto", optimizer_cls=optimizer_cls)
    train(*plain, data, steps=3)
    offload = make("zero_offload", optimizer_cls=optimizer_cls)
    train(*offload, data, steps=3)
    offload[0].strategy.teardown()
    ref = weights(plain[1])
    for k, v in weights(offload[1]).items():
        assert (v - ref[k]).norm() / ref[k].norm() < 1e-5, k


def test_adamw_subclass_matches_plain_fabric():
    _matches_plain_fabric(SubAdamW)
    with pytest.raises(TypeError, match="OwnStepAdamW overrides step"):
        make("zero_offload", optimizer_cls=OwnStepAdamW)


def test_lion_matches_plain_fabric():
    _matches_plain_fabric(pytest.importorskip("lion_pytorch").Lion)


def test_precision_is_fabrics_and_an_explicit_other_one_raises():
    from lightning_zero_offload import ZeroOffloadConfig

    for config in (ZeroOffloadConfig(), ZeroOffloadConfig(precision="bf16-mixed")):
        fabric, model, _ = make(ZeroOffloadFabricStrategy(config), precision="bf16-mixed")
        assert fabric.strategy.engine.config.precision == "bf16-mixed"
        assert next(model.parameters()).dtype == torch.bfloat16
    match = r"precision='bf16-mixed'\) does not match Fabric\(precision='32-true'\)"
    with pytest.raises(ValueError, match=match):
        make(ZeroOffloadFabricStrategy(ZeroOffloadConfig(precision="bf16-mixed")))


def test_bf16_mixed_runs_and_loss_falls():
    fabric, model, optimizer = make("zero_offload", precision="bf16-mixed")
    assert next(model.parameters()).dtype == torch.bfloat16
    x, y = batches(1)[0]
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]



def test_partial_offload_options_reach_the_engine():
    strategy = ZeroOffloadFabricStrategy(offload_fraction=0.5, device_memory_headroom=0.3)
    fabric, _, _ = make(strategy)
    assert fabric.strategy.engine is not None
    config = fabric.strategy.engine.config
    assert (config.offload_fraction, config.device_memory_headroom) == (0.5, 0.3)
    fabric.strategy.teardown()
    with pytest.raises(ValueError, match=r'offload_fraction must be .* or "auto", got -0.5'):
        ZeroOffloadFabricStrategy(offload_fraction=-0.5)
    with pytest.raises(ValueError, match=r"device_memory_headroom must be a number in \[0, 1\)"):
        ZeroOffloadFabricStrategy(device_memory_headroom=2)

def test_errors():
    with pytest.raises(ValueError, match="64-true"):
        Fabric(accelerator="cpu", strategy="zero_offload", precision="64-true")
    with pytest.raises(TypeError, match="AdamW"):
        make("zero_offload", optimizer_cls=torch.optim.RMSprop)
    fabric, model, optimizer = make("zero_offload")
    x, y = batches(1)[0]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(ValueError, match="max_norm"):
        fabric.clip_gradients(model, optimizer, clip_val=0.5)
    with pytest.raises(ValueError, match="through a dict"):
        fabric.strategy.load_checkpoint("unused", state=model.module)
    fabric2 = Fabric(accelerator="cpu", devices=1, strategy="zero_offload")
    fabric2.launch()
    module = fabric2.setup_module(nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="jointly"):
        fabric2.setup_optimizers(torch.optim.AdamW(module.parameters()))


def _two_rank_run(fabric: Fabric) -> dict:
    seed_everything(fabric.global_rank)  # different starting weights: rank 0's must win
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    train(fabric, model, optimizer, batches()[fabric.global_rank :: 2], steps=3)
    if isinstance(fabric.strategy, ZeroOffloadFabricStrategy):
        fabric.strategy.teardown()  # collective: gathers the fp32 masters into the module
    return {k: v.numpy() for k, v in weights(model).items()}  # tensors would go by shared memory


@pytest.mark.slow
def test_two_processes_match_ddp():
    """2 CPU ranks (gloo), accumulation with no_backward_sync and clipping: same as DDP."""
    # A spawned worker sometimes aborts in gloo's exit path ("terminate called without an
    # active exception", SIGABRT): the DDP reference 2 launches in 20 on the 2-core machine,
    # ours 0 in 37 and then once in a full suite (2026-12-04). Each gets three launches, and
    # only that abort is launched again.
    def launch(strategy: Callable[[], object]) -> dict:
        for attempt in range(3):
            try:
                return Fabric(accelerator="cpu", devices=2, strategy=strategy()).launch(
                    _two_rank_run)
            except ProcessExitedException as e:
                if attempt == 2 or e.signal_name != "SIGABRT":
                    raise
        raise AssertionError("unreachable")

    ref = launch(lambda: "ddp_spawn")
    off = launch(lambda: ZeroOffloadFabricStrategy(start_method="spawn"))
    ref, off = ({k: torch.from_numpy(v) for k, v in r.items()} for r in (ref, off))
    for k, v in off.items():
        assert (v - ref[k]).norm() / ref[k].norm() < 1e-5, k


def test_scheduler_passed_to_setup_drives_the_engine():
    results = []
    for strategy in ("auto", "zero_offload"):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        fabric.launch()
        seed_everything(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
        for x, y in batches(3):
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        assert optimizer.param_groups[0]["lr"] == 5e-2 / 8
        if strategy == "zero_offload":
            fabric.strategy.teardown()
        results.append(weights(model))
    for k, v in results[1].items():
        assert (v - results[0][k]).norm() / results[0][k].norm() < 1e-5, k
