"""The optimizer's share of a rank's model states when its parameter groups differ (an
`OptimizerSpec` that is not elementwise, e.g. train.optimizer=muon): which of the rank's
parameters each group steps, with that group's state bytes, and, for the groups that need
whole matrices, how many elements the most-loaded owner rank holds.

Read off the real modules' parameters on the meta device (plan/modules.py: names, TP-local
shapes and ParamMeta), put through the spec's groups rule and its `cost`, and assigned to
owners by the trainer's own rule (parallel/data_parallel/whole_matrix.owner_table, over all
the rank's chunks per reduction group, in the gradient buffers' order: each chunk's parameters
reversed). The figure is the owner with the most state bytes: the planner's rank is the
largest of its data-parallel peers.
"""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.memory import (
    TERMS,
    GroupSplit,
    split_formula_bytes,
    zero2_in_flight,
)
from megatron_lite.parallel.data_parallel.optimizer_spec import group_index
from megatron_lite.parallel.data_parallel.whole_matrix import owner_table
from megatron_lite.parallel.params import meta_of
from megatron_lite.plan import modules
from megatron_lite.plan.params import named_rank_params, optimizer_settings
from megatron_lite.resolve import num_microbatches


def rank_splits(cfg: Config, pp_rank: int) -> tuple[GroupSplit, GroupSplit, int, int]:
    """(dense, expert) GroupSplits of the pipeline rank (the most-loaded owner's share of the
    whole-matrix parameters under ZeRO >= 1; ZeRO-0: all of them), and the largest parameter
    of the flat groups of each (ZeRO-2's bucket bound)."""
    return modules.per_config(cfg, ("rank_splits", pp_rank), lambda: _splits(cfg, pp_rank))


def _splits(cfg: Config, pp_rank: int) -> tuple[GroupSplit, GroupSplit, int, int]:
    p = cfg.parallel
    spec, hyper = optimizer_settings(cfg)
    groups = spec.param_groups(hyper)
    cost = (lambda q: spec.cost(q, hyper)) if spec.cost else (lambda q: q.numel())
    out = []
    for expert, n in ((False, p.dp * p.cp), (True, max(p.dp * p.cp // p.ep, 1))):
        # owners over the whole reduction group (ZeRO-1/2), FSDP2's sharding group (ZeRO-3)
        n = (p.dp_shard or n) if p.zero_stage == 3 else n
        flat = flat_state = largest = 0
        whole = []  # (param, its state bytes per element), in the buffers' order
        for chunk in named_rank_params(cfg, pp_rank):
            for name, q in reversed(chunk):
                if meta_of(q).is_expert != expert:
                    continue
                g = groups[group_index(spec, groups, q, name)]
                if spec.group_elementwise(g):
                    flat, largest = flat + q.numel(), max(largest, q.numel())
                    flat_state += spec.group_state_bytes(g) * q.numel()
                else:
                    whole.append((q, spec.group_state_bytes(g)))
        owners = [0] * len(whole)
        if p.zero_stage >= 1 and n > 1:
            owners = owner_table([q for q, _ in whole], n, cost)
        loads = [[0, 0] for _ in range(max(owners, default=0) + 1)]  # [state bytes, elements]
        for (q, b), r in zip(whole, owners, strict=True):
            loads[r][0] += b * q.numel()
            loads[r][1] += q.numel()
        state, owned = max(loads, default=[0, 0])
        total = sum(q.numel() for q, _ in whole)
        out.append((GroupSplit(flat, flat_state, total, owned, state), largest))
    (dense, dense_largest), (experts, expert_largest) = out
    return dense, experts, dense_largest, expert_largest


def split_states(cfg: Config, pp_rank: int, transient: bool) -> dict[str, float]:
    """{weights, grads, master, optimizer} bytes of the pipeline rank under a spec whose
    groups differ (memory.split_formula_bytes over its dense and expert GroupSplits);
    `transient`: with the step's transient gradients (ZeRO-2's buckets in flight, ZeRO-3's
    unsharded and whole ones), as the trainer's memory report counts them."""
    p = cfg.parallel
    dense, experts, dense_largest, expert_largest = rank_splits(cfg, pp_rank)
    out = dict.fromkeys(TERMS, 0.0)
    for split, n, largest in (  # the flat groups' shards: over dp_shard under HSDP
        (dense, p.dp_shard or p.dp * p.cp, dense_largest),
        (experts, p.dp_shard or max(p.dp * p.cp // p.ep, 1), expert_largest),
    ):
        if not split.flat + split.whole:
            continue
        extra = {}
        if transient:
            extra = dict(
                in_flight=zero2_in_flight(split.flat, p.ddp_bucket_size, largest),
                microbatches=num_microbatches(cfg.train, p.dp),
                reduce_bytes=2 if p.grad_reduce_dtype == "bf16" else 4,
            )
        terms = split_formula_bytes(split, cfg.train.precision, p.zero_stage, n, **extra)
        for k, v in terms.items():
            out[k] += v
    if p.zero_stage == 3 and not transient:  # (the grads exist from the reduce to the step)
        out["grads"] = 0.0
    return out
