"""Model FLOPs (the MFU convention) and peak dense bf16 throughput per GPU type.

Pure functions of the config, shared by the trainer's progress line and the planner. Per token,
forward + backward, a multiply-add counted as 2 FLOPs: 6·N_active + the attention term, each
architecture's own (its registry entry's `flops`; the shipped decoders' formula and what it
counts are in models/decoder.py), plus the multi-token prediction modules' (`mtp_flops`).
"""

from __future__ import annotations

import dataclasses

from megatron_lite import resolve
from megatron_lite.config import Config, ModelConfig
from megatron_lite.models.registry import FlopsPerToken, get_architecture

# Peak dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s per GPU, from NVIDIA's datasheets.
PEAK_BF16_TFLOPS = {
    "h100": 989.0,  # H100 SXM
    "h100-pcie": 756.0,
    "h200": 989.0,  # H200 SXM: the H100's compute with more memory
    "a100": 312.0,
    "b200": 2250.0,
}


def flops_per_token(cfg: Config, vocab_size: int | None = None) -> FlopsPerToken:
    """The architecture's FLOPs per token (registry.py `FlopsPerToken`), with the MTP
    modules' (`mtp_flops`). `vocab_size` stands in for a null model.vocab_size (the
    tokenizer's)."""
    m = cfg.model
    v = vocab_size if m.vocab_size is None else m.vocab_size
    if v is None:
        raise ValueError("model.vocab_size is null: pass the tokenizer's vocab_size")
    main = get_architecture(m.arch).flops(m, v)
    if not m.mtp_num_layers:
        return main
    extra = mtp_flops(m, v, main)
    return FlopsPerToken(main.matmul_params + extra.matmul_params, main.attention + extra.attention)


def mtp_flops(m: ModelConfig, vocab_size: int, main: FlopsPerToken) -> FlopsPerToken:
    """The D multi-token prediction modules' FLOPs per token (models/mtp.py): per module the
    projection 2h -> h (2h·h weights), one layer of the kind the module builds (the main
    model's last layer's: what the architecture's own formula adds for one more such layer,
    attention included) and the output head (h·V). Megatron-Core's
    num_floating_point_operations counts the same: mtp_num_layers more layers (MoE when the
    last layer is), 2h² of projection per module and the logits (mtp_num_layers + 1) times
    (it also counts the three norms, 3h, which our convention leaves out as for every norm).
    `main`: the architecture's FLOPs of the model without MTP."""
    d, h = m.mtp_num_layers, m.hidden_size
    pattern = resolve.moe_layer_pattern(m) + resolve.mtp_moe_pattern(m)
    longer = dataclasses.replace(
        m,
        num_layers=m.num_layers + d,
        moe_layer_freq=[int(moe) for moe in pattern],
        moe_first_k_dense_replace=0,
        mtp_num_layers=0,
    )
    more = get_architecture(m.arch).flops(longer, vocab_size)
    layers = more.matmul_params - main.matmul_params
    return FlopsPerToken(layers + d * (2 * h * h + h * vocab_size), more.attention - main.attention)


def matmul_params_per_token(cfg: Config, vocab_size: int | None = None) -> float:
    """N_active: weights each token multiplies in one forward."""
    return flops_per_token(cfg, vocab_size).matmul_params


def model_flops_per_token(cfg: Config, vocab_size: int | None = None) -> float:
    """Model FLOPs of forward + backward per token: 6·N_active + the attention term."""
    return flops_per_token(cfg, vocab_size).total


def peak_tflops(gpu: str) -> float:
    """Peak dense bf16 TFLOP/s of a GPU: a key of PEAK_BF16_TFLOPS ("h100", "b200", ...) or a
    device name as torch.cuda.get_device_name gives it ("NVIDIA H100 80GB HBM3")."""
    name = gpu.lower()
    for key in ("h100", "h200", "a100", "b200"):
        if key in name:
            return PEAK_BF16_TFLOPS["h100-pcie" if key == "h100" and "pcie" in name else key]
    raise ValueError(
        f"unknown GPU {gpu!r}: peak bf16 TFLOP/s known for {', '.join(PEAK_BF16_TFLOPS)}"
    )
