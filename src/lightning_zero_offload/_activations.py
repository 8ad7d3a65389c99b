"""The planner's activation estimate for a transformer (moved out of ``planner.py`` as is)."""

from __future__ import annotations


def activation_bytes(info: dict, batch: int | None, seq: int | None, elem: int) -> int:
    """Bytes of a decoder's activations for ``batch`` sequences of ``seq`` tokens, from its
    config (``info``: hidden size, layers, heads, vocabulary) and the compute dtype's element
    size ``elem``; 0 when something is unknown."""
    hidden, layers = info.get("hidden_size"), info.get("num_hidden_layers")
    heads, vocab = info.get("num_attention_heads"), info.get("vocab_size")
    if not (batch and seq and hidden and layers and heads):
        return 0
    per_layer = seq * batch * hidden * (34 + 5 * heads * seq / hidden)
    per_layer *= elem / 2  # the formula is for 16-bit activations
    logits = seq * batch * (vocab or 0) * (elem + 4)
    return int(layers * per_layer + logits)
