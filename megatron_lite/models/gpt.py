"""GPT-2-style decoder: LayerNorm, learned absolute positions, GeLU MLP, biases everywhere; MoE
layers where model.moe_layer_pattern marks them. The registry entry `gpt` (no HF family)."""

from megatron_lite.models.decoder import check_no_latent_attention, gelu_flops
from megatron_lite.models.registry import ArchitectureSpec, register_architecture


def gpt_ffn_hidden_size(hidden_size: int) -> int:
    return 4 * hidden_size


GPT = register_architecture(
    ArchitectureSpec(
        name="gpt",
        attention="megatron_lite.models.transformer:Attention",
        mlp="megatron_lite.models.transformer:build_dense_mlp",
        moe="megatron_lite.models.transformer:build_moe",
        norm="megatron_lite.parallel.norms:LayerNorm",
        ffn_hidden_size=gpt_ffn_hidden_size,
        flops=gelu_flops,
        validate=check_no_latent_attention,
        unused_keys=(
            (
                "rope_theta",
                "model.arch=gpt has learned positions (no rotary embedding)",
                "remove it (llama's rotary embeddings use it)",
            ),
            (
                "rope_scaling",
                "model.arch=gpt has learned positions (no rotary embedding)",
                "remove it (llama's rotary embeddings use it)",
            ),
            (
                "add_qkv_bias",
                "model.arch=gpt has biases in every linear layer already",
                "remove it (it adds q/k/v biases to llama, as Qwen2)",
            ),
        ),
        learned_positions=True,
        bias=True,
        gated_mlp=False,
    )
)
