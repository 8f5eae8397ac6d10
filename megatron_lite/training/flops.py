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

# Peak dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s per GPU, with FP32 accumulation (what
# training runs), from NVIDIA's datasheets; the sources are cited in plan/hardware.py.
PEAK_BF16_TFLOPS = {
    "h100": 989.0,  # H100 SXM
    "h100-pcie": 756.0,
    "h200": 989.0,  # H200 SXM: the H100's compute with more memory
    "a100": 312.0,  # A100 SXM
    "a100-pcie": 312.0,
    "b200": 2250.0,
    "rtx-pro-6000": 503.8,  # RTX PRO 6000 Blackwell (Workstation Edition)
    "rtx5090": 209.5,  # GeForce: FP32 accumulation at half the FP16-accumulate rate (419)
    "l40s": 362.05,
}
# Peak dense FP8 tensor-core TFLOP/s (FP32 accumulation); the A100s have no FP8 tensor cores.
PEAK_FP8_TFLOPS = {
    "h100": 1979.0, "h100-pcie": 1513.0, "h200": 1979.0, "b200": 4500.0,
    "rtx-pro-6000": 1007.6, "rtx5090": 419.0, "l40s": 733.0,
}  # fmt: skip
# device names as torch.cuda.get_device_name gives them -> key, the most specific first
_NAMES = (
    (("rtx pro 6000", "rtx-pro-6000"), "rtx-pro-6000"),
    (("rtx 5090", "rtx5090"), "rtx5090"),
    (("l40s",), "l40s"),
    (("h100 pcie", "h100-pcie"), "h100-pcie"),
    (("a100 pcie", "a100-pcie", "a100 80gb pcie"), "a100-pcie"),
    (("h100",), "h100"),
    (("h200",), "h200"),
    (("a100",), "a100"),
    (("b200",), "b200"),
)


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


def gpu_key(gpu: str) -> str:
    """The table key of a GPU: a key itself ("h100", "rtx5090", ...) or a device name as
    torch.cuda.get_device_name gives it ("NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 5090")."""
    name = gpu.lower()
    if name in PEAK_BF16_TFLOPS:
        return name
    for patterns, key in _NAMES:
        if any(p in name for p in patterns):
            return key
    raise ValueError(
        f"unknown GPU {gpu!r}: peak bf16 TFLOP/s known for {', '.join(PEAK_BF16_TFLOPS)}"
    )


def peak_tflops(gpu: str) -> float:
    """Peak dense bf16 TFLOP/s of a GPU (a key of PEAK_BF16_TFLOPS or a device name)."""
    return PEAK_BF16_TFLOPS[gpu_key(gpu)]


def peak_fp8_tflops(gpu: str) -> float | None:
    """Peak dense FP8 TFLOP/s of a GPU, None where it has no FP8 tensor cores."""
    return PEAK_FP8_TFLOPS.get(gpu_key(gpu))
