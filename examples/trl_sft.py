"""Supervised fine-tuning of a causal LM with TRL's ``SFTTrainer`` and a LoRA adapter (PEFT), on
the ZeRO-Offload engine; saves an adapter that ``peft`` loads.

    pip install 'lightning-zero-offload[hf]'      # trl, peft (and transformers, accelerate)
    .venv/bin/python examples/trl_sft.py --model Qwen/Qwen2.5-0.5B --data corpus.txt \\
        --max-steps 200 --bf16 --output-dir out/sft
    # no download: a tiny random Llama with a byte-level tokenizer, on the CPU
    .venv/bin/python examples/trl_sft.py --tiny-random-llama --max-steps 5 --output-dir out/sft

The trainer is TRL's own, with ``ZeroOffloadMixin`` first in its bases, and the arguments are
``ZeroOffloadSFTConfig`` (``SFTConfig`` plus ``zero_offload``/``zero_offload_config``, from
``lightning_zero_offload.transformers``), so every ``SFTConfig`` option still applies. Only the LoRA
weights train: the engine keeps their fp32 master weights and AdamW moments on the host and
steps them with the fused CPU AdamW; the frozen base weights stay on the device in the compute
dtype (their exact values on the host). ``--output-dir`` receives the adapter
(``adapter_config.json``, ``adapter_model.safetensors``) and the tokenizer; with
``--tiny-random-llama`` also the random base model under ``base/``, which the adapter config
names, so ``AutoPeftModelForCausalLM.from_pretrained(output_dir)`` loads it offline.

The recipe is one class, ``SFTRecipe``: ``setup()`` builds everything, ``train()`` runs and
returns the per-step losses; copy it and change what you need. The data is a UTF-8 text file
(``--data``; default: the docstrings of a few standard-library modules), one example per
paragraph, plain language modelling (no chat template).

Not supported here (each either raises or is left out of the recipe): several GPUs in one
process (``DataParallel``) or DeepSpeed/FSDP with ``zero_offload`` (the mixin raises); optimizers
other than AdamW/Adam (``optim`` must be an ``adamw_torch*``); quantized base models (QLoRA,
``quantization_config``: the engine needs the trainable weights in a float dtype it owns);
``max_grad_norm`` inside ``zero_offload_config`` (use ``--max-grad-norm``); gradient checkpointing
(off here; ``SFTConfig`` turns it on by default); packing and chat templates / completion-only
loss (left out of the recipe, not of the engine); fp16 on the CPU; merging the adapter into
bf16 base weights (``merge_and_unload`` then rounds to bf16; load the base in fp32 first).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


@dataclass
class RecipeConfig:
    output_dir: str
    model: str | None = None  # hub name or local path of an AutoModelForCausalLM
    tiny_random_llama: bool = False  # build a tiny random Llama + byte tokenizer instead
    data: str | None = None  # UTF-8 text, one example per paragraph; default: stdlib docstrings
    max_length: int = 128
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-3
    max_steps: int = 50
    max_grad_norm: float = 1.0
    lora_r: int = 8
    lora_alpha: int = 16
    bf16: bool = False
    zero_offload: bool = True
    seed: int = 0
    log_every: int = 10


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens + 2 specials), built locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def default_corpus() -> str:
    """Paragraphs of a few standard-library docstrings: deterministic and offline."""
    import collections
    import fractions
    import pathlib
    import statistics
    import textwrap

    docs = [inspect.getdoc(m) or "" for m in (collections, fractions, json, pathlib,
                                               statistics, textwrap, argparse)]
    return "\n\n".join(docs)


class SFTRecipe:
    def __init__(self, cfg: RecipeConfig) -> None:
        if not (cfg.model or cfg.tiny_random_llama) or (cfg.model and cfg.tiny_random_llama):
            raise ValueError("pass exactly one of --model NAME_OR_PATH and --tiny-random-llama")
        self.cfg = cfg

    def setup(self) -> None:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            LlamaConfig,
            LlamaForCausalLM,
            set_seed,
        )
        from trl import SFTTrainer

        from lightning_zero_offload.transformers import ZeroOffloadMixin, ZeroOffloadSFTConfig

        class OffloadSFTTrainer(ZeroOffloadMixin, SFTTrainer):
            """TRL's SFTTrainer on the ZeRO-Offload engine."""

        cfg = self.cfg
        set_seed(cfg.seed)
        out = Path(cfg.output_dir)
        if cfg.tiny_random_llama:
            self.tokenizer = byte_tokenizer()
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=len(self.tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=cfg.max_length, pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id, bos_token_id=None,
            ))
            # The base is random: save it, so the adapter can be applied to it again.
            model.save_pretrained(out / "base")
            model.name_or_path = model.config._name_or_path = str((out / "base").resolve())
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

        text = Path(cfg.data).read_text(encoding="utf-8") if cfg.data else default_corpus()
        rows = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) >= 4]
        if len(rows) < cfg.batch_size:
            raise ValueError(f"{cfg.data or 'the default corpus'} has {len(rows)} paragraphs: "
                             f"too few for one batch of {cfg.batch_size}")
        dataset = Dataset.from_dict({"text": rows})

        args = ZeroOffloadSFTConfig(
            output_dir=str(out / "run"), zero_offload=cfg.zero_offload, bf16=cfg.bf16,
            use_cpu=not torch.cuda.is_available(), max_steps=cfg.max_steps,
            per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=cfg.grad_accum,
            learning_rate=cfg.lr, lr_scheduler_type="constant", max_grad_norm=cfg.max_grad_norm,
            optim="adamw_torch", max_length=cfg.max_length, gradient_checkpointing=False,
            logging_steps=min(cfg.log_every, cfg.max_steps), save_strategy="no", report_to=[],
            seed=cfg.seed, disable_tqdm=True, dataloader_num_workers=0,
        )
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                          target_modules="all-linear", task_type="CAUSAL_LM")
        self.trainer = OffloadSFTTrainer(model=model, args=args, train_dataset=dataset,
                                         processing_class=self.tokenizer, peft_config=lora)
        n_train = sum(p.numel() for p in self.trainer.model.parameters() if p.requires_grad)
        n_all = sum(p.numel() for p in self.trainer.model.parameters())
        print(f"ZeRO-Offload: {'on' if cfg.zero_offload else 'off'}; {len(rows)} examples; "
              f"LoRA r={cfg.lora_r}: {n_train / 1e6:.3f}M of {n_all / 1e6:.2f}M parameters train")

    def train(self) -> list[float]:
        from lightning_zero_offload.profile_report import format_summary

        result = self.trainer.train()
        losses = [h["loss"] for h in self.trainer.state.log_history if "loss" in h]
        print(f"trained {result.global_step} steps, final loss {losses[-1] if losses else 'n/a'}")
        engine = getattr(self.trainer.optimizer, "engine", None)  # None without ZeRO-Offload
        if engine is not None:
            print(format_summary(engine.profile))
        self.save(self.cfg.output_dir)
        return losses

    def save(self, path: str) -> None:
        """The adapter (its fp32 master weights, through the engine) and the tokenizer."""
        self.trainer.save_model(path)
        self.tokenizer.save_pretrained(path)


def parse_args(argv: list[str] | None = None) -> RecipeConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True, help="where the adapter is saved")
    p.add_argument("--model", help="AutoModelForCausalLM name or local path")
    p.add_argument("--tiny-random-llama", action="store_true",
                   help="tiny random Llama and a byte tokenizer (no download)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute on the device")
    p.add_argument("--no-zero-offload", dest="zero_offload", action="store_false",
                   help="train with the stock SFTTrainer instead")
    skip = {"output_dir", "model", "tiny_random_llama", "bf16", "zero_offload"}
    for name, default in vars(RecipeConfig(output_dir="")).items():
        if name not in skip:
            kind = str if name == "data" else type(default)
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    args = p.parse_args(argv)
    for name in ("max_steps", "batch_size", "max_length", "lora_r", "grad_accum", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return RecipeConfig(**vars(args))


if __name__ == "__main__":
    recipe = SFTRecipe(parse_args())
    recipe.setup()
    recipe.train()
