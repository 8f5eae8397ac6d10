"""Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention, no
biases; tied or untied input/output embeddings."""

from megatron_lite.models.spec import ModelSpec
from megatron_lite.parallel.norms import RMSNorm

LLAMA = ModelSpec(norm=RMSNorm, bias=False, gated_mlp=True, rotary=True)
