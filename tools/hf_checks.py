"""What a Hugging Face directory must hold before tools/convert_checkpoint.py converts it:
every config.json field the converter reads (tools/hf_families.py) checked for presence, type
and range, and every tensor for its shape and dtype against that config. Errors are
CheckpointError naming the file, the field, its value, the rule and a fix (exit 2)."""

from __future__ import annotations

import math
import re

from megatron_lite.checkpoint.errors import CheckpointError

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")  # the weights' dtypes we read


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


# kind: (predicate, the rule as a user reads it)
KINDS = {
    "count": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    "nonneg_int": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "count?": (lambda v: v is None or (_is_int(v) and v >= 1), "must be an integer >= 1 or null"),
    "bool": (lambda v: isinstance(v, bool), "must be true or false"),
    "positive": (lambda v: _is_number(v) and v > 0, "must be a finite number > 0"),
    "nonneg": (lambda v: _is_number(v) and v >= 0, "must be a finite number >= 0"),
    "str": (lambda v: isinstance(v, str), "must be a string"),
    "object?": (lambda v: v is None or isinstance(v, dict), "must be an object or null"),
    "strs?": (
        lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "must be a list of strings or null",
    ),
    "ints?": (
        lambda v: v is None or (isinstance(v, list) and all(_is_int(x) for x in v)),
        "must be a list of integers or null",
    ),
    "window?": (lambda v: v is None or (_is_int(v) and v >= 0), "must be an integer or null"),
}
MOE = ("mixtral", "qwen3_moe", "qwen2_moe")
QWEN = ("qwen3", "qwen3_moe", "qwen2_moe")
QWEN_MOE = ("qwen3_moe", "qwen2_moe")
DSV3 = ("deepseek_v3",)
# field: (kind, required (True, or the families that require it), families it is read for;
# () = all)
FIELDS = {
    "architectures": ("strs?", False, ()),
    "num_hidden_layers": ("count", True, ()),
    "hidden_size": ("count", True, ()),
    "num_attention_heads": ("count", True, ()),
    "num_key_value_heads": ("count?", ("qwen3", *MOE, *DSV3), ()),  # defaults are not `heads`
    "head_dim": ("count?", False, ()),
    "intermediate_size": ("count", True, ()),
    "vocab_size": ("count", True, ()),
    "max_position_embeddings": ("count?", False, ()),
    "tie_word_embeddings": ("bool", False, ()),
    "rms_norm_eps": ("positive", False, ()),
    "rope_theta": ("positive", False, ()),
    "rope_parameters": ("object?", False, ()),
    "rope_scaling": ("object?", False, ()),
    "attention_bias": ("bool", False, ()),
    "mlp_bias": ("bool", False, ()),
    "hidden_act": ("str", False, ()),
    "num_experts_per_tok": ("count", False, (*MOE, *DSV3)),
    "router_aux_loss_coef": ("nonneg", False, MOE),
    "num_local_experts": ("count", False, ("mixtral",)),
    "sliding_window": ("window?", False, ("mixtral",)),
    "router_jitter_noise": ("nonneg", False, ("mixtral",)),
    "num_experts": ("count", False, QWEN_MOE),
    "moe_intermediate_size": ("count", True, (*QWEN_MOE, *DSV3)),
    "shared_expert_intermediate_size": ("count", True, ("qwen2_moe",)),
    "qkv_bias": ("bool", False, ("qwen2_moe",)),
    "norm_topk_prob": ("bool", False, (*QWEN_MOE, *DSV3)),
    "use_sliding_window": ("bool", False, QWEN),
    "layer_types": ("strs?", False, QWEN),
    "decoder_sparse_step": ("count", False, QWEN_MOE),
    "mlp_only_layers": ("ints?", False, QWEN_MOE),
    # DeepSeek-V3 (tools/hf_deepseek.py); the published config's own fields that transformers'
    # class lacks (topk_method, scoring_func, aux_loss_alpha, seq_aux, moe_layer_freq) too
    "n_routed_experts": ("count", False, DSV3),
    "n_shared_experts": ("count", False, DSV3),
    "routed_scaling_factor": ("positive", False, DSV3),
    "n_group": ("count", False, DSV3),
    "topk_group": ("count", False, DSV3),
    "first_k_dense_replace": ("nonneg_int", False, DSV3),
    "q_lora_rank": ("count?", False, DSV3),
    "kv_lora_rank": ("count", False, DSV3),
    "qk_nope_head_dim": ("count", False, DSV3),
    "qk_rope_head_dim": ("count", False, DSV3),
    "v_head_dim": ("count", False, DSV3),
    "rope_interleave": ("bool", False, DSV3),
    "num_nextn_predict_layers": ("nonneg_int", False, DSV3),
    "topk_method": ("str", False, DSV3),
    "scoring_func": ("str", False, DSV3),
    "aux_loss_alpha": ("nonneg", False, DSV3),
    "seq_aux": ("bool", False, DSV3),
    "moe_layer_freq": ("count", False, DSV3),
    "quantization_config": ("object?", False, DSV3),
}
# transformers 5.25's config-class defaults of the optional fields read here (rope_theta: its
# default rope_parameters' theta; head_dim None: hidden_size / num_attention_heads); the expert
# widths and, where the class default is not one KV head per head, num_key_value_heads are
# required (tools/hf_checks.py)
_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
_QWEN_MOE = {"decoder_sparse_step": 1, "norm_topk_prob": False, "router_aux_loss_coef": 0.001}
HF_DEFAULTS = {
    "llama": _COMMON | {"head_dim": None},
    "qwen3": _COMMON | {"head_dim": 128},
    "mixtral": _COMMON
    | {"head_dim": None, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8}
    | {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
    "qwen3_moe": _COMMON
    | _QWEN_MOE
    | {"head_dim": None, "num_experts": 128, "num_experts_per_tok": 8},
    "qwen2_moe": _COMMON
    | _QWEN_MOE
    | {"head_dim": None, "num_experts": 60, "num_experts_per_tok": 4, "qkv_bias": True},
    "deepseek_v3": _COMMON
    | {"n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8}
    | {"routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "norm_topk_prob": True}
    | {"first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536}
    | {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    | {"rope_interleave": True, "num_nextn_predict_layers": 1, "max_position_embeddings": 4096},
}


ORIGINAL = "use the config.json the model was published with"
SAVED = "use a checkpoint that a run (or hf-to-dcp) saved, with its metadata.json as written"
MAX_LAYERS = 1 << 16  # far beyond any model; bounds the per-layer loops a crafted file drives


def bad(file: str, key: str, value, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{file}: {key}={value!r}: {rule}. Fix: {fix}")


def check_hf_config(c, family: str | None, file: str = "config.json") -> None:
    """Every field the converter reads from a `family` config.json: present when required, of
    its type and range, and consistent with the others (heads, head dim, experts, layers)."""
    if not isinstance(c, dict):
        raise CheckpointError(
            f"{file} holds a JSON {type(c).__name__}, not an object. Fix: point at a Hugging "
            "Face model directory whose config.json is the model's config object"
        )
    if family is None:
        return
    for key, (kind, required, families) in FIELDS.items():
        if families and family not in families:
            continue
        if key not in c:
            if required is True or (required and family in required):
                raise CheckpointError(
                    f"{file} has no {key}: a {family} config.json must give it. Fix: add "
                    f'"{key}" (see the model card), or use the model\'s original config.json'
                )
            continue
        ok, rule = KINDS[kind]
        if not ok(c[key]):
            raise bad(file, key, c[key], rule, f"give {key} as the model's {family} config does")
    for key in ("rope_parameters", "rope_scaling"):
        rope = c.get(key) or {}
        if "rope_theta" in rope and not KINDS["positive"][0](rope["rope_theta"]):
            raise bad(file, f"{key}.rope_theta", rope["rope_theta"], KINDS["positive"][1], ORIGINAL)
    _check_consistency(c, family, file)


def _check_consistency(c: dict, family: str, file: str) -> None:
    layers, heads, hidden = c["num_hidden_layers"], c["num_attention_heads"], c["hidden_size"]
    if layers > MAX_LAYERS:
        raise bad(file, "num_hidden_layers", layers, f"must be <= {MAX_LAYERS}", ORIGINAL)
    kv = c.get("num_key_value_heads") or heads
    if family == "deepseek_v3":
        _check_deepseek(c, file)
        return
    if heads % kv:
        raise bad(
            file, "num_key_value_heads", kv, f"must divide num_attention_heads={heads}", ORIGINAL
        )
    head_dim = c.get("head_dim", HF_DEFAULTS[family]["head_dim"])
    if head_dim is None and hidden % heads:
        raise bad(
            file,
            "hidden_size",
            hidden,
            f"must be a multiple of num_attention_heads={heads} when head_dim is not given",
            "give head_dim",
        )
    head_dim = head_dim or hidden // heads
    if head_dim % 2:
        raise bad(file, "head_dim", head_dim, "rotary embeddings need an even head dim", ORIGINAL)
    if family not in MOE:
        return
    experts = (
        c.get("num_local_experts", 8) if family == "mixtral" else _qwen_experts(c, family, file)
    )
    k = c.get("num_experts_per_tok", HF_DEFAULTS[family]["num_experts_per_tok"])
    if k > experts:
        raise bad(file, "num_experts_per_tok", k, f"must be <= the {experts} experts", ORIGINAL)
    if family in QWEN_MOE:
        _check_qwen_layers(c, file)


def _check_deepseek(c: dict, file: str) -> None:
    """DeepSeek-V3's own rules: every head its own key and value (MLA), the experts split
    evenly into groups of at least two (the top-2 group score), top-k within topk_group."""
    d = HF_DEFAULTS["deepseek_v3"] | {k: v for k, v in c.items() if v is not None}
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    if kv != heads:
        rule = f"must equal num_attention_heads={heads} (MLA: every head its own key and value)"
        raise bad(file, "num_key_value_heads", kv, rule, ORIGINAL)
    dense, layers = d["first_k_dense_replace"], c["num_hidden_layers"]
    if dense >= layers:
        rule = f"must be < num_hidden_layers={layers} (DeepSeek-V3 is MoE after the first k)"
        raise bad(file, "first_k_dense_replace", dense, rule, ORIGINAL)
    nope, rope = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
    if "qk_head_dim" in c and c["qk_head_dim"] != nope + rope:
        rule = f"HF's qk_head_dim is qk_nope_head_dim + qk_rope_head_dim = {nope + rope}"
        raise bad(file, "qk_head_dim", c["qk_head_dim"], rule, ORIGINAL)
    if d["qk_rope_head_dim"] % 2:
        raise bad(file, "qk_rope_head_dim", d["qk_rope_head_dim"], "RoPE needs it even", ORIGINAL)
    experts, groups, topk_group = d["n_routed_experts"], d["n_group"], d["topk_group"]
    if experts % groups or (groups > 1 and experts // groups < 2):
        rule = f"must split the {experts} experts into equal groups of at least 2 (top-2 score)"
        raise bad(file, "n_group", groups, rule, ORIGINAL)
    if topk_group > groups:
        raise bad(file, "topk_group", topk_group, f"must be <= n_group={groups}", ORIGINAL)
    k, reachable = d["num_experts_per_tok"], topk_group * (experts // groups)
    if k > reachable:
        rule = f"must be <= the {reachable} experts of topk_group={topk_group} groups"
        raise bad(file, "num_experts_per_tok", k, rule, ORIGINAL)


def _qwen_experts(c: dict, family: str, file: str) -> int:
    """num_experts (HF's attribute map reads num_local_experts as it), or the default."""
    experts = c.get("num_experts", c.get("num_local_experts", HF_DEFAULTS[family]["num_experts"]))
    if not (_is_int(experts) and experts >= 1):
        raise bad(file, "num_experts", experts, KINDS["count"][1], "give the expert count")
    return experts


def _check_qwen_layers(c: dict, file: str) -> None:
    layers = c["num_hidden_layers"]
    dense = c.get("mlp_only_layers") or []
    outside = [i for i in dense if not 0 <= i < layers]
    if outside:
        raise bad(
            file,
            "mlp_only_layers",
            dense,
            f"layer indices must be in 0..{layers - 1} (num_hidden_layers={layers}); {outside} "
            "are not",
            "list existing layers only",
        )
    step = c.get("decoder_sparse_step", 1)
    if not any(i not in dense and (i + 1) % step == 0 for i in range(layers)):
        raise bad(
            file,
            "decoder_sparse_step",
            step,
            f"with mlp_only_layers={dense} no layer of {layers} is MoE",
            "convert a dense model as Llama, or fix decoder_sparse_step / mlp_only_layers",
        )


# ------------------------------------------------------------------ our model config
OUR_SIZES = {  # model.* keys the export reads: (may be null)
    "num_layers": False,
    "hidden_size": False,
    "num_attention_heads": False,
    "num_query_groups": True,
    "kv_channels": True,
    "ffn_hidden_size": True,
    "moe_ffn_hidden_size": True,
    "moe_router_topk": False,
}


def check_our_model(mc, what: str) -> None:
    """The sizes of our model config (a checkpoint's metadata.json) that the export computes
    with: integers >= 1 (null where allowed), heads divisible by the query groups."""
    for key, nullable in OUR_SIZES.items():
        v = getattr(mc, key)
        if not ((nullable and v is None) or (_is_int(v) and v >= 1)):
            rule = "must be an integer >= 1" + " or null" * nullable
            raise bad(what, f"model.{key}", v, rule, SAVED)
    if mc.num_layers > MAX_LAYERS:
        raise bad(what, "model.num_layers", mc.num_layers, f"must be <= {MAX_LAYERS}", SAVED)
    groups = mc.num_query_groups or mc.num_attention_heads
    if mc.num_attention_heads % groups:
        raise bad(
            what,
            "model.num_query_groups",
            groups,
            f"must divide model.num_attention_heads={mc.num_attention_heads}",
            SAVED,
        )
    if mc.kv_channels is None and mc.hidden_size % mc.num_attention_heads:
        raise bad(what, "model.hidden_size", mc.hidden_size, "must divide by the heads", SAVED)


# ------------------------------------------------------------------ tensors against the config
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def check_count(names, count: int, what: str, key: str, pattern=_LAYER) -> None:
    """The weights hold exactly indices 0..count-1 of `pattern` (layers, experts): checked
    before any loop over them runs, so a config that does not belong to them stops here."""
    found = {int(m.group(1)) for n in names for m in [pattern.search(n)] if m}
    if found != set(range(count)):
        kind = "layers" if pattern is _LAYER else "experts"
        held = f"{kind} {min(found)}..{max(found)} ({len(found)} indices)" if found else "none"
        raise CheckpointError(
            f"{what}: {key}={count} but the weights hold {held}. Fix: use the config that "
            "belongs to these weights"
        )


def check_expert_count(names, count: int, what: str, key: str) -> None:
    experts = [n for n in names if _EXPERT.search(n)]
    check_count(experts, count, what, key, _EXPERT)


def check_shapes(
    shapes: dict[str, tuple[int, ...]],
    want: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    what: str,
    where=lambda name: "",
) -> None:
    """Each tensor's shape as the config gives it and a floating dtype; `where(name)` names
    the file a tensor came from."""
    for name, shape in want.items():
        if name in shapes and tuple(shapes[name]) != tuple(shape):
            raise CheckpointError(
                f"{what}{where(name)}: tensor {name} has shape {list(shapes[name])}, the config "
                f"gives {list(shape)}. Fix: convert weights with the config they were saved with"
            )
    for name, dtype in dtypes.items():
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{what}{where(name)}: tensor {name} has dtype {dtype}; weights must be one of "
                f"{', '.join(FLOAT_DTYPES)}. Fix: export the model's weights in floating point"
            )
