"""A save or a load holds no second copy of the optimizer state (issue: checkpoints at the host
floor). Each case runs in fresh spawned processes whose anonymous memory (RssAnon: pages of a
memory-mapped checkpoint do not count, the kernel drops them under pressure) a thread samples
every 2 ms; a save's or load's peak over the process's memory before it must stay within the
largest tensor or one bucket plus 64 MiB, and a save must give its memory back. The model
holds 25M trained parameters (about 300 MB of fp32 state), so a copy of the state would exceed
the bound several times over.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _dist import run_ranks

MiB = 2**20
LAYERS, WIDTH = 24, 1024  # 24 x 1M parameters, the largest tensor 4 MiB in fp32
BUCKET_MB = 4  # one bucket of 1M fp32 elements: its two moments in fp32 are 8 MiB
SLACK = 64 * MiB + 2 * BUCKET_MB * MiB
BOTH = ("sharded", "consolidated")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """The highest RssAnon seen while the block runs, over what it was before."""

    def __enter__(self) -> Peak:
        import gc

        gc.collect()
        self.before = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        import gc

        gc.collect()
        self.after = _rss_anon()
        self.peak = max(self.peak, self.after)

    @property
    def over(self) -> int:
        return self.peak - self.before


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                 for _ in range(LAYERS)])


def _engine(moment_dtype: str, fraction: object):
    from lightning_zero_offload import ZeroOffload

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroOffload(model, opt, precision="32-true", moment_dtype=moment_dtype,
                         offload_fraction=fraction, cpu_threads=1, bucket_size_mb=BUCKET_MB)
    x = torch.randn(4, WIDTH)
    engine.backward(model(x).square().mean())
    engine.step()
    engine.zero_grad()
    return engine


def _measure_engine(rank: int, world: int, case: tuple) -> dict:
    torch.set_num_threads(1)
    folder, moment_dtype, fraction, kinds = case
    engine = _engine(moment_dtype, fraction)
    out = {}
    for name, sharded in (("sharded", True), ("consolidated", False)):
        if name not in kinds:
            continue
        path = f"{folder}/{name}" + ("" if sharded else ".pt")
        with Peak() as save:
            engine.save_checkpoint(path, sharded=sharded)
        with Peak() as load:
            engine.load_checkpoint(path)
        out[name] = (save.over, save.after - save.before, load.over)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("world", "moment_dtype", "fraction", "kinds"), [
    (1, "fp32", 1.0, BOTH), (1, "int8", 1.0, BOTH), (2, "fp32", 1.0, BOTH),
    (2, "int8", 1.0, BOTH),
    (1, "fp32", 0.5, BOTH), (1, "int8", 0.5, BOTH)])
def test_engine_save_and_load_hold_no_second_copy(tmp_path, world, moment_dtype, fraction, kinds):
    results = run_ranks(_measure_engine, world, (str(tmp_path), moment_dtype, fraction, kinds),
                        timeout=300)
    for rank, res in enumerate(results):
        for name, (save, kept, load) in res.items():
            where = f"rank {rank} of {world}, {moment_dtype} moments, fraction {fraction}, {name}"
            assert save <= SLACK, f"{where}: the save peaked {save / MiB:.0f} MiB over before"
            assert kept <= 64 * MiB, f"{where}: the save kept {kept / MiB:.0f} MiB"
            assert load <= SLACK, f"{where}: the load peaked {load / MiB:.0f} MiB over before"


def _save_sharded(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    _engine("fp32", 1.0).save_checkpoint(f"{folder}/two_ranks")


def _measure_converted_load(rank: int, world: int, folder: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for moment_dtype in ("fp32", "int8"):  # another world size; and another moment_dtype
        engine = _engine(moment_dtype, 1.0)
        with Peak() as load:
            engine.load_checkpoint(f"{folder}/two_ranks")
        out[moment_dtype] = load.over
        engine.teardown()
        del engine
    return out


@pytest.mark.slow
def test_a_load_into_another_world_size_or_moment_dtype_holds_no_second_copy(tmp_path):
    run_ranks(_save_sharded, 2, str(tmp_path), timeout=300)
    (res,) = run_ranks(_measure_converted_load, 1, str(tmp_path), timeout=300)
    for moment_dtype, over in res.items():
        assert over <= SLACK, (f"loading 2 ranks' shards into 1 rank with {moment_dtype} moments "
                               f"peaked {over / MiB:.0f} MiB over before")


def _measure_trainer(rank: int, world: int, folder: str) -> dict:
    import lightning.pytorch as pl

    import lightning_zero_offload  # noqa: F401  (registers the strategy)

    torch.set_num_threads(1)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, _):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(4, WIDTH))
            return torch.utils.data.DataLoader(data, batch_size=2)

    def trainer(steps: int) -> pl.Trainer:
        strategy = lightning_zero_offload.ZeroOffloadStrategy(bucket_size_mb=BUCKET_MB)
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)

    path = f"{folder}/last.ckpt"
    # after fit the engine is gone: save at the end of the fit, as ModelCheckpoint does
    out: dict = {}

    class SaveInFit(pl.Callback):
        def on_train_end(self, trainer, module) -> None:
            with Peak() as save:
                trainer.save_checkpoint(path)
            out["save"] = (save.over, save.after - save.before)

    second = trainer(2)
    second.callbacks.append(SaveInFit())
    second.fit(Net())

    class Measured(lightning_zero_offload.ZeroOffloadStrategy):
        """Samples from the checkpoint's read to the end of its load into the engine (the
        strategy restores after setup: the engine is built before)."""

        def load_checkpoint(self, *args, **kwargs):
            self.peak = Peak().__enter__()
            return super().load_checkpoint(*args, **kwargs)

        def load_optimizer_state_dict(self, checkpoint):
            super().load_optimizer_state_dict(checkpoint)
            self.peak.__exit__()
            out["load"] = self.peak.over

    third = pl.Trainer(strategy=Measured(bucket_size_mb=BUCKET_MB), accelerator="cpu",
                       devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
    third.fit(Net(), ckpt_path=path)
    return out


@pytest.mark.slow
def test_trainer_save_checkpoint_and_ckpt_path_hold_no_second_copy(tmp_path):
    (res,) = run_ranks(_measure_trainer, 1, str(tmp_path), timeout=300)
    save, kept = res["save"]
    assert save <= SLACK, f"trainer.save_checkpoint peaked {save / MiB:.0f} MiB over before"
    assert kept <= 64 * MiB, f"trainer.save_checkpoint kept {kept / MiB:.0f} MiB"
    assert res["load"] <= SLACK, f"fit(ckpt_path=) peaked {res['load'] / MiB:.0f} MiB over before"
