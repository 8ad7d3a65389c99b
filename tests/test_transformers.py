"""ZeroOffloadTrainer against the plain transformers Trainer (fp32, CPU, tiny Llama)."""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import SubAdamW, total_rel_err

pytest.importorskip("transformers")

from _accelerate_state import reset_accelerate  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from lightning_zero_offload.transformers import (  # noqa: E402
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
)

STEPS = 6


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    for var in [v for v in os.environ if v.startswith("ZERO_OFFLOAD")]:
        monkeypatch.delenv(var)
    reset_accelerate()
    yield
    reset_accelerate()


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, cls=TrainingArguments, **kw):
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=2e-2, weight_decay=0.1,
                max_grad_norm=0.5, warmup_steps=1, lr_scheduler_type="linear", logging_steps=1,
                optim="adamw_torch", save_strategy="no", report_to=[], use_cpu=True, seed=3,
                disable_tqdm=True)
    base.update(kw)
    return cls(**base)


def _history(trainer) -> tuple[list, list]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def _master(trainer) -> dict:
    engine = getattr(trainer, "zero_offload_engine", None)
    if engine is None:
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return engine.full_state_dict()["model"]


def test_trainer_matches_plain_trainer(tmp_path):
    plain = Trainer(model=_model(), args=_args(tmp_path / "plain"), train_dataset=_Data())
    plain.train()
    reset_accelerate()
    ours = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(),
                              args=_args(tmp_path / "zo", ZeroOffloadTrainingArguments,
                                         zero_offload=True))
    ours.train()
    engine = ours.zero_offload_engine
    assert engine is not None and engine.compute_dtype == torch.float32
    assert ours.model is engine.module
    plain_loss, plain_norm = _history(plain)
    loss, norm = _history(ours)
    assert len(loss) == STEPS
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert norm == pytest.approx(plain_norm, rel=1e-5)
    assert max(norm) > 0.5  # clipping was active
    assert total_rel_err(_master(ours), _master(plain)) < 1e-5


def test_flag_from_environment_and_fp32_save_model(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_OFFLOAD", "1")
    trainer = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(),
                                 args=_args(tmp_path / "run", bf16=True, max_steps=2))
    trainer.train()
    engine = trainer.zero_offload_engine
    assert engine is not None and engine.compute_dtype == torch.bfloat16
    trainer.save_model(str(tmp_path / "saved"))
    saved = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    master = engine.full_state_dict()["model"]
    for name, p in saved.state_dict().items():
        assert torch.equal(p, master[name]), name
    # after train() the model holds the fp32 master weights, as a plain Trainer's would
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_flag_off_is_plain_trainer(tmp_path):
    trainer = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(),
                                 args=_args(tmp_path / "run", ZeroOffloadTrainingArguments,
                                            zero_offload=False, max_steps=1))
    trainer.train()
    assert trainer.zero_offload_engine is None
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"


def test_resume_from_checkpoint_equals_straight_run(tmp_path):
    def make(out):
        reset_accelerate()
        return ZeroOffloadTrainer(
            model=_model(), train_dataset=_Data(),
            args=_args(out, ZeroOffloadTrainingArguments, zero_offload=True, save_strategy="steps",
                       save_steps=3),
        )

    straight = make(tmp_path / "a")
    straight.train()
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert (ckpt / "zero_offload").is_dir() and (ckpt / "scheduler.pt").is_file()
    assert not (ckpt / "optimizer.pt").exists()
    resumed = make(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert total_rel_err(_master(resumed), _master(straight)) == 0.0
    assert _history(resumed)[0] == _history(straight)[0]  # the first 3 come from the checkpoint


def test_bad_options_raise(tmp_path):
    with pytest.raises(ValueError, match="max_grad_norm"):
        ZeroOffloadTrainer(
            model=_model(), train_dataset=_Data(),
            args=_args(tmp_path, ZeroOffloadTrainingArguments, zero_offload=True,
                       zero_offload_config='{"max_grad_norm": 1.0}'),
        ).train()
    reset_accelerate()
    with pytest.raises(TypeError, match="AdamW"):
        ZeroOffloadTrainer(
            model=_model(), train_dataset=_Data(),
            args=_args(tmp_path, ZeroOffloadTrainingArguments, zero_offload=True, optim="rmsprop"),
        ).train()
    reset_accelerate()
    with pytest.raises(TypeError, match="unknown option"):
        ZeroOffloadTrainer(
            model=_model(), train_dataset=_Data(),
            args=_args(tmp_path, ZeroOffloadTrainingArguments, zero_offload=True,
                       zero_offload_config={"bucket_mb": 1}),
        )



def _partial_offload_options(tmp_path, config) -> tuple:
    """The engine's (offload_fraction, device_memory_headroom) for ``zero_offload_config``."""
    trainer = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(), args=_args(
        tmp_path, ZeroOffloadTrainingArguments, zero_offload=True, zero_offload_config=config))
    trainer.create_optimizer()
    engine = trainer.zero_offload_engine
    assert engine is not None
    options = (engine.config.offload_fraction, engine.config.device_memory_headroom)
    engine.teardown()
    reset_accelerate()
    return options


def test_partial_offload_options_reach_the_engine(tmp_path):
    from transformers import HfArgumentParser

    assert _partial_offload_options(tmp_path, None) == ("auto", 0.2)
    config = {"offload_fraction": 0.5, "device_memory_headroom": 0.3}
    assert _partial_offload_options(tmp_path, config) == (0.5, 0.3)
    assert _partial_offload_options(tmp_path, '{"offload_fraction": "auto"}') == ("auto", 0.2)
    path = tmp_path / "zo.yaml"
    path.write_text("offload_fraction: 0.25\ndevice_memory_headroom: 0\n")
    assert _partial_offload_options(tmp_path, str(path)) == (0.25, 0.0)
    (args,) = HfArgumentParser(ZeroOffloadTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--zero_offload", "--zero_offload_config",
         '{"offload_fraction": 0.75, "device_memory_headroom": 0.1}'])
    assert args.zero_offload_config == {"offload_fraction": 0.75, "device_memory_headroom": 0.1}


@pytest.mark.parametrize("config, match", [
    ({"offload_fraction": 2}, r'offload_fraction must be a number in \[0, 1\] or "auto"'),
    ('{"offload_fraction": "most"}', r'offload_fraction must be .* or "auto", got \'most\''),
    ({"device_memory_headroom": 1}, r"device_memory_headroom must be a number in \[0, 1\)")])
def test_bad_partial_offload_options_raise_when_the_trainer_is_built(tmp_path, config, match):
    with pytest.raises(ValueError, match=match + r".*TrainingArguments.zero_offload_config"):
        ZeroOffloadTrainer(model=_model(), train_dataset=_Data(), args=_args(
            tmp_path, ZeroOffloadTrainingArguments, zero_offload=True, zero_offload_config=config))

def test_precision_is_the_trainers_and_an_explicit_other_one_raises(tmp_path):
    ours = ZeroOffloadTrainer(
        model=_model(), train_dataset=_Data(),
        args=_args(tmp_path, ZeroOffloadTrainingArguments, zero_offload=True, bf16=True,
                   max_steps=1, zero_offload_config={"precision": "bf16-mixed"}),
    )
    ours.train()
    assert ours.zero_offload_engine is not None
    assert ours.zero_offload_engine.config.precision == "bf16-mixed"
    reset_accelerate()
    match = (r"precision='bf16-mixed'\) does not match TrainingArguments\(bf16=False, "
             r"fp16=False\), which means precision '32-true'")
    with pytest.raises(ValueError, match=match):
        ZeroOffloadTrainer(
            model=_model(), train_dataset=_Data(),
            args=_args(tmp_path, ZeroOffloadTrainingArguments, zero_offload=True,
                       zero_offload_config={"precision": "bf16-mixed"}),
        ).train()


def test_adamw_subclass_matches_plain_trainer(tmp_path):
    def run(cls, out, **kw):
        reset_accelerate()
        model = _model()
        opt = SubAdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
        trainer = cls(model=model, train_dataset=_Data(), optimizers=(opt, None),
                      args=_args(out, ZeroOffloadTrainingArguments, **kw))
        trainer.train()
        return trainer

    plain = run(Trainer, tmp_path / "plain")
    ours = run(ZeroOffloadTrainer, tmp_path / "zo", zero_offload=True)
    assert type(ours.zero_offload_engine.optimizer).__name__ == "SubAdamW"
    assert _history(ours)[0] == pytest.approx(_history(plain)[0], rel=1e-5)
    assert total_rel_err(_master(ours), _master(plain)) < 1e-5


def test_optim_lion_32bit_trains_with_lion_pytorch(tmp_path):
    """optim="lion_32bit" (bitsandbytes' Lion in a plain Trainer) trains under ZeRO-Offload
    with lion_pytorch.Lion, as a plain Trainer given lion_pytorch.Lion with the same arguments."""
    lion = pytest.importorskip("lion_pytorch").Lion
    args = _args(tmp_path / "plain", optim="lion_32bit", learning_rate=2e-3)
    plain = Trainer(model=_model(), args=args, train_dataset=_Data(),
                    optimizer_cls_and_kwargs=(lion, {"lr": 2e-3, "betas": (0.9, 0.999)}))
    plain.train()
    reset_accelerate()
    ours = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(), args=_args(
        tmp_path / "zo", ZeroOffloadTrainingArguments, zero_offload=True, optim="lion_32bit",
        learning_rate=2e-3))
    ours.train()
    assert type(ours.zero_offload_engine.optimizer).__name__ == "Lion"
    assert _history(ours)[0] == pytest.approx(_history(plain)[0], rel=1e-5)
    assert total_rel_err(_master(ours), _master(plain)) < 1e-5


def _compare_trainers(rank: int, world: int, out: str) -> tuple:
    os.environ["ACCELERATE_USE_CPU"] = "true"
    plain = Trainer(model=_model(), args=_args(f"{out}/plain"), train_dataset=_Data())
    plain.train()
    assert plain.accelerator.num_processes == world and plain.args.world_size == world
    reset_accelerate()
    ours = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(),
                              args=_args(f"{out}/zo", ZeroOffloadTrainingArguments,
                                         zero_offload=True))
    ours.train()
    assert ours.zero_offload_engine.world_size == world
    return _history(plain), _history(ours), total_rel_err(_master(ours), _master(plain))


@pytest.mark.slow
def test_trainer_matches_plain_trainer_two_processes(tmp_path):
    from _dist import run_ranks

    for plain, ours, err in run_ranks(_compare_trainers, 2, str(tmp_path)):
        assert ours[0] == pytest.approx(plain[0], rel=1e-5)
        assert ours[1] == pytest.approx(plain[1], rel=1e-5)
        assert err < 1e-5


def test_after_train_the_model_holds_the_fp32_master_weights(tmp_path):
    """bf16: after train() the live model (save_pretrained, merge_and_unload) holds the fp32
    master weights, as a plain Trainer's would, and save_model records float32."""
    model = _model()
    trainer = ZeroOffloadTrainer(model=model, train_dataset=_Data(),
                                 args=_args(tmp_path / "o", ZeroOffloadTrainingArguments,
                                            zero_offload=True, bf16=True))
    trainer.train()
    engine = trainer.zero_offload_engine
    assert engine is not None and engine.torn_down
    master = engine.full_state_dict(optimizer=False)["model"]
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach().cpu(), master[name]), name
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in master.values())
    trainer.save_model(str(tmp_path / "saved"))
    import json

    assert json.loads((tmp_path / "saved" / "config.json").read_text())["dtype"] == "float32"
    model.save_pretrained(tmp_path / "pretrained")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "pretrained")
    for name, p in again.named_parameters():
        assert torch.equal(p, master[name]), name
    with pytest.raises(RuntimeError, match="train\\(\\) already ran"):
        trainer.train()


def test_training_logs_carry_the_offload_profile(tmp_path):
    trainer = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(),
                                 args=_args(tmp_path / "o", ZeroOffloadTrainingArguments,
                                            zero_offload=True))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(h["zero_offload/cpu_step_ms"] > 0 and h["zero_offload/fwd_bwd_ms"] > 0
                        for h in logs[1:])
    assert {f"zero_offload/{k}_ms" for k in ("grad_wait", "weight_copy", "stall")} <= set(logs[-1])


def test_train_inside_the_users_except_block_is_not_a_failure(tmp_path, monkeypatch):
    """The common fallback ``except ValueError: trainer.train()`` (no checkpoint to resume
    from): the run that went well is not reported as failed (on several ranks that would skip
    gathering the fp32 weights back and free the state save_model needs)."""
    from lightning_zero_offload.core.dist import collectives

    reported: list[BaseException] = []
    monkeypatch.setattr(collectives, "report_failure", reported.append)
    trainer = ZeroOffloadTrainer(model=_model(), train_dataset=_Data(),
                                 args=_args(tmp_path / "o", ZeroOffloadTrainingArguments,
                                            zero_offload=True, max_steps=2))
    try:
        trainer.train(resume_from_checkpoint=True)
    except ValueError as e:
        assert "checkpoint" in str(e)
        trainer.train()
    assert reported == []
