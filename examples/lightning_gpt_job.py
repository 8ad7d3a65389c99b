"""The job ``lightning_gpt.py`` runs: the byte-level text, the Llama, the callbacks that measure
throughput and memory, and the fit. Imported only once the command line is parsed, so ``--help``
and a bad flag answer without importing torch, Lightning or transformers.
"""

from __future__ import annotations

import argparse
import resource
import sys
import sysconfig
import time
from pathlib import Path

import psutil
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_zero_offload import ZeroOffloadStrategy  # importing registers "zero_offload"
from lightning_zero_offload.profile_report import format_summary


class ByteText(Dataset):
    """Random windows of ``seq_len + 1`` bytes from the standard library's ``.py`` files."""

    def __init__(self, seq_len: int, num_samples: int, max_bytes: int = 4 << 20) -> None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(stdlib.glob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        self.data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
        if len(self.data) <= seq_len + 1:
            raise RuntimeError(f"found only {len(self.data)} bytes of text under {stdlib}")
        generator = torch.Generator().manual_seed(0)
        high = len(self.data) - seq_len - 1
        self.starts = torch.randint(0, high, (num_samples,), generator=generator)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.starts[i])
        return self.data[start : start + self.seq_len + 1]


def torchao_adamw8bit() -> type:
    """torchao's block-wise 8-bit AdamW (a peer; the engine itself takes torch.optim.AdamW)."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise SystemExit(f"--optimizer torchao-adamw8bit needs torchao ({e}): pip install "
                         "'lightning-zero-offload[torchao]' (or torchao>=0.11)") from None
    return AdamW8bit


class GPT(LightningModule):
    def __init__(self, dims: tuple[int, int, int], seq_len: int, lr: float,
                 optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        hidden, layers, heads = dims
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=hidden,
            intermediate_size=(hidden * 8 // 3 + 63) // 64 * 64,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=seq_len,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self.model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        cls = torchao_adamw8bit() if self.hparams.optimizer == "torchao-adamw8bit" else (
            torch.optim.AdamW)
        optimizer = cls(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class Throughput(Callback):
    """Tokens per second over the steps after ``warmup``, the peak host RSS and, with
    ``time_batches``, each batch's wall time (a device sync per batch: only when asked for).
    A run of ``warmup`` steps or fewer is measured over all its batches, from the first one's
    start (setup excluded, the first steps' one-time costs included): :meth:`measured` says
    which."""

    def __init__(self, tokens_per_batch: int, warmup: int = 3, time_batches: bool = False) -> None:
        self.tokens_per_batch, self.warmup = tokens_per_batch, warmup
        self.time_batches = time_batches
        self.batches, self.start = 0, None
        self.all_batches, self.first = 0, None  # every batch, from the first one's start
        self.peak_rss = 0
        self.process = psutil.Process()
        self.batch_seconds: list[float] = []
        self._last = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first is None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.first = time.perf_counter()
        if self.time_batches and self._last is None:  # the first batch: from its start
            self._last = self.first

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.time_batches:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            # end to end: the data loading of the next batch counts too, as in tokens/s
            self.batch_seconds.append(now - self._last)
            self._last = now
        self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
        self.all_batches += 1
        if trainer.global_step == self.warmup and self.start is None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()
        elif self.start is not None:
            self.batches += 1

    def measured(self) -> str:
        """What :meth:`tokens_per_second` covers, in words."""
        if self.batches:
            return f"{_count(self.batches, 'batch', 'batches')} after a {self.warmup}-step warm-up"
        return (f"{_count(self.all_batches, 'batch', 'batches')}, warm-up included: with more "
                f"than {_count(self.warmup, 'step')} it is left out")

    def tokens_per_second(self) -> float:
        """Over the batches after the warm-up, or all of them where none came after it."""
        start, batches = (self.start, self.batches) if self.batches else (
            self.first, self.all_batches)
        if start is None or batches == 0:
            raise RuntimeError("Throughput: no batch ran")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return batches * self.tokens_per_batch / (time.perf_counter() - start)


def _count(n: int, one: str, many: str | None = None) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


class LossLog(Callback):
    """Each optimizer step's training loss (for ``--loss-csv``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(float(outputs["loss"]))


class OffloadSummary(Callback):
    """Keeps the engine's step profile at the end of training (the strategy drops the engine
    at teardown)."""

    def __init__(self) -> None:
        self.records: list = []

    def on_train_end(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.synchronize()
            self.records = engine.profile


def run(args: argparse.Namespace, dims: tuple[int, int, int]) -> None:
    """Train as ``args`` (``lightning_gpt.py``'s, parsed) say, a Llama of ``dims`` (hidden,
    layers, heads); rank 0 prints the summary."""
    gpus = torch.cuda.device_count()
    if gpus and args.devices > gpus:
        sys.exit(f"lightning_gpt.py: error: argument --devices: {args.devices} GPUs asked for, "
                 f"{gpus} visible")
    if args.precision == "auto":  # most CPUs have no fast bf16
        args.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    seed_everything(0)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    batches = args.steps * args.accumulate * args.devices
    dataset = ByteText(args.seq_len, num_samples=batches * args.batch_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = GPT(dims, args.seq_len, args.lr, args.optimizer)
    params = sum(p.numel() for p in model.parameters())
    strategy = "auto" if args.no_zero_offload else ZeroOffloadStrategy(
        delayed_update=args.delayed_update, moment_dtype=args.moment_dtype,
        offload_fraction=args.offload_fraction, bucket_size_mb=args.bucket_size_mb)
    losses = LossLog()
    throughput = Throughput(tokens_per_batch=args.batch_size * args.seq_len * args.devices,
                            time_batches=bool(args.loss_csv))
    summary = OffloadSummary()
    trainer = Trainer(
        accelerator=accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        max_epochs=1,  # the dataset holds exactly the batches for max_steps
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[throughput, summary, losses],
        log_every_n_steps=1,
    )
    trainer.fit(model, loader)

    peak_host = max(throughput.peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if trainer.is_global_zero:
        optimizer = type(trainer.optimizers[0]).__name__
        engine = (f"{trainer.strategy.config.moment_dtype} moments, offload fraction "
                  f"{trainer.strategy.offload_fraction:.3f}" if not args.no_zero_offload
                  else f"no engine, {type(trainer.strategy).__name__}")
        print(
            f"\nmodel: Llama {args.size} ({params / 1e6:.1f}M parameters), {args.precision}, "
            f"{optimizer} ({engine}), {args.devices} x {accelerator}, "
            f"{_count(args.steps, 'step')}, "
            "final loss "
            f"{float(trainer.callback_metrics['loss']):.3f}"
        )
        print(f"throughput: {throughput.tokens_per_second():,.0f} tokens/s (all ranks, over "
              f"{throughput.measured()})")
        if torch.cuda.is_available():
            device_gib = torch.cuda.max_memory_allocated() / 2**30
            print(f"peak device memory: {device_gib:.2f} GiB (rank 0)")
        else:
            print("peak device memory: n/a (no CUDA device; the CPU is the compute device)")
        print(f"peak host memory: {peak_host / 2**30:.2f} GiB RSS (rank 0)")
        if summary.records:
            print(format_summary(summary.records))
        if args.loss_csv:
            # one wall time per optimizer step: the last batch of each accumulation window ends it
            k = args.accumulate
            seconds = [sum(throughput.batch_seconds[i : i + k])
                       for i in range(0, len(throughput.batch_seconds), k)]
            rows = zip(losses.losses, seconds, strict=True)
            Path(args.loss_csv).write_text("step,loss,step_s\n" + "".join(
                f"{i + 1},{x:.6f},{t:.6f}\n" for i, (x, t) in enumerate(rows)))
    sys.stdout.flush()
