"""Tensor parallelism x ZeRO-Offload with the Lightning Trainer: a Llama-style model whose
``configure_model`` applies a tensor-parallel plan to attention and MLP (column-wise q/k/v and
gate/up projections, row-wise output and down projections), exactly as under Lightning's
``ModelParallelStrategy``; ``ZeroOffloadStrategy(tensor_parallel_size=...)`` builds the 2-D mesh
and keeps each rank's 1/DP share of its local shards' fp32 master and Adam state on the host.

On the CPU (4 processes, 2 data-parallel x 2 tensor-parallel):
    python examples/lightning_tp.py --devices 4 --accelerator cpu
On 8 GPUs: ``--devices 8 --tensor-parallel-size 4 --precision bf16-mixed``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_zero_offload import ZeroOffloadStrategy


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over (batch, heads, seq, head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2, device=x.device).float() / d)
    ang = torch.outer(torch.arange(t, device=x.device).float(), freqs)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # -1 heads: under tensor parallelism each rank holds heads / tp
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(LightningModule):
    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.output = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def configure_model(self) -> None:
        """The tensor-parallel plan (as under ModelParallelStrategy); no mesh: plain model."""
        if self.device_mesh is None:
            return
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        tp = self.device_mesh["tensor_parallel"]
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
        for layer in self.layers:
            parallelize_module(layer, tp, plan)
        parallelize_module(self, tp, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                      "output": ColwiseParallel(output_layouts=Replicate())})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.dim() == 2]
        rest = [p for p in self.parameters() if p.dim() != 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0}], lr=self.lr)


class Bytes(Dataset):
    """``samples`` byte-level windows of this file's own text (no download), cycling through
    them: sized so that one epoch holds the run's steps."""

    def __init__(self, samples: int, seq: int = 64) -> None:
        data = torch.tensor(list(open(__file__, "rb").read()), dtype=torch.long)
        self.windows = data.unfold(0, seq + 1, seq // 2)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.windows[i % len(self.windows)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4,
                    help="processes (GPUs, or CPU processes with --accelerator cpu); "
                    "default: %(default)s")
    ap.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    ap.add_argument("--tensor-parallel-size", type=int, default=2,
                    help="ranks that split each layer; --devices / this many replicas train "
                    "data-parallel (default: %(default)s)")
    ap.add_argument("--precision", default="32-true",
                    help="Lightning precision, e.g. bf16-mixed (default: %(default)s)")
    ap.add_argument("--max-steps", type=int, default=20,
                    help="optimizer steps, all in one epoch (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="per data-parallel replica (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.devices < 1 or args.tensor_parallel_size < 1 or args.devices % (
            args.tensor_parallel_size):
        ap.error(f"argument --tensor-parallel-size: {args.tensor_parallel_size} must divide "
                 f"--devices ({args.devices})")
    if args.max_steps < 1 or args.batch_size < 1:
        ap.error("argument --max-steps/--batch-size: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # the same initial weights on every rank
    # the default "popen" launcher: "spawn" would pickle the DTensor weights back to the parent
    strategy = ZeroOffloadStrategy(tensor_parallel_size=args.tensor_parallel_size)
    # one epoch of exactly max_steps batches on every data-parallel replica: max_epochs=1 (with
    # max_steps alone Lightning's max_epochs is -1, and the progress bar reads "Epoch 0/-2")
    replicas = args.devices // args.tensor_parallel_size
    data = Bytes(samples=args.max_steps * args.batch_size * replicas)
    trainer = Trainer(strategy=strategy, devices=args.devices, accelerator=args.accelerator,
                      precision=args.precision, max_steps=args.max_steps, max_epochs=1,
                      gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                      log_every_n_steps=5)
    trainer.fit(Llama(), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
