"""What the planner reads of a model: its parameter count and shape from a local HF folder or
``config.json`` (never downloading), and the activation estimate that shape gives."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any


def _safetensors_params(folder: Path) -> int | None:
    """Parameter count from the headers of the *.safetensors files (reads no weights)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def model_info(path: str | os.PathLike) -> dict[str, Any]:
    """Parameter count and shape of a local HF model: a folder (config.json, weights) or a
    config.json. Counted from safetensors headers when there are weights, else by building the
    model on the meta device from its config (needs transformers; allocates nothing)."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(f"lzo-plan: no config.json at {path} (give a local model folder "
                                "or its config.json; the planner never downloads)")
    cfg = json.loads(cfg_file.read_text())
    text = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    info = {k: text.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "vocab_size")}
    params = _safetensors_params(cfg_file.parent)
    if params is None:
        try:
            import torch
            from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError(f"lzo-plan: {cfg_file.parent} has no *.safetensors to count; "
                              "counting from config.json alone needs transformers "
                              "(pip install 'lightning-zero-offload[transformers]') or use "
                              "--params") from e
        config = AutoConfig.from_pretrained(str(cfg_file.parent))
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = AutoModel.from_config(config)
        params = sum(p.numel() for p in model.parameters())
    info["params"] = params
    return info


def activation_bytes(info: dict, batch: int | None, seq: int | None, precision: str,
                     checkpointing: bool = False) -> int:
    """Device bytes of activations for a decoder-only transformer of shape ``info`` (the
    formulas are in ``planner``'s docstring); 0 without a batch, a sequence and a shape."""
    hidden, layers = info.get("hidden_size"), info.get("num_hidden_layers")
    heads, vocab = info.get("num_attention_heads"), info.get("vocab_size")
    if not (batch and seq and hidden and layers and heads):
        return 0
    h = 4 if precision == "32-true" else 2
    per_layer = seq * batch * hidden * (34 + 5 * heads * seq / hidden) * h / 2  # 16-bit formula
    logits = seq * batch * (vocab or 0) * (h + 4)
    if checkpointing:  # every layer's input, and one layer recomputed in full at a time
        return int(layers * seq * batch * hidden * h + per_layer + logits)
    return int(layers * per_layer + logits)
