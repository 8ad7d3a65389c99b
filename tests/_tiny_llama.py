"""A tiny Llama-style model (RMSNorm, attention, SwiGLU MLP) and its tensor-parallel plan, for the
tensor-parallel tests: column-wise ``wq/wk/wv/w1/w3``, row-wise ``wo/w2``. Attention reads its
local head count from the shapes, so one model serves every tensor-parallel size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim)  # its bias is Replicate() under RowwiseParallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)  # a Shard(0) bias under ColwiseParallel
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS,
                 layers: int = LAYERS, hidden: int = 0) -> None:
        """``hidden``: the MLP's width (default ``2 * dim``; an odd one shards unevenly)."""
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden or 2 * dim) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def make(seed: int = 0, **kw: int) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama(**kw)
    with torch.no_grad():  # the norms' weights away from 1, so their gradients matter
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
    return model


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()}


def parallelize(model: TinyLlama, tp_mesh: object, *, ends: bool = True) -> TinyLlama:
    """Every block by :func:`tp_plan`; ``ends``: the embedding row-wise and the output layer
    column-wise too (their outputs replicated), so only the norms stay whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for layer in model.layers:
        parallelize_module(layer, tp_mesh, tp_plan())  # type: ignore[arg-type]
    if ends:
        parallelize_module(model, tp_mesh, {  # type: ignore[arg-type]
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())})
    return model


def param_groups(model: nn.Module, lr: float = 1e-2) -> list[dict]:
    """Two groups: decay for matrices, none for norms and biases (with its own lr)."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                                     "lr": lr / 2}]


def batch(step: int, micro: int, part: int, size: int = 4,
          vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed data: micro-batch ``micro`` of step ``step``, data-parallel part ``part``."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + part)
    x = torch.randint(0, vocab, (size, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
