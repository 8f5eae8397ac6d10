"""GPT-2-style decoder: LayerNorm, learned absolute positions, GeLU MLP, biases everywhere."""

from megatron_lite.models.spec import ModelSpec
from megatron_lite.parallel.norms import LayerNorm

GPT = ModelSpec(norm=LayerNorm, bias=True, gated_mlp=False, rotary=False)
