"""A small GPT-style model from plain torch modules, shared by the benchmarks (and examples).

Pre-norm blocks, causal attention through ``F.scaled_dot_product_attention`` (flash kernels on a
GPU), a 4x GELU MLP, learned positions, an LM head tied to the token embedding by default. Sizes
follow GPT-3's table by name (``"350m"``, ``"1.3b"``, ...) or any ``(layers, hidden)`` pair.
``build_gpt`` can construct on the meta device and fill the weights from a fast generator device,
so multi-billion models are made in seconds and never exist twice in host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 64

# name -> (layers, hidden, heads)
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 64, 4),
    "small": (4, 256, 4),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 16),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 20),
    "4b": (36, 3072, 24),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
}


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int = VOCAB
    seq_len: int = 1024
    tied: bool = True
    checkpoint: bool = False  # recompute each block in backward (activation checkpointing)

    @property
    def n_params(self) -> int:
        """All parameters (the tied head counted once)."""
        d, v = self.d_model, self.vocab_size
        block = 12 * d * d + 13 * d  # qkv, proj, fc, fc2 (+ biases) and two LayerNorms
        head = 0 if self.tied else v * d
        return self.n_layer * block + v * d + self.seq_len * d + 2 * d + head

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6*N_matmul + 12*L*d*T (attention scores and values, fwd+bwd).

        N_matmul = block parameters + the LM head (vocab x d); the embedding lookups do no matmul.
        The attention term counts the full T x T product (as PaLM's appendix does), not half of it
        for causality; recomputation under checkpointing is not counted (model FLOPs, not hardware).
        """
        d = self.d_model
        n_matmul = self.n_layer * (12 * d * d + 13 * d) + self.vocab_size * d
        return 6.0 * n_matmul + 12.0 * self.n_layer * d * self.seq_len


def gpt_config(size: str | tuple[int, int], **kw: object) -> GPTConfig:
    """``size`` is a name from ``SIZES`` or ``(layers, hidden)`` (heads of 64 or 128 dims)."""
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(SIZES)} or (L, d)")
        n_layer, d, n_head = SIZES[size]
    else:
        n_layer, d = size
        head_dim = 128 if d >= 2048 else 64
        if d % head_dim:
            raise ValueError(f"hidden size {d} must be a multiple of {head_dim}")
        n_head = d // head_dim
    return replace(GPTConfig(n_layer, d, n_head), **kw)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy (computed in fp32) when ``targets`` is given."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.cfg.checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def init_weights_(model: GPT, *, std: float = 0.02, gen_device: str | torch.device = "cpu",
                  seed: int = 0) -> GPT:
    """GPT-2 initialisation, each tensor drawn on ``gen_device`` (a GPU is ~100x faster for
    billions of values) and copied into place; residual projections scaled by 1/sqrt(2L)."""
    g = torch.Generator(device=gen_device).manual_seed(seed)
    resid = std / math.sqrt(2 * model.cfg.n_layer)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in name or name.startswith("ln_"):
            p.fill_(1.0)
        else:
            s = resid if name.endswith(("proj.weight", "fc2.weight")) else std
            p.copy_(torch.randn(p.shape, generator=g, device=gen_device, dtype=p.dtype).mul_(s))
    return model


def build_gpt(size: str | tuple[int, int] | GPTConfig, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, gen_device: str | torch.device | None = None,
              seed: int = 0, **kw: object) -> GPT:
    """A GPT with initialised weights on ``device`` in ``dtype``; built on the meta device first,
    so no memory is spent on a throwaway default initialisation."""
    cfg = size if isinstance(size, GPTConfig) else gpt_config(size, **kw)
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tied:  # to_empty breaks the tie; restore it
        model.head.weight = model.wte.weight
    return init_weights_(model, gen_device=gen_device or device, seed=seed)


def random_batch(cfg: GPTConfig, batch: int, *, device: str | torch.device = "cpu",
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets, shape (batch, seq_len)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
