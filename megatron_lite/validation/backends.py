"""Backend rules: FP8 through our own linears (torchao's tensorwise and rowwise recipes) or
through Transformer Engine (checked anywhere), and the hardware check that needs the machine
the ranks run on."""

from __future__ import annotations

from megatron_lite.config import Config, ConfigError
from megatron_lite.models.decoder import latent_attention_gemm_widths
from megatron_lite.parallel.fp8 import LOCAL_RECIPES, UNALIGNED
from megatron_lite.resolve import kv_channels, moe_layer_pattern
from megatron_lite.validation.rules import _choice, _rule


def check_hardware(cfg: Config) -> None:
    """Rules that depend on the machine the ranks run on (GPU, optional packages); kept out of
    validate() so a login node without GPUs can validate a GPU job."""
    import torch

    from megatron_lite import resolve
    from megatron_lite.validation.compile import check_compile_support
    from megatron_lite.validation.data_parallel import check_nvme_path
    from megatron_lite.validation.profiling import check_profile_hardware

    check_profile_hardware(cfg, torch.cuda.is_available())
    check_compile_support(cfg)
    check_nvme_path(cfg)
    m = cfg.model
    try:
        resolve.attention_backend(m.attention_backend, cfg.train.precision)
        resolve.linear_backend(m.linear_backend, m.fp8, m.fp8_recipe)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.fp8 in LOCAL_RECIPES:
        import importlib.util

        _rule(
            importlib.util.find_spec("torchao") is not None,
            "model.fp8",
            m.fp8,
            "local FP8 GEMMs run through torchao's float8 training (not installed)",
            "pip install 'torchao>=0.18' (the megatron_lite[fp8] extra), or set model.fp8=null",
        )


def _validate_fp8(cfg: Config) -> None:
    """FP8 in bf16 training: tensorwise | rowwise through our linears (linear_backend=local,
    torchao's recipes; a layer whose dims are not multiples of 16 stays bf16 or, with
    model.fp8_unaligned=error, is refused when the model is built), hybrid | e4m3 through
    Transformer Engine linears on GEMM shapes TE accepts (every dimension a multiple of 16; of
    32 for MXFP8's 32-element blocks)."""
    from megatron_lite.parallel.te_linear import FP8_FORMATS, FP8_RECIPES

    m, p, t = cfg.model, cfg.parallel, cfg.train
    _choice("model.fp8_recipe", m.fp8_recipe, tuple(FP8_RECIPES))
    _choice("model.fp8_unaligned", m.fp8_unaligned, UNALIGNED)
    if m.fp8 is None:
        return
    _choice("model.fp8", m.fp8, (None, *LOCAL_RECIPES, *FP8_FORMATS))
    local = m.fp8 in LOCAL_RECIPES
    _rule(
        m.linear_backend == ("local" if local else "te"),
        "model.fp8",
        m.fp8,
        "tensorwise and rowwise are torchao's recipes for our own linears "
        "(model.linear_backend=local); hybrid and e4m3 are Transformer Engine's FP8 formats "
        "(model.linear_backend=te, the recipe in model.fp8_recipe)",
        "set model.linear_backend=local for model.fp8=tensorwise|rowwise, or "
        "model.linear_backend=te with model.fp8=hybrid|e4m3 (and model.fp8_recipe)",
    )
    _rule(
        t.precision == "bf16",
        "model.fp8",
        m.fp8,
        "FP8 training keeps bf16 activations around the FP8 GEMMs",
        "set train.precision=bf16",
    )
    align = 32 if m.fp8_recipe == "mxfp8" and not local else 16
    tokens = m.seq_length // p.cp * t.micro_batch_size
    _rule(
        tokens % align == 0,
        "model.fp8",
        m.fp8,
        f"the tokens per GEMM, seq_length/cp × micro_batch_size = {tokens}, must be a "
        f"multiple of {align} for {m.fp8_recipe} FP8 GEMMs",
        "change model.seq_length or train.micro_batch_size",
    )
    if local:  # each layer's widths: models.fp8.apply_fp8 (model.fp8_unaligned)
        return
    tp = p.tp
    head_dim = kv_channels(m)
    groups = m.num_query_groups or m.num_attention_heads
    widths = {"model.hidden_size": m.hidden_size}
    if m.multi_latent_attention:  # its own linears' widths
        widths.update(latent_attention_gemm_widths(m, tp))
    else:
        widths["heads × head dim / tp (attention output)"] = m.num_attention_heads * head_dim // tp
        widths["(heads + 2·query groups) × head dim / tp"] = (
            (m.num_attention_heads + 2 * groups) * head_dim // tp
        )
    if not all(moe_layer_pattern(m)):  # dense MLPs (experts use local GEMMs)
        widths["model.ffn_hidden_size / tp"] = m.ffn_hidden_size // tp
    if any(moe_layer_pattern(m)) and m.moe_shared_expert_ffn_hidden_size:  # a dense MLP too
        widths["model.moe_shared_expert_ffn_hidden_size / tp"] = (
            m.moe_shared_expert_ffn_hidden_size // tp
        )
    for what, width in widths.items():
        _rule(
            width % align == 0,
            "model.fp8",
            m.fp8,
            f"{what} = {width} must be a multiple of {align} for {m.fp8_recipe} FP8 GEMMs",
            f"pick model sizes (and tp) that keep every local GEMM dimension a multiple of {align}",
        )
