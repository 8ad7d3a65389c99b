"""TRL + PEFT under ZeRO-Offload: the composed arguments class, and examples/trl_sft.py end to end
(the saved adapter loads with PEFT, reproduces the trained model's logits, and equals the adapter
a stock SFTTrainer run trains in fp32)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "trl_sft.py"


# A process group an earlier test left in this process (Lightning keeps one, by design) leaves
# its rendezvous in the environment; the recipe's own must not try to bind the same port.
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ZERO_OFFLOAD") and k not in _RENDEZVOUS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _recipe():
    spec = importlib.util.spec_from_file_location("trl_sft", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def test_sft_config_takes_zero_offload_options_and_bare_flag():
    from transformers import HfArgumentParser
    from trl import SFTConfig

    from lightning_zero_offload.transformers import ZeroOffloadSFTConfig, with_zero_offload

    assert with_zero_offload(SFTConfig) is ZeroOffloadSFTConfig
    assert issubclass(ZeroOffloadSFTConfig, SFTConfig)
    common = ["--output_dir", "/tmp/unused", "--bf16", "false", "--use_cpu", "--max_length", "64"]
    parser = HfArgumentParser(ZeroOffloadSFTConfig)
    (bare,) = parser.parse_args_into_dataclasses([*common, "--zero_offload"])
    (off,) = parser.parse_args_into_dataclasses([*common, "--zero_offload", "false"])
    (unset,) = parser.parse_args_into_dataclasses(common)
    assert (bare.zero_offload, off.zero_offload, unset.zero_offload) == (True, False, None)
    assert bare.max_length == 64 and bare.place_model_on_device is False
    args = ZeroOffloadSFTConfig(output_dir="/tmp/unused", bf16=False, use_cpu=True,
                                zero_offload=True, zero_offload_config='{"bucket_size_mb": 4}')
    assert args.zero_offload_config == {"bucket_size_mb": 4}
    assert type(pickle.loads(pickle.dumps(args))) is ZeroOffloadSFTConfig  # training_args.bin
    with pytest.raises(ValueError, match="zero_offload_config is not valid JSON"):
        ZeroOffloadSFTConfig(output_dir="/tmp/unused", bf16=False, use_cpu=True,
                             zero_offload_config="{bad")
    with pytest.raises(TypeError, match="TrainingArguments subclass"):
        with_zero_offload(dict)


def test_trl_recipe_adapter_reproduces_trained_logits(tmp_path, monkeypatch):
    from _accelerate_state import reset_accelerate
    from peft import AutoPeftModelForCausalLM

    for var in [v for v in os.environ if v.startswith("ZERO_OFFLOAD")]:
        monkeypatch.delenv(var)
    reset_accelerate()
    mod = _recipe()
    recipe = mod.SFTRecipe(mod.parse_args(["--tiny-random-llama", "--max-steps", "5",
                                           "--log-every", "1", "--output-dir", str(tmp_path)]))
    recipe.setup()
    losses = recipe.train()
    engine = recipe.trainer.optimizer.engine
    assert engine is not None and len(losses) == 5
    probe = recipe.tokenizer(["def train(model):", "ZeRO-Offload keeps Adam on the host"],
                             return_tensors="pt", padding=True)
    model = recipe.trainer.model
    model.eval()
    with torch.no_grad():
        trained = model(**probe).logits.float()
    reset_accelerate()

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        again = loaded(**probe).logits
        base = loaded.get_base_model()
        with loaded.disable_adapter():
            untrained = loaded(**probe).logits
    assert base.config._name_or_path == str((tmp_path / "base").resolve())
    assert (trained - untrained).abs().max() > 1e-3  # the adapter changed the model
    torch.testing.assert_close(again, trained, rtol=0, atol=1e-5)


def test_trl_recipe_cli_matches_stock_sft_trainer(tmp_path):
    """The CI command; its adapter equals a stock SFTTrainer's (fp32, same seed and data)."""
    from safetensors.torch import load_file

    dirs = {}
    for name, extra in (("offload", []), ("stock", ["--no-zero-offload"])):
        out = tmp_path / name
        cmd = [sys.executable, str(RECIPE), "--tiny-random-llama", "--max-steps", "5",
               "--output-dir", str(out), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ("ZeRO-Offload profile" in proc.stdout) == (name == "offload"), proc.stdout
        dirs[name] = load_file(out / "adapter_model.safetensors")
    assert dirs["offload"].keys() == dirs["stock"].keys() and dirs["offload"]
    trained = dirs["offload"]
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in trained.items())
    for key, ref in dirs["stock"].items():
        torch.testing.assert_close(dirs["offload"][key], ref, rtol=0, atol=1e-5, msg=key)
