"""Fine-tune a causal language model on a text file with Accelerate, on the ZeRO-Offload engine.

    ZERO_OFFLOAD=1 .venv/bin/accelerate launch examples/accelerate_finetune.py \\
        --model Qwen/Qwen2.5-0.5B --data corpus.txt --max-steps 200 --mixed-precision bf16
    # no download: a tiny random Llama with a byte tokenizer, 2 processes on a CPU-only machine
    # (``accelerate launch --cpu`` starts one process there; torchrun starts several)
    ZERO_OFFLOAD=1 ACCELERATE_USE_CPU=1 .venv/bin/torchrun --nproc_per_node 2 \\
        examples/accelerate_finetune.py --tiny-random-llama --data README.md --max-steps 30

The loop is plain Accelerate (``accelerator.accumulate``/``backward``/``clip_grad_norm_``,
``optimizer.step``, ``scheduler.step``); the one line that differs from a stock script is
``ZeroOffloadPlugin().prepare(accelerator, ...)`` instead of ``accelerator.prepare(...)``, and it
*is* ``accelerator.prepare`` unless ``ZERO_OFFLOAD=1`` (options: ``ZERO_OFFLOAD_*`` variables).
Precision comes from ``--mixed-precision`` (or ``accelerate launch --mixed_precision``).

The recipe is one class, ``FinetuneRecipe``: ``setup()`` builds everything, ``train()`` runs
and returns the per-step losses (and prints the offload profile's summary); copy it and change
what you need. ``.venv`` is the environment ``python3 tasks.py`` makes.

Not supported here: DeepSpeed/FSDP/Megatron launch configs or ``--dynamo_backend`` together with
``ZERO_OFFLOAD=1`` (the plugin raises), fp8, optimizers other than AdamW, packing across documents
(the file is one stream of tokens), evaluation, PEFT/LoRA adapters, ``device_map``-loaded models.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lightning_zero_offload.accelerate import ZeroOffloadPlugin
from lightning_zero_offload.profile_report import format_summary


@dataclass
class RecipeConfig:
    data: str
    model: str | None = None  # hub name or local path of an AutoModelForCausalLM
    tiny_random_llama: bool = False  # build a tiny random Llama + byte tokenizer instead
    seq_len: int = 128
    batch_size: int = 4  # per process
    grad_accum: int = 2
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    max_steps: int = 100
    max_grad_norm: float = 1.0
    mixed_precision: str | None = None  # None: accelerate launch's setting
    seed: int = 0
    log_every: int = 10
    output_dir: str | None = None  # save the fine-tuned model (fp32 master weights) here


class ByteTokenizer:
    """UTF-8 bytes as tokens: lets the tiny random model train without downloading anything."""

    vocab_size = 256

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def save_pretrained(self, path: str) -> None:
        Path(path, "byte_tokenizer.txt").write_text("UTF-8 bytes, vocab 256\n")


class FinetuneRecipe:
    def __init__(self, cfg: RecipeConfig) -> None:
        if not (cfg.model or cfg.tiny_random_llama) or (cfg.model and cfg.tiny_random_llama):
            raise ValueError("pass exactly one of --model NAME_OR_PATH and --tiny-random-llama")
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        kwargs = {} if cfg.mixed_precision is None else {"mixed_precision": cfg.mixed_precision}
        self.accelerator = acc = Accelerator(gradient_accumulation_steps=cfg.grad_accum, **kwargs)
        set_seed(cfg.seed)
        if cfg.tiny_random_llama:
            self.tokenizer = ByteTokenizer()
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=cfg.seq_len,
            ))
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)

        text = Path(cfg.data).read_text(encoding="utf-8")
        ids = torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.long)
        blocks = ids[: len(ids) // cfg.seq_len * cfg.seq_len].view(-1, cfg.seq_len)
        if len(blocks) < cfg.batch_size * acc.num_processes:
            raise ValueError(f"{cfg.data} has {len(ids)} tokens: too few for one batch of "
                             f"{cfg.batch_size} x {cfg.seq_len} tokens per process")
        loader = torch.utils.data.DataLoader(blocks, batch_size=cfg.batch_size, shuffle=True,
                                             drop_last=True)

        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))

        # Accelerate steps a prepared scheduler once per process per optimizer step.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: schedule(s // acc.num_processes))
        self.plugin = ZeroOffloadPlugin()
        self.model, self.optimizer, self.loader, self.scheduler = self.plugin.prepare(
            acc, model, optimizer, loader, scheduler)
        acc.print(f"ZeRO-Offload: {'on' if self.plugin.engine else 'off'}, processes: "
                  f"{acc.num_processes}, mixed precision: {acc.mixed_precision}, "
                  f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
                  f"{len(blocks)} blocks of {cfg.seq_len} tokens")

    def train(self) -> list[float]:
        cfg, acc, model = self.cfg, self.accelerator, self.model
        losses: list[float] = []
        window, micro = torch.zeros((), device=acc.device), 0
        model.train()
        while len(losses) < cfg.max_steps:
            for batch in self.loader:
                with acc.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    acc.backward(loss)
                    window += loss.detach().float()
                    micro += 1
                    if acc.sync_gradients:
                        norm = acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad()
                if not acc.sync_gradients:
                    continue
                losses.append(acc.reduce(window / micro, reduction="mean").item())
                window, micro = window.zero_(), 0
                step = len(losses)
                if step % cfg.log_every == 0 or step == 1:
                    acc.print(f"step {step:5d}  loss {losses[-1]:.4f}  grad norm "
                              f"{float(norm):.3f}  lr {self.scheduler.get_last_lr()[0]:.2e}")
                if step == cfg.max_steps:
                    break
        if self.plugin.engine is not None:  # where the step time went (this process)
            self.plugin.engine.synchronize()
            acc.print(format_summary(self.plugin.engine.profile))
        if cfg.output_dir:
            self.save(cfg.output_dir)
        return losses

    def save(self, path: str) -> None:
        acc = self.accelerator
        state = acc.get_state_dict(self.model)  # fp32 master weights; every process calls it
        acc.unwrap_model(self.model).save_pretrained(
            path, state_dict=state, is_main_process=acc.is_main_process, save_function=acc.save)
        if acc.is_main_process:
            self.tokenizer.save_pretrained(path)
        acc.wait_for_everyone()


def parse_args(argv: list[str] | None = None) -> RecipeConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="UTF-8 text file to fine-tune on")
    p.add_argument("--model", help="AutoModelForCausalLM name or local path")
    p.add_argument("--tiny-random-llama", action="store_true",
                   help="tiny random Llama and a byte tokenizer (no download)")
    for name, default in vars(RecipeConfig(data="")).items():
        if name in ("data", "model", "tiny_random_llama"):
            continue
        kind = str if name in ("mixed_precision", "output_dir") else type(default)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    return RecipeConfig(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    recipe = FinetuneRecipe(parse_args())
    recipe.setup()
    recipe.train()
    recipe.accelerator.end_training()  # destroys the process group
