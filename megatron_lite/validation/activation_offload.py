"""Activation CPU offload rules (model.activation_offload*, parallel/activation_offload.py)."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.parallel.activation_offload import OFFLOAD_MODULES
from megatron_lite.resolve import moe_layer_pattern
from megatron_lite.validation.rules import _rule

KEY = "model.activation_offload"


def _validate_activation_offload(cfg: Config) -> None:
    """Known, distinct submodule names that the model has; a positive in-flight limit; a
    non-negative size threshold; not under torch.compile."""
    m = cfg.model
    mods = list(m.activation_offload)
    names = ", ".join(OFFLOAD_MODULES)
    for name in mods:
        _rule(
            name in OFFLOAD_MODULES,
            KEY,
            mods,
            f"{name!r} is not a submodule we offload (the names are {names}; Megatron-Core's "
            f"--offload-modules names where ours match)",
            f"list only names from {names}, e.g. [core_attn, attn_proj]",
        )
    _rule(len(set(mods)) == len(mods), KEY, mods, "lists a submodule twice", "list each once")
    pattern = moe_layer_pattern(m)
    _rule(
        "moe_experts" not in mods or any(pattern),
        KEY,
        mods,
        f"moe_experts offloads a MoE layer's experts, and this model has no MoE layer "
        f"(model.num_experts={m.num_experts})",
        "remove moe_experts (a dense layer's MLP is `mlp`)",
    )
    _rule(
        "mlp" not in mods or not all(pattern),
        KEY,
        mods,
        "mlp offloads a dense layer's MLP, and every layer of this model is a MoE layer",
        "remove mlp (a MoE layer's experts are `moe_experts`)",
    )
    _rule(
        m.activation_offload_inflight >= 1,
        "model.activation_offload_inflight",
        m.activation_offload_inflight,
        "must be >= 1 (the most submodule copies to the host in flight at once)",
        "set it to 1 or more (default 4)",
    )
    _rule(
        m.activation_offload_min_bytes >= 0,
        "model.activation_offload_min_bytes",
        m.activation_offload_min_bytes,
        "must be >= 0 (saved tensors smaller than this stay on the device)",
        "set it to 0 or more (default 1048576)",
    )
    _rule(
        not (mods and m.compile),
        KEY,
        mods,
        "activation offload hooks the saved tensors of submodules, which torch.compile'd "
        "layers (model.compile=true) do not expose",
        "set model.compile=false, or model.activation_offload=[]",
    )
