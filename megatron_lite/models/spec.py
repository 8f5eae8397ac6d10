"""What differs between the Llama-style and GPT-style decoders (see llama.py, gpt.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    norm: type  # RMSNorm | LayerNorm, built as norm(hidden_size, eps, sequence_parallel)
    bias: bool  # biases in linear layers
    gated_mlp: bool  # SwiGLU (gate, up) or a plain GeLU MLP
    rotary: bool  # rotary embeddings, else learned absolute positions
