"""Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention (or
multi-head latent attention with model.multi_latent_attention: models/mla.py), no biases (q/k/v
biases with model.add_qkv_bias, as Qwen2); tied or untied input/output embeddings; MoE layers
(Mixtral, Qwen2/3-MoE, DeepSeek-style routing) where model.moe_layer_pattern marks them. The
registry entry `llama`."""

from megatron_lite.models.decoder import check_llama, swiglu_flops
from megatron_lite.models.registry import ArchitectureSpec, register_architecture


def llama_ffn_hidden_size(hidden_size: int) -> int:
    """8h/3 rounded up to a multiple of 64 (SwiGLU's three matrices ≈ GeLU's two at 4h)."""
    return 64 * -(-int(8 * hidden_size / 3) // 64)


LLAMA = register_architecture(
    ArchitectureSpec(
        name="llama",
        attention="megatron_lite.models.mla:LLAMA_ATTENTION",  # MLA with the flag
        mlp="megatron_lite.models.transformer:build_dense_mlp",
        moe="megatron_lite.models.transformer:build_moe",
        norm="megatron_lite.parallel.norms:RMSNorm",
        ffn_hidden_size=llama_ffn_hidden_size,
        flops=swiglu_flops,
        validate=check_llama,
        unused_keys=(
            (
                "max_position_embeddings",
                "model.arch=llama has rotary positions (no learned position table)",
                "remove it (gpt's learned positions use it)",
            ),
        ),
        bias=False,
        gated_mlp=True,
        hf_families=("llama", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"),
    )
)
