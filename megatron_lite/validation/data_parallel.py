"""Data-parallel rules: ZeRO stage, AdamW's numbers, hybrid sharding degree, buckets, reduce
dtype, offload. The rules are those of the Python API (parallel/data_parallel/rules.py, which
`build_data_parallel` checks its arguments with); here they are mapped onto the config's keys,
so each message names the key and a fix in the config's terms."""

from __future__ import annotations

from megatron_lite.config import Config, ConfigError, TrainConfig
from megatron_lite.parallel.data_parallel import rules
from megatron_lite.parallel.data_parallel.optimizer_spec import (
    NAMED_HYPERPARAMETERS,
    get_optimizer,
    optimizer_names,
)
from megatron_lite.validation.rules import _choice, _no_effect, _rule


def _check(problem: str | None, key: str, value, fix: str) -> None:
    """`problem` (a rules.py function's answer for `value`) as a ConfigError naming `key`."""
    _rule(problem is None, key, value, problem or "", fix)


def _validate_data_parallel(cfg: Config) -> None:
    """On the resolved config (parallel.dp filled in)."""
    p, t = cfg.parallel, cfg.train
    _check(rules.zero_stage(p.zero_stage), "parallel.zero_stage", p.zero_stage, "use 0, 1, 2 or 3")
    _choice("parallel.grad_reduce_dtype", p.grad_reduce_dtype, tuple(rules.REDUCE_DTYPES))
    _choice("parallel.zero3_grad_reduce", p.zero3_grad_reduce, ("step", "microbatch"))
    _choice("train.optimizer_offload", t.optimizer_offload, ("none", "cpu", "nvme"))
    if t.optimizer_offload == "nvme":
        _validate_nvme(cfg)
    _validate_optimizer(cfg)
    if p.zero_stage == 3:
        _validate_zero3(cfg)
    _check(
        rules.bucket_size(p.ddp_bucket_size),
        "parallel.ddp_bucket_size",
        p.ddp_bucket_size,
        "use e.g. 40000000 (Megatron's default)",
    )
    _validate_adamw(t)
    _validate_dp_shard(cfg)


def _validate_nvme(cfg: Config) -> None:
    """NVMe offload: stages 0-2, a path given, a buffer size (whether the largest piece fits
    it is checked when the pieces exist, ddp.py; whether the path exists and is writable on
    the machine the ranks run on: `check_nvme_path`)."""
    t = cfg.train
    _check(
        rules.offload("nvme", cfg.parallel.zero_stage),
        "train.optimizer_offload",
        t.optimizer_offload,
        "set parallel.zero_stage=1 or 2 (or train.optimizer_offload=none)",
    )
    _rule(
        isinstance(t.nvme_path, str) and bool(t.nvme_path),
        "train.nvme_path",
        t.nvme_path,
        "must name a directory for the swap files (train.optimizer_offload=nvme needs one)",
        "set train.nvme_path to an existing directory you can write, on a fast local disk",
    )
    fix = "use e.g. 1024 (MiB; at least the largest parameter's fp32 master and states)"
    _check(rules.nvme_buffer_mb(t.nvme_buffer_mb), "train.nvme_buffer_mb", t.nvme_buffer_mb, fix)


def check_nvme_path(cfg: Config) -> None:
    """train.optimizer_offload=nvme: train.nvme_path exists, is a directory and is writable
    here (a machine rule, validation/backends.check_hardware: a login node can validate a job
    whose drive it does not have)."""
    t = cfg.train
    if t.optimizer_offload != "nvme":
        return
    _check(
        rules.nvme_path(t.nvme_path),
        "train.nvme_path",
        t.nvme_path,
        "set train.nvme_path to an existing directory you can write, on a fast local disk",
    )


def _validate_optimizer(cfg: Config) -> None:
    """train.optimizer names a registered spec; one needing whole matrices runs without
    offload (whole_matrix.py, fsdp_whole_matrix.py)."""
    t = cfg.train
    names = optimizer_names()
    _rule(
        t.optimizer in names,
        "train.optimizer",
        t.optimizer,
        f"must be a registered optimizer: one of {', '.join(names)}",
        "set train.optimizer to one of them (register_optimizer adds one)",
    )
    spec = get_optimizer(t.optimizer)
    _rule(
        t.weight_decay == 0 or "weight_decay" in spec.hyperparameters,
        "train.weight_decay",
        t.weight_decay,
        f"train.optimizer={t.optimizer} has no weight decay (its hyperparameters: "
        f"{', '.join(spec.hyperparameters)})",
        "set train.weight_decay=0",
    )
    for name in t.optimizer_args:
        own = name in spec.hyperparameters and name not in NAMED_HYPERPARAMETERS
        _rule(
            own,
            "train.optimizer_args",
            t.optimizer_args,
            f"{name!r} is not one of train.optimizer={t.optimizer}'s own hyperparameters "
            f"({', '.join(h for h in spec.hyperparameters if h not in NAMED_HYPERPARAMETERS)})",
            "remove it (lr, betas, eps and weight decay have keys of their own: train.lr, "
            "train.adam_beta1/2, train.adam_eps, train.weight_decay)",
        )
    if t.optimizer == "muon":
        _validate_muon(t)
    if spec.elementwise:
        return
    why = "its update needs whole matrices, stepped on the device by their owner ranks"
    _rule(t.optimizer_offload == "none", "train.optimizer_offload", t.optimizer_offload,
          f"train.optimizer={t.optimizer}: {why}", "set train.optimizer_offload=none")  # fmt: skip


def _validate_muon(t: TrainConfig) -> None:
    """The train.muon_* keys, by the muon spec's own rule (data_parallel/muon.py), named by
    their keys."""
    from megatron_lite.parallel.data_parallel import muon_spec as muon

    _rule(1 <= t.muon_ns_steps <= 99, "train.muon_ns_steps", t.muon_ns_steps,
          "must be a whole number from 1 to 99 (Newton-Schulz iterations)",
          "use 5 (torch.optim.Muon's default)")  # fmt: skip
    _rule(0 <= t.muon_momentum < 1, "train.muon_momentum", t.muon_momentum,
          "must be in [0, 1)", "use 0.95 (the default)")  # fmt: skip
    _choice("train.muon_ns_dtype", t.muon_ns_dtype, ("bf16", "fp32"))
    _choice("train.muon_adjust_lr", t.muon_adjust_lr, ("match_rms_adamw", "original"))
    if t.muon_lr is not None:
        _check(rules.positive_fp32(t.muon_lr), "train.muon_lr", t.muon_lr,
               "use e.g. 0.02, or null for train.lr")  # fmt: skip
    fix = "list groups, e.g. [attention, mlp, experts, hidden]; or train.optimizer=adamw"
    _rule(bool(t.muon_params), "train.muon_params", t.muon_params,
          "is empty: Muon would step no parameter (an AdamW run)", fix)  # fmt: skip
    for kind in t.muon_params:
        _rule(kind not in muon.VECTOR_KINDS, "train.muon_params", t.muon_params,
              f"{kind!r} parameters are not 2-D matrices (Muon orthogonalizes matrices)",
              f"remove {kind!r}: AdamW steps it")  # fmt: skip
        _rule(kind in muon.MATRIX_KINDS, "train.muon_params", t.muon_params,
              f"{kind!r} is not a parameter group (groups: {', '.join(muon.MATRIX_KINDS)})",
              "use groups from that list")  # fmt: skip
    try:  # anything left to the spec's own rule, named by its key
        muon.check_hyperparameters({**muon.MUON.hyperparameters, **muon.config_arguments(t)})
    except muon.HyperparameterError as e:
        key = next((k for k, v in muon.CONFIG_KEYS.items() if v == e.name), "optimizer")
        raise ConfigError(f"train.{key}: {e}") from e


def _validate_adamw(t: TrainConfig) -> None:
    """AdamW's numbers, in fp32 as the optimizer holds them (train.lr is the schedule's peak)."""
    for key, example in (("lr", "3e-4"), ("adam_eps", "1e-8")):
        value = getattr(t, key)
        _check(rules.positive_fp32(value), f"train.{key}", value, f"use e.g. {example}")
    for key, example in (("adam_beta1", "0.9"), ("adam_beta2", "0.95")):
        value = getattr(t, key)
        _check(rules.beta(value), f"train.{key}", value, f"use e.g. {example}")
    _check(
        rules.weight_decay(t.weight_decay, t.lr),
        "train.weight_decay",
        t.weight_decay,
        "use e.g. 0.1 (0 for none), with train.lr·train.weight_decay < 1",
    )


def _validate_dp_shard(cfg: Config) -> None:
    """Hybrid sharding: a positive degree, a sharding stage, a divisor of each group it
    shards (dense: dp·cp; experts: dp·cp/ep)."""
    p = cfg.parallel
    if p.dp_shard is None:
        return
    key, group = "parallel.dp_shard", p.dp * p.cp
    _check(rules.dp_shard_value(p.dp_shard), key, p.dp_shard, f"use a divisor of {group}")
    _check(
        rules.dp_shard_stage(p.dp_shard, p.zero_stage),
        key,
        p.dp_shard,
        "set parallel.zero_stage=1, 2 or 3, or parallel.dp_shard=null",
    )
    dense = {f"the gradient's reduction group dp·cp = {p.dp}·{p.cp}": group}
    _check(
        rules.dp_shard_divides(p.dp_shard, dense),
        key,
        p.dp_shard,
        f"use a divisor of {group}, or null for the whole group",
    )
    if cfg.model.num_experts is not None:
        edp = group // p.ep
        experts = {f"the experts' reduction group dp·cp/ep = {group}/{p.ep}": edp}
        _check(
            rules.dp_shard_divides(p.dp_shard, experts), key, p.dp_shard, f"use a divisor of {edp}"
        )


def _validate_zero3(cfg: Config) -> None:
    """What FSDP2 (parallel/data_parallel/fsdp.py) does not compose with, and whether this
    torch's FSDP2 still has the shape stage 3 uses (fsdp_compat.py)."""
    from megatron_lite.parallel.data_parallel.fsdp_compat import FSDP2APIError, check_fsdp2

    try:
        check_fsdp2()
    except FSDP2APIError as e:
        raise ConfigError(str(e)) from e
    t, m = cfg.train, cfg.model
    _check(
        rules.offload(t.optimizer_offload != "none", 3),
        "train.optimizer_offload",
        t.optimizer_offload,
        "set train.optimizer_offload=none, or parallel.zero_stage=1 or 2",
    )
    _rule(
        m.linear_backend == "local",
        "model.linear_backend",
        m.linear_backend,
        "parallel.zero_stage=3 needs the local GEMM: a Transformer Engine GEMM keeps the "
        "parameter it was built with, which FSDP2 replaces by its sharded copy",
        "set model.linear_backend=local, or parallel.zero_stage=1 or 2",
    )


# AdamW's config keys -> the hyperparameter each feeds (training/optimizer.py)
ADAM_KEYS = {"adam_beta1": "betas", "adam_beta2": "betas", "adam_eps": "eps"}


def optimizer_warnings(cfg: Config) -> list[str]:
    """adam_* keys set to other than their defaults where train.optimizer has no such
    hyperparameter (they reach only an optimizer with betas / eps)."""
    t = cfg.train
    if t.optimizer not in optimizer_names():
        return []  # its own rule reports it
    return _adam_muon_warnings(t) + nvme_warnings(t)


def nvme_warnings(t: TrainConfig) -> list[str]:
    """train.nvme_* set without train.optimizer_offload=nvme: a warning (they do nothing), as
    for the other keys of an unused feature."""
    default = TrainConfig()
    return [
        _no_effect(
            f"train.{key}",
            getattr(t, key),
            f"train.optimizer_offload={t.optimizer_offload}",
            "set train.optimizer_offload=nvme, or remove the key",
        )  # fmt: skip
        for key in ("nvme_path", "nvme_buffer_mb")
        if t.optimizer_offload != "nvme" and getattr(t, key) != getattr(default, key)
    ]


def _adam_muon_warnings(t: TrainConfig) -> list[str]:
    own, default = get_optimizer(t.optimizer).hyperparameters, TrainConfig()
    return [
        _no_effect(
            f"train.{key}",
            getattr(t, key),
            f"train.optimizer={t.optimizer} has no hyperparameter {name}",
            "remove the key (or use an optimizer that has it)",
        )
        for key, name in ADAM_KEYS.items()
        if name not in own and getattr(t, key) != getattr(default, key)
    ] + [
        _no_effect(
            f"train.{key}",
            getattr(t, key),
            f"train.optimizer={t.optimizer}",
            "set train.optimizer=muon, or remove the key",
        )  # fmt: skip
        for key in (*MUON_CONFIG_KEYS, "muon_params")
        if t.optimizer != "muon" and getattr(t, key) != getattr(default, key)
    ]


MUON_CONFIG_KEYS = ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_dtype",
                    "muon_adjust_lr", "muon_split_fused", "muon_lr")  # fmt: skip
