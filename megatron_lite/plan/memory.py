"""Per-rank memory of a layout at its peak: the terms of the largest moment of the rank's
schedule (plan/peak.py: model states, activations by schedule, embedding/logits/loss, and the
working sets that exist only during part of a step), and the model-state bound the trainer
reports (`model_states`, parallel/data_parallel/memory.py's ZeRO table)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.memory import TERMS, formula_bytes, zero2_in_flight
from megatron_lite.parallel.data_parallel.optimizer_spec import get_optimizer
from megatron_lite.pipeline.registry import in_flight
from megatron_lite.plan.activations import layer_bytes, layer_shape, resolved
from megatron_lite.plan.optimizer_states import split_states
from megatron_lite.plan.params import largest_params, rank_params
from megatron_lite.plan.peak import peak_moment, saved_peak
from megatron_lite.resolve import moe_layer_pattern, num_microbatches


def model_states(cfg: Config, pp_rank: int) -> dict[str, float]:
    """{weights, grads, master, optimizer} bytes on this rank as the trainer's mem/* reports
    them (DataParallelWrapper.memory(): --measure compares the two): memory.formula_bytes for
    the dense parameters sharded over dp·cp (or dp_shard) and the experts over dp·cp/ep, with
    the transient gradients' bound: ZeRO-2's buckets in flight (two per reduction group, over
    all model chunks), ZeRO-3's unsharded gradients under gradient accumulation. The peak's
    own are rank_memory's (plan/peak.py). The optimizer's state bytes: train.optimizer's spec
    (one whose groups differ: plan/optimizer_states.py)."""
    p = cfg.parallel
    if not get_optimizer(cfg.train.optimizer).elementwise:  # groups stepped whole or flat
        return split_states(cfg, pp_rank, transient=True)
    dense, expert = rank_params(cfg, pp_rank)
    n_dense = p.dp_shard or p.dp * p.cp
    n_expert = p.dp_shard or max(p.dp * p.cp // p.ep, 1)
    extra = dict(
        # (zero3_grad_reduce=microbatch keeps no unsharded gradients between microbatches)
        microbatches=num_microbatches(cfg.train, p.dp) if p.zero3_grad_reduce == "step" else 1,
        reduce_bytes=2 if p.grad_reduce_dtype == "bf16" else 4,
        optimizer=get_optimizer(cfg.train.optimizer),
    )
    out = dict.fromkeys(TERMS, 0.0)
    for count, n, largest in zip(
        (dense, expert), (n_dense, n_expert), largest_params(cfg, pp_rank), strict=True
    ):
        if count:
            in_flight = zero2_in_flight(count, p.ddp_bucket_size, largest)
            terms = formula_bytes(
                count, cfg.train.precision, p.zero_stage, n, in_flight=in_flight, **extra
            )
            for k, v in terms.items():
                out[k] += v
    return out


@dataclass
class RankMemory:
    """One pipeline rank's memory by term (bytes) at the moment of its peak, and what produced
    it."""

    pp_rank: int
    terms: dict[str, float]
    in_flight: int  # (microbatch, chunk) pairs held at the peak
    per_layer: dict[str, float] = field(default_factory=dict)  # one layer, one microbatch
    phase: str = ""  # where in the step the peak is (plan/peak.py): forward, backward, ...

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def rank_memory(cfg: Config, world: int, pp_rank: int, kernels: str = "fused") -> RankMemory:
    """Memory of pipeline rank `pp_rank` (the largest over its TP/DP/CP ranks) at its peak:
    the largest moment of plan/peak.py's walk of its schedule."""
    r = resolved(cfg, world)
    p = r.parallel
    shape = layer_shape(r, kernels)
    held = in_flight(p.pp, p.vpp, num_microbatches(r.train, p.dp), pp_rank, p.pipeline_schedule)
    best = peak_moment(r, pp_rank, kernels)
    moe = bool(r.model.num_experts)  # the table shows an MoE layer where every layer is one
    per_layer = layer_bytes(r, shape, moe and all(moe_layer_pattern(r.model)))
    terms = _offloaded(r, pp_rank, best.terms, kernels)
    return RankMemory(pp_rank, terms, held, per_layer, best.phase)


def peak_bytes(cfg: Config, world: int, pp_rank: int, kernels: str = "fused") -> float:
    """rank_memory(...).total alone (what the search ranks by)."""
    r = resolved(cfg, world)
    return sum(_offloaded(r, pp_rank, peak_moment(r, pp_rank, kernels).terms, kernels).values())


def _offloaded(r: Config, pp_rank: int, terms: dict[str, float], kernels: str) -> dict:
    """`terms` less what model.activation_offload keeps on the host at the peak
    (plan/activation_offload.py: the most offloaded layers held at once, walking the
    schedule table, times one layer's measured bytes; the dry run agrees within 1%)."""
    if not r.model.activation_offload:
        return terms
    from megatron_lite.plan.activation_offload import stage_offload

    saved = stage_offload(r, pp_rank, 0.0, 1.0, kernels=kernels).device_bytes_saved
    return {**terms, "activations": max(terms["activations"] - saved, 0.0)}


def plan_memory(cfg: Config, world: int, kernels: str = "fused") -> list[RankMemory]:
    """Every pipeline rank's memory (index = pp rank)."""
    return [rank_memory(cfg, world, r, kernels) for r in range(cfg.parallel.pp)]


def saved_activations(cfg: Config, world: int, pp_rank: int, kernels: str = "fused") -> float:
    """The most bytes pipeline rank `pp_rank` saves for backward at once (plan/peak.py
    saved_peak): what a SavedTensorMeter measures, without the working sets of rank_memory's
    peak moment."""
    return saved_peak(resolved(cfg, world), pp_rank, kernels)
