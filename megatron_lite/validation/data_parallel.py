"""Data-parallel rules: ZeRO stage, hybrid sharding degree, buckets, reduce dtype, offload."""

from __future__ import annotations

from megatron_lite.config import Config, ConfigError
from megatron_lite.validation.rules import _choice, _rule


def _validate_data_parallel(cfg: Config) -> None:
    """On the resolved config (parallel.dp filled in)."""
    p, t = cfg.parallel, cfg.train
    _rule(
        p.zero_stage in (0, 1, 2, 3),
        "parallel.zero_stage",
        p.zero_stage,
        "must be 0 (replicated optimizer), 1 (distributed optimizer), 2 (and sharded "
        "gradients) or 3 (and sharded parameters, torch FSDP2)",
        "use one of 0, 1, 2, 3",
    )
    if p.zero_stage == 3:
        _validate_zero3(cfg)
    _choice("parallel.grad_reduce_dtype", p.grad_reduce_dtype, ("fp32", "bf16"))
    _choice("train.optimizer_offload", t.optimizer_offload, ("none", "cpu"))
    _rule(
        p.ddp_bucket_size >= 1,
        "parallel.ddp_bucket_size",
        p.ddp_bucket_size,
        "must be >= 1 (parameters per gradient bucket)",
        "use e.g. 40000000 (Megatron's default)",
    )
    if p.dp_shard is None:
        return
    group = p.dp * p.cp
    _rule(
        p.zero_stage >= 1,
        "parallel.dp_shard",
        p.dp_shard,
        "hybrid sharding shards the optimizer, which parallel.zero_stage=0 replicates",
        "set parallel.zero_stage=1, 2 or 3, or parallel.dp_shard=null",
    )
    _rule(
        p.dp_shard >= 1 and group % p.dp_shard == 0,
        "parallel.dp_shard",
        p.dp_shard,
        f"must divide the gradient's reduction group dp·cp = {p.dp}·{p.cp} = {group}",
        f"use a divisor of {group}, or null for the whole group",
    )
    edp = group // p.ep
    _rule(
        edp % p.dp_shard == 0 or cfg.model.num_experts is None,
        "parallel.dp_shard",
        p.dp_shard,
        f"must divide the experts' reduction group dp·cp/ep = {edp}",
        f"use a divisor of {edp}",
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
    _rule(
        t.optimizer_offload == "none",
        "train.optimizer_offload",
        t.optimizer_offload,
        "optimizer offload is for parallel.zero_stage 0-2; stage 3 shards the optimizer "
        "states over the data-parallel ranks instead",
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
