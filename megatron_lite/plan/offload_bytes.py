"""Where the optimizer's fp32 masters and states live per rank under train.optimizer_offload
(none | cpu | nvme, parallel/data_parallel/nvme.py, docs/offload.md): device, host and NVMe
bytes, from the planner's parameter counts (plan/params.py).

With E the elements this rank steps (its dense parameters over dp·cp, or dp_shard, and its
experts over dp·cp/ep; ZeRO-0: all of them) and K the optimizer's state bytes per element
(AdamW: 8):
- none: the states on the device, E·K, and the masters E·4 where the weights are bf16 (fp32
  weights are their own masters);
- cpu: E·(4 + K) in pinned host memory (the masters are copies even of fp32 weights);
- nvme: E·(4 + K) in the swap file, the host buffer (train.nvme_buffer_mb) in memory.
`min_buffer` is the largest parameter's E·(4 + K): the buffer must hold the largest piece
(parameter ∩ shard), at most that (the build checks the exact figure). ZeRO-3 refuses offload.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.optimizer_spec import get_optimizer
from megatron_lite.plan.params import largest_params, rank_params


@dataclass(frozen=True)
class OffloadBytes:
    """One rank's fp32 masters and optimizer states by where they are, in bytes."""

    device: float
    host: float
    nvme: float
    min_buffer: int  # nvme: the largest parameter's master and states


def offload_bytes(cfg: Config, pp_rank: int = 0) -> OffloadBytes:
    """The module docstring's figures for pipeline rank `pp_rank` of a resolved config."""
    p, t = cfg.parallel, cfg.train
    k = get_optimizer(t.optimizer).state_bytes
    dense, expert = rank_params(cfg, pp_rank)
    if p.zero_stage >= 1:
        dense = dense / (p.dp_shard or p.dp * p.cp)
        expert = expert / (p.dp_shard or max(p.dp * p.cp // p.ep, 1))
    elements = dense + expert
    largest = max(largest_params(cfg, pp_rank)) * (4 + k)
    if t.optimizer_offload == "cpu":
        return OffloadBytes(0.0, elements * (4 + k), 0.0, largest)
    if t.optimizer_offload == "nvme":
        return OffloadBytes(0.0, float(t.nvme_buffer_mb << 20), elements * (4 + k), largest)
    master = 4 if t.precision == "bf16" else 0
    return OffloadBytes(elements * (k + master), 0.0, 0.0, largest)


def describe(cfg: Config, pp_rank: int = 0) -> str:
    """One report line: where the masters and optimizer states are, per rank."""
    b, gib = offload_bytes(cfg, pp_rank), 2**30
    line = (
        f"optimizer states ({cfg.train.optimizer_offload} offload): device {b.device / gib:.2f} "
        f"GiB, host {b.host / gib:.2f} GiB, NVMe {b.nvme / gib:.2f} GiB per rank"
    )
    if cfg.train.optimizer_offload == "nvme":
        line += f" (the buffer must hold >= {b.min_buffer / 2**20:.0f} MiB)"
    return line
