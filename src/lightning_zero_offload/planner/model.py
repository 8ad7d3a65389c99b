"""What the planner reads of a model: its parameter count and shape from a local HF folder or
``config.json`` (never downloading), and the activation estimate that shape gives. A file that
cannot be read is refused with its name and what was expected."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from lightning_zero_offload.planner.inputs import PlanArgumentError

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_MAX_HEADER = 100 * 2**20  # safetensors caps its JSON header at 100 MB
ATTENTION = ("eager", "memory-efficient")


def _bad(path: Path, problem: str) -> PlanArgumentError:
    return PlanArgumentError("model", f"{path} {problem}")


def _header_params(f: Path) -> int:
    """Elements of every tensor a safetensors file's header lists (reads no weights)."""
    expected = ("; expected a safetensors file (an 8-byte length, then a JSON header of "
                "{name: {dtype, shape, data_offsets}})")
    with open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise _bad(f, "is too short for a safetensors header" + expected)
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise _bad(f, f"has a damaged header (length {n} bytes)" + expected)
        text = fh.read(n)
    try:
        header = json.loads(text)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _bad(f, f"has a damaged header ({e})" + expected) from None
    if not isinstance(header, dict):
        raise _bad(f, f"has a damaged header (a JSON {type(header).__name__})" + expected)
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise _bad(f, f"has a damaged header (tensor {name!r} has no shape)" + expected)
        total += math.prod(shape)
    return total


def _safetensors_params(folder: Path) -> int | None:
    """Parameter count from the headers of the *.safetensors files; None without any."""
    files = sorted(folder.glob("*.safetensors"))
    return sum(_header_params(f) for f in files) if files else None


def _read_config(cfg_file: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(cfg_file, f"is not JSON ({e}); give a model's config.json") from None
    if not isinstance(cfg, dict):
        raise _bad(cfg_file, f"holds a JSON {type(cfg).__name__}, not an object; give a "
                   "model's config.json")
    text = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    if not isinstance(text, dict):
        raise _bad(cfg_file, "has a text_config that is not an object")
    for key in SHAPE_KEYS:
        v = text.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise _bad(cfg_file, f"has {key}={v!r}; expected an int >= 1")
    return text


def model_info(path: str | os.PathLike) -> dict[str, Any]:
    """Parameter count and shape of a local HF model: a folder (config.json, weights) or a
    config.json. Counted from safetensors headers when there are weights, else by building the
    model on the meta device from its config (needs transformers; allocates nothing)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"plan: model: got {type(path).__name__} {path!r}; give a local model "
                        "folder or its config.json")
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json at {path} (give a local model folder or its "
                                "config.json; the planner never downloads)")
    text = _read_config(cfg_file)
    info: dict[str, Any] = {k: text.get(k) for k in SHAPE_KEYS}
    params = _safetensors_params(cfg_file.parent)
    if params is None:
        params = _meta_params(cfg_file)
    info["params"] = params
    return info


def _meta_params(cfg_file: Path) -> int:
    """Parameters of the model ``cfg_file`` describes, built on the meta device."""
    try:
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(f"{cfg_file.parent} has no *.safetensors to count; counting from "
                          "config.json alone needs transformers (pip install "
                          "'lightning-zero-offload[transformers]') or use --params") from e
    try:
        config = AutoConfig.from_pretrained(str(cfg_file.parent))
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = AutoModel.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise _bad(cfg_file, f"does not describe a model transformers can build ({e}); give "
                   "a folder with *.safetensors weights or use --params") from None
    return sum(p.numel() for p in model.parameters())


def activation_bytes(info: dict, batch: int | None, seq: int | None, precision: str,
                     checkpointing: bool = False, attention: str = "eager") -> int:
    """Device bytes of activations for a decoder-only transformer of shape ``info`` (the
    formulas are in ``planner``'s docstring); 0 without a batch, a sequence and a shape.
    ``attention="eager"`` keeps the ``a s^2`` attention scores, softmax and dropout per layer
    (the ``5 a s / H`` term); ``"memory-efficient"`` (SDPA/flash kernels) keeps none."""
    hidden, layers = info.get("hidden_size"), info.get("num_hidden_layers")
    heads, vocab = info.get("num_attention_heads"), info.get("vocab_size")
    if not (batch and seq and hidden and layers and heads):
        return 0
    h = 4 if precision == "32-true" else 2
    scores = 5 * heads * seq / hidden if attention == "eager" else 0
    per_layer = seq * batch * hidden * (34 + scores) * h / 2  # the 16-bit formula, scaled
    logits = seq * batch * (vocab or 0) * (h + 4)
    if checkpointing:  # every layer's input, and one layer recomputed in full at a time
        return int(layers * seq * batch * hidden * h + per_layer + logits)
    return int(layers * per_layer + logits)
