"""Per-field rules: enumerated choices, positive sizes and value ranges of single keys."""

from __future__ import annotations

from megatron_lite.config import Config, ModelConfig, TrainConfig
from megatron_lite.models.registry import architecture_names, get_architecture
from megatron_lite.pipeline.registry import named_schedule, resolve_schedule, schedule_names
from megatron_lite.resolve import CP_COMM_TYPES
from megatron_lite.validation.rules import _choice, _rule, _timeout


def _validate_choices(cfg: Config) -> None:
    """Enumerated string fields (architecture, precision, backends, logging mode)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    names = architecture_names()
    _rule(
        m.arch in names,
        "model.arch",
        m.arch,
        f"must be one of {', '.join(names)} (the registered architectures)",
        "set model.arch to one of them, or register yours with "
        "megatron_lite.models.registry.register_architecture before validation",
    )
    _rule(
        t.precision != "fp16",
        "train.precision",
        t.precision,
        "fp16 needs loss scaling, which megatron_lite does not do (bf16 has fp32's range)",
        "use train.precision=bf16 (or fp32)",
    )
    _choice("train.precision", t.precision, ("fp32", "bf16"))
    _choice("model.attention_backend", m.attention_backend, ("auto", "sdpa", "flash", "te"))
    _choice("model.linear_backend", m.linear_backend, ("local", "te"))
    _choice("parallel.cp_comm_type", p.cp_comm_type, CP_COMM_TYPES)
    _choice("parallel.pipeline_schedule", p.pipeline_schedule, (None, *schedule_names()))
    if p.pipeline_schedule is not None:
        try:
            resolve_schedule(p.pipeline_schedule, p.vpp)
        except ValueError as e:
            need = named_schedule(p.pipeline_schedule).vpp  # the vpp it runs on
            fix = f"set parallel.vpp={need}" if need else "set parallel.vpp=2 or more"
            _rule(False, "parallel.pipeline_schedule", p.pipeline_schedule, str(e), fix)
    _choice("log.wandb_mode", cfg.log.wandb_mode, ("offline", "online", "disabled"))


def _validate_positive_sizes(cfg: Config) -> None:
    """Parallel degrees and model dimensions, which every later rule divides by."""
    m, p = cfg.model, cfg.parallel
    for key in ("tp", "pp", "vpp", "cp", "ep"):
        _rule(
            getattr(p, key) >= 1,
            f"parallel.{key}",
            getattr(p, key),
            "must be >= 1",
            f"set parallel.{key}=1 or more",
        )
    _rule(  # the world-size rule divides by it, and "launch 0 ranks" is no fix
        p.dp is None or p.dp >= 1,
        "parallel.dp",
        p.dp,
        "must be >= 1, or null (world size / tp·pp·cp)",
        "set parallel.dp=null, or the data-parallel replicas",
    )
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _rule(
            getattr(m, key) >= 1,
            f"model.{key}",
            getattr(m, key),
            "must be >= 1",
            "use a positive integer",
        )


def _validate_dropout_and_schedule(m: ModelConfig, t: TrainConfig) -> None:
    """Dropout probabilities and the step / learning-rate schedule."""
    for key in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, key)
        _rule(0.0 <= v < 1.0, f"model.{key}", v, "must be in [0, 1)", "use e.g. 0.0 or 0.1")
    _rule(t.steps >= 1, "train.steps", t.steps, "must be >= 1", "use a positive step count")
    _rule(t.min_lr >= 0, "train.min_lr", t.min_lr, "must be >= 0", "use e.g. 0.1·train.lr")
    _rule(
        t.min_lr <= t.lr,
        "train.min_lr",
        t.min_lr,
        f"must be <= train.lr={t.lr} (the schedule decays from lr down to min_lr)",
        f"lower train.min_lr, e.g. train.min_lr={t.lr / 10:g}, or raise train.lr",
    )
    _rule(0 <= t.warmup_steps, "train.warmup_steps", t.warmup_steps, "must be >= 0", "use 0+")
    _rule(
        t.lr_decay_steps is None or t.lr_decay_steps >= 1,
        "train.lr_decay_steps",
        t.lr_decay_steps,
        "must be >= 1 when set",
        "give a step count, e.g. train.lr_decay_steps=1000, or null (= train.steps)",
    )


def _validate_model_ranges(cfg: Config) -> None:
    """Model value ranges that would otherwise fail after process groups exist, and the
    architecture's own rules (its registry entry's `validate`, after the head dimension's)."""
    m = cfg.model
    _rule(
        m.kv_channels is None or m.kv_channels >= 1,
        "model.kv_channels",
        m.kv_channels,
        "the head dimension must be >= 1",
        "give a positive head dimension, or null for hidden_size / num_attention_heads",
    )
    _validate_architecture(cfg)
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
        m.ffn_hidden_size is None or m.ffn_hidden_size >= 1,
        "model.ffn_hidden_size",
        m.ffn_hidden_size,
        "must be >= 1 when set",
        "give the MLP width, e.g. 4·hidden_size, or null for the architecture's default",
    )
    for key, example in (("rope_theta", "10000.0"), ("norm_eps", "1e-5")):
        _rule(
            getattr(m, key) > 0,
            f"model.{key}",
            getattr(m, key),
            "must be > 0 (0 or less makes the loss NaN)",
            f"use e.g. model.{key}={example}",
        )
    _rule(
        m.init_method_std >= 0,
        "model.init_method_std",
        m.init_method_std,
        "must be >= 0",
        "use e.g. 0.02",
    )
    _rule(
        m.vocab_size is None or m.vocab_size >= 1,
        "model.vocab_size",
        m.vocab_size,
        "must be >= 1",
        "use the tokenizer's vocabulary size or null",
    )


def _validate_architecture(cfg: Config) -> None:
    """What `model.arch`'s registry entry asks: no experts without an MoE part, then its own
    rules (e.g. llama's even head dim for RoPE)."""
    m = cfg.model
    spec = get_architecture(m.arch)
    _rule(
        m.num_experts is None or spec.moe is not None,
        "model.num_experts",
        m.num_experts,
        f"model.arch={m.arch} has no MoE part (its registry entry's moe is None)",
        "set model.num_experts=null, or use an architecture with MoE layers "
        f"({', '.join(n for n in architecture_names() if get_architecture(n).moe is not None)})",
    )
    if spec.validate is not None:
        spec.validate(cfg)


def _validate_train_ranges(cfg: Config) -> None:
    """Training, logging and data value ranges that would otherwise fail after process groups
    exist."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    _rule(
        t.global_batch_size >= 1,
        "train.global_batch_size",
        t.global_batch_size,
        "must be >= 1",
        "use a positive multiple of micro_batch_size·dp",
    )
    _rule(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 = off)", "use 1.0")
    _rule(
        t.skip_nonfinite_steps >= 0,
        "train.skip_nonfinite_steps",
        t.skip_nonfinite_steps,
        "must be >= 0 (0 = stop at the first NaN/Inf step)",
        "use 0, or the number of non-finite steps in a row to skip before stopping",
    )
    _rule(
        cfg.log.interval >= 1,
        "log.interval",
        cfg.log.interval,
        "must be >= 1",
        "print every N >= 1 steps",
    )
    _rule(
        cfg.log.memory_steps >= 0,
        "log.memory_steps",
        cfg.log.memory_steps,
        "must be >= 0",
        "measure the run's first N >= 0 steps (0: none)",
    )
    _rule(
        d.tokenizer_vocab_size >= 1,
        "data.tokenizer_vocab_size",
        d.tokenizer_vocab_size,
        "must be >= 1",
        "use e.g. 4096",
    )
    _timeout("parallel.timeout_s", p.timeout_s, "use e.g. 300")
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
