"""Config validation: every divisibility and range rule, checked before any process group
exists. Each `ConfigError` names the key, its value, the rule and a fix."""

from __future__ import annotations

import os

from megatron_lite.config import Config, ConfigError, ModelConfig, TrainConfig


def _rule(ok: bool, key: str, value, rule: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {rule}. Fix: {fix}.")


def _choice(key: str, value, choices: tuple) -> None:
    _rule(
        value in choices,
        key,
        value,
        f"must be one of {', '.join(map(str, choices))}",
        f"set {key} to one of them",
    )


def check_hardware(cfg: Config) -> None:
    """Rules that depend on the machine the ranks run on (GPU, optional packages); kept out of
    validate() so a login node without GPUs can validate a GPU job."""
    from megatron_lite.models.backends import resolve_attention_backend, resolve_linear_backend

    m = cfg.model
    try:
        resolve_attention_backend(m.attention_backend, cfg.train.precision)
        resolve_linear_backend(m.linear_backend, m.fp8, m.fp8_recipe)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_fp8(cfg: Config) -> None:
    """FP8 runs through Transformer Engine linears, in bf16 training, on GEMM shapes TE accepts
    (every dimension a multiple of 16)."""
    from megatron_lite.models.backends import FP8_FORMATS, FP8_RECIPES

    m, p, t = cfg.model, cfg.parallel, cfg.train
    _choice("model.fp8_recipe", m.fp8_recipe, tuple(FP8_RECIPES))
    if m.fp8 is None:
        return
    _choice("model.fp8", m.fp8, (None, *FP8_FORMATS))
    _rule(
        m.linear_backend == "te",
        "model.fp8",
        m.fp8,
        "FP8 GEMMs run through Transformer Engine linears",
        "set model.linear_backend=te (or model.fp8=null)",
    )
    _rule(
        t.precision == "bf16",
        "model.fp8",
        m.fp8,
        "FP8 training keeps bf16 activations around the FP8 GEMMs",
        "set train.precision=bf16",
    )
    tokens = m.seq_length // p.cp * t.micro_batch_size
    _rule(
        tokens % 16 == 0,
        "model.fp8",
        m.fp8,
        f"the tokens per GEMM, seq_length/cp × micro_batch_size = {tokens}, must be a "
        "multiple of 16 for FP8 GEMMs",
        "change model.seq_length or train.micro_batch_size",
    )
    tp = p.tp
    head_dim = m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    widths = {
        "model.hidden_size": m.hidden_size,
        "model.hidden_size / tp (attention output)": m.hidden_size // tp,
        "(heads + 2·query groups) × head dim / tp": (m.num_attention_heads + 2 * groups)
        * head_dim
        // tp,
    }
    if m.num_experts is None or m.moe_layer_freq > 1:  # dense MLPs (experts use local GEMMs)
        widths["model.ffn_hidden_size / tp"] = m.ffn_hidden_size // tp
    for what, width in widths.items():
        _rule(
            width % 16 == 0,
            "model.fp8",
            m.fp8,
            f"{what} = {width} must be a multiple of 16 for FP8 GEMMs",
            "pick model sizes (and tp) that keep every local GEMM dimension a multiple of 16",
        )


def _validate_ranges(cfg: Config) -> None:
    """Value ranges that would otherwise fail after process groups exist."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    head_dim = m.hidden_size // m.num_attention_heads
    _rule(
        m.arch != "llama" or head_dim % 2 == 0,
        "model.hidden_size",
        m.hidden_size,
        f"gives head dim {head_dim}; rotary embeddings need an even head dim",
        "use hidden_size = an even multiple of num_attention_heads",
    )
    max_pos = m.max_position_embeddings
    _rule(
        max_pos is None or max_pos >= m.seq_length,
        "model.max_position_embeddings",
        max_pos,
        f"must be >= model.seq_length={m.seq_length}",
        "raise it or leave it null",
    )
    _rule(
        m.make_vocab_size_divisible_by >= 1,
        "model.make_vocab_size_divisible_by",
        m.make_vocab_size_divisible_by,
        "must be >= 1",
        "use e.g. 128",
    )
    _rule(
        m.vocab_size is None or m.vocab_size >= 1,
        "model.vocab_size",
        m.vocab_size,
        "must be >= 1",
        "use the tokenizer's vocabulary size or null",
    )
    _rule(
        t.global_batch_size >= 1,
        "train.global_batch_size",
        t.global_batch_size,
        "must be >= 1",
        "use a positive multiple of micro_batch_size·dp",
    )
    for key in ("adam_beta1", "adam_beta2"):
        _rule(
            0.0 <= getattr(t, key) < 1.0,
            f"train.{key}",
            getattr(t, key),
            "must be in [0, 1)",
            "use e.g. 0.9 / 0.95",
        )
    _rule(t.adam_eps > 0, "train.adam_eps", t.adam_eps, "must be > 0", "use e.g. 1e-8")
    _rule(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0", "use 0.1")
    _rule(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 = off)", "use 1.0")
    _rule(
        cfg.log.interval >= 1,
        "log.interval",
        cfg.log.interval,
        "must be >= 1",
        "print every N >= 1 steps",
    )
    _rule(p.timeout_s > 0, "parallel.timeout_s", p.timeout_s, "must be > 0 seconds", "use e.g. 300")
    if d.weights is not None:
        _rule(
            all(w >= 0 for w in d.weights) and sum(d.weights) > 0,
            "data.weights",
            d.weights,
            "must be non-negative with a positive sum",
            "give each path a weight > 0",
        )
    _rule(
        m.num_experts is None or p.tp == 1 or p.sequence_parallel,
        "parallel.sequence_parallel",
        p.sequence_parallel,
        "MoE with tp > 1 needs sequence parallelism (otherwise every TP "
        "rank routes and computes the same tokens)",
        "set parallel.sequence_parallel=true",
    )


def _validate_moe_ranges(m: ModelConfig) -> None:
    _rule(
        m.moe_layer_freq >= 1,
        "model.moe_layer_freq",
        m.moe_layer_freq,
        "must be >= 1 (every k-th layer is MoE)",
        "use 1 for all layers",
    )
    _rule(
        m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
        "model.moe_capacity_factor",
        m.moe_capacity_factor,
        "must be > 0 when set",
        "use e.g. 1.25, or null for dropless",
    )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        _rule(
            getattr(m, key) >= 0,
            f"model.{key}",
            getattr(m, key),
            "must be >= 0",
            "use 0 to disable it",
        )
    _rule(
        m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1,
        "model.moe_ffn_hidden_size",
        m.moe_ffn_hidden_size,
        "must be >= 1 when set",
        "use a positive width or null for ffn_hidden_size",
    )


def num_microbatches(cfg: Config) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.parallel.dp)


def _validate_checkpointing(t: TrainConfig) -> None:
    _rule(
        t.save_interval >= 0,
        "train.save_interval",
        t.save_interval,
        "must be >= 0",
        "use 0 (no checkpoints) or a step count, e.g. 100",
    )
    _rule(
        t.keep_checkpoints >= 1,
        "train.keep_checkpoints",
        t.keep_checkpoints,
        "must be >= 1",
        "keep at least the newest checkpoint, e.g. 2",
    )
    _rule(
        t.resume in ("auto", "none") or os.path.exists(t.resume),
        "train.resume",
        t.resume,
        "must be auto, none or an existing checkpoint path",
        "use auto (newest checkpoint in train.ckpt_dir) or a step_<N> directory",
    )
    if t.init_from is not None:
        _rule(
            os.path.isdir(t.init_from),
            "train.init_from",
            t.init_from,
            "must be an existing checkpoint directory",
            "convert Hugging Face weights with tools/convert_checkpoint.py hf-to-dcp first",
        )
        _rule(
            not os.path.isfile(os.path.join(t.init_from, "config.json")),
            "train.init_from",
            t.init_from,
            "is a Hugging Face model directory, not a checkpoint",
            "convert it: python tools/convert_checkpoint.py hf-to-dcp <hf_dir> <ckpt_dir>",
        )


def validate(cfg: Config, world_size: int) -> Config:
    """Check every rule before any process group exists; fills derived values (parallel.dp,
    model.ffn_hidden_size, model.num_query_groups). Raises ConfigError naming key/rule/fix."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    _choice("model.arch", m.arch, ("llama", "gpt"))
    _choice("train.precision", t.precision, ("fp32", "bf16"))
    _choice("model.attention_backend", m.attention_backend, ("auto", "sdpa", "flash", "te"))
    _choice("model.linear_backend", m.linear_backend, ("local", "te"))
    _choice("parallel.cp_comm_type", p.cp_comm_type, ("a2a",))
    _choice("log.wandb_mode", cfg.log.wandb_mode, ("offline", "online", "disabled"))
    for key in ("tp", "pp", "vpp", "cp", "ep"):
        _rule(
            getattr(p, key) >= 1,
            f"parallel.{key}",
            getattr(p, key),
            "must be >= 1",
            f"set parallel.{key}=1 or more",
        )
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _rule(
            getattr(m, key) >= 1,
            f"model.{key}",
            getattr(m, key),
            "must be >= 1",
            "use a positive integer",
        )

    # world size = tp·pp·cp·dp
    mp = p.tp * p.pp * p.cp
    if p.dp is None:
        _rule(
            world_size % mp == 0,
            "parallel.tp·pp·cp",
            mp,
            f"world size {world_size} must be divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp}",
            f"launch a multiple of {mp} ranks or change the degrees",
        )
        p.dp = world_size // mp
    else:
        suggested_dp = world_size // mp if world_size % mp == 0 else "null"
        _rule(
            p.tp * p.pp * p.cp * p.dp == world_size,
            "parallel.dp",
            p.dp,
            f"world size {world_size} must equal tp·pp·cp·dp = "
            f"{p.tp}·{p.pp}·{p.cp}·{p.dp} = {mp * p.dp}",
            f"launch {mp * p.dp} ranks, or set parallel.dp={suggested_dp}",
        )
    _rule(
        sorted(p.order.split("-")) == sorted(["tp", "cp", "ep", "dp", "pp"]),
        "parallel.order",
        p.order,
        "must name tp, cp, ep, dp and pp once each, joined by '-'",
        "use the default tp-cp-ep-dp-pp",
    )
    tokens = p.order.split("-")
    pos = sorted(tokens.index(a) for a in ("cp", "ep", "dp"))
    _rule(
        pos[2] - pos[0] == 2,
        "parallel.order",
        p.order,
        "cp, ep and dp must be adjacent (experts fold into the dp×cp ranks)",
        "use the default tp-cp-ep-dp-pp",
    )

    # attention heads and query groups
    _rule(
        m.hidden_size % m.num_attention_heads == 0,
        "model.hidden_size",
        m.hidden_size,
        f"must be divisible by model.num_attention_heads={m.num_attention_heads}",
        "pick a hidden size that is a multiple of the head count",
    )
    _rule(
        m.num_attention_heads % p.tp == 0,
        "parallel.tp",
        p.tp,
        f"model.num_attention_heads={m.num_attention_heads} must be divisible by tp",
        f"use a tp that divides {m.num_attention_heads}",
    )
    if m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    _rule(
        m.num_query_groups >= 1,
        "model.num_query_groups",
        m.num_query_groups,
        "must be >= 1",
        "use a divisor of the head count",
    )
    _rule(
        m.num_attention_heads % m.num_query_groups == 0,
        "model.num_query_groups",
        m.num_query_groups,
        f"must divide model.num_attention_heads={m.num_attention_heads}",
        "use a divisor of the head count",
    )
    _rule(
        m.num_query_groups % p.tp == 0,
        "model.num_query_groups",
        m.num_query_groups,
        f"must be divisible by parallel.tp={p.tp} (each TP rank owns whole KV groups)",
        "use more query groups or a smaller tp",
    )
    if p.cp > 1:
        heads_local = m.num_attention_heads // p.tp
        _rule(
            heads_local % p.cp == 0,
            "parallel.cp",
            p.cp,
            f"query heads per TP rank ({heads_local}) must be divisible by cp (Ulysses splits "
            "heads across the CP group)",
            "use a cp that divides num_attention_heads/tp",
        )
        groups_local = m.num_query_groups // p.tp
        _rule(
            groups_local % p.cp == 0 or p.cp % groups_local == 0,
            "model.num_query_groups",
            m.num_query_groups,
            f"KV groups per TP rank ({groups_local}) must divide or be divisible by cp={p.cp}",
            "use a power-of-two number of query groups",
        )
    seq_div = p.cp * (p.tp if p.sequence_parallel else 1)
    _rule(
        m.seq_length % seq_div == 0,
        "model.seq_length",
        m.seq_length,
        f"must be divisible by cp{'·tp (sequence parallel)' if p.sequence_parallel else ''}"
        f" = {seq_div}",
        f"use a multiple of {seq_div}",
    )

    # layers over pipeline stages
    _rule(
        p.vpp == 1 or p.pp > 1,
        "parallel.vpp",
        p.vpp,
        "virtual stages need parallel.pp > 1",
        "set parallel.vpp=1 or parallel.pp >= 2",
    )
    _rule(
        m.num_layers % (p.pp * p.vpp) == 0,
        "model.num_layers",
        m.num_layers,
        f"must be divisible by pp·vpp = {p.pp}·{p.vpp}",
        f"use a multiple of {p.pp * p.vpp}",
    )

    # batch sizes
    _rule(
        t.micro_batch_size >= 1,
        "train.micro_batch_size",
        t.micro_batch_size,
        "must be >= 1",
        "use a positive integer",
    )
    per_step = t.micro_batch_size * p.dp
    _rule(
        t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        t.global_batch_size,
        f"must be a multiple of micro_batch_size·dp = {t.micro_batch_size}·{p.dp}",
        f"use a multiple of {per_step}",
    )
    n_micro = num_microbatches(cfg)
    if p.pp > 1:
        _rule(
            n_micro >= p.pp,
            "train.global_batch_size",
            t.global_batch_size,
            f"gives {n_micro} microbatches per step, fewer than the {p.pp} pipeline stages "
            "(the 1F1B schedule needs at least one microbatch per stage)",
            f"use global_batch_size >= {p.pp * per_step}",
        )
        if p.vpp > 1:
            _rule(
                n_micro % p.pp == 0,
                "train.global_batch_size",
                t.global_batch_size,
                f"gives {n_micro} microbatches; the interleaved schedule needs a multiple of "
                f"pp={p.pp}",
                f"use a multiple of {p.pp * per_step}",
            )

    # mixture of experts
    if m.num_experts is not None:
        _rule(
            m.num_experts >= 1,
            "model.num_experts",
            m.num_experts,
            "must be >= 1",
            "use a positive expert count",
        )
        _rule(
            m.num_experts % p.ep == 0,
            "parallel.ep",
            p.ep,
            f"model.num_experts={m.num_experts} must be divisible by ep",
            "use an ep that divides the expert count",
        )
        _rule(
            1 <= m.moe_router_topk <= m.num_experts,
            "model.moe_router_topk",
            m.moe_router_topk,
            f"must be between 1 and num_experts={m.num_experts}",
            "lower the top-k",
        )
        _validate_moe_ranges(m)
    else:
        _rule(
            p.ep == 1,
            "parallel.ep",
            p.ep,
            "expert parallelism needs an MoE model",
            "set model.num_experts or parallel.ep=1",
        )
    _rule(
        (p.dp * p.cp) % p.ep == 0,
        "parallel.ep",
        p.ep,
        f"must divide dp·cp = {p.dp}·{p.cp} (experts spread over data/context ranks)",
        "use an ep that divides dp·cp",
    )

    # model sizes and training ranges
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = (
            4 * m.hidden_size if m.arch == "gpt" else 64 * -(-int(8 * m.hidden_size / 3) // 64)
        )
    _rule(
        m.ffn_hidden_size % p.tp == 0,
        "model.ffn_hidden_size",
        m.ffn_hidden_size,
        f"must be divisible by parallel.tp={p.tp}",
        f"use a multiple of {p.tp}",
    )
    for key in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, key)
        _rule(0.0 <= v < 1.0, f"model.{key}", v, "must be in [0, 1)", "use e.g. 0.0 or 0.1")
    _rule(t.steps >= 1, "train.steps", t.steps, "must be >= 1", "use a positive step count")
    _rule(t.lr > 0, "train.lr", t.lr, "must be > 0", "use e.g. 3e-4")
    _rule(0 <= t.warmup_steps, "train.warmup_steps", t.warmup_steps, "must be >= 0", "use 0+")
    _validate_checkpointing(t)
    _validate_ranges(cfg)
    _validate_fp8(cfg)

    # data
    if d.mock:
        _rule(
            m.vocab_size is not None,
            "model.vocab_size",
            m.vocab_size,
            "mock data needs an explicit vocabulary size",
            "set model.vocab_size, e.g. 512",
        )
    else:
        _rule(
            bool(d.paths) or d.corpus is not None,
            "data.paths",
            d.paths,
            "no training data: give indexed dataset prefixes, a built-in corpus or mock data",
            "set data.paths=[prefix], data.corpus=shakespeare or data.mock=true",
        )
        if d.corpus is not None:
            _choice("data.corpus", d.corpus, ("shakespeare",))
        if d.weights is not None:
            _rule(
                len(d.weights) == len(d.paths),
                "data.weights",
                d.weights,
                f"needs one weight per path ({len(d.paths)} paths)",
                "list one weight per path",
            )
        for prefix in d.paths:
            for ext in (".bin", ".idx"):
                _rule(
                    os.path.isfile(prefix + ext),
                    "data.paths",
                    prefix,
                    f"file {prefix + ext} does not exist",
                    "run tools/preprocess_data.py to create it or correct the prefix",
                )
        if d.paths and d.tokenizer_model is not None:
            _rule(
                os.path.isfile(d.tokenizer_model),
                "data.tokenizer_model",
                d.tokenizer_model,
                "file does not exist",
                "train one with tools/train_tokenizer.py",
            )
    return cfg
