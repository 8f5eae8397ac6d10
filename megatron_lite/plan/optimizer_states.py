"""The optimizer's share of a rank's model states when its parameter groups differ (an
`OptimizerSpec` that is not elementwise, e.g. train.optimizer=muon): which of the rank's
parameters each group steps, with that group's state bytes, and, for the groups that need
whole matrices, how many elements the most-loaded owner rank holds.

Read off the real modules' parameters on the meta device (plan/modules.py: names, TP-local
shapes and ParamMeta), put through the spec's groups rule and its `cost` (plan/params.py
`optimizer_rows`), and assigned to
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
from megatron_lite.parallel.data_parallel.whole_matrix import owner_table
from megatron_lite.plan import modules
from megatron_lite.plan.params import optimizer_rows
from megatron_lite.resolve import num_microbatches


def rank_splits(cfg: Config, pp_rank: int) -> tuple[GroupSplit, GroupSplit, int, int]:
    """(dense, expert) GroupSplits of the pipeline rank (the most-loaded owner's share of the
    whole-matrix parameters under ZeRO >= 1; ZeRO-0: all of them), and the largest parameter
    of the flat groups of each (ZeRO-2's bucket bound)."""
    return modules.per_config(cfg, ("rank_splits", pp_rank), lambda: _splits(cfg, pp_rank))


def _splits(cfg: Config, pp_rank: int) -> tuple[GroupSplit, GroupSplit, int, int]:
    p = cfg.parallel
    # each chunk's rows reversed: the gradient buffers' order, owner_table's ties
    rows = [r for c in range(p.vpp) for r in reversed(optimizer_rows(cfg, pp_rank, c))]
    out = []
    for expert, n in ((False, p.dp * p.cp), (True, max(p.dp * p.cp // p.ep, 1))):
        # owners over the whole reduction group (ZeRO-1/2), FSDP2's sharding group (ZeRO-3)
        n = (p.dp_shard or n) if p.zero_stage == 3 else n
        mine = [r for r in rows if r.is_expert == expert]
        flat = [r for r in mine if not r.whole]
        whole = [r for r in mine if r.whole]
        owners = [0] * len(whole)
        if p.zero_stage >= 1 and n > 1:
            owners = owner_table(whole, n, lambda r: r.cost)
        loads = [[0, 0] for _ in range(max(owners, default=0) + 1)]  # [state bytes, elements]
        for r, k in zip(whole, owners, strict=True):
            loads[k][0] += r.state_bytes * r.elements
            loads[k][1] += r.elements
        state, owned = max(loads, default=[0, 0])
        split = GroupSplit(
            flat=sum(r.elements for r in flat),
            flat_state=sum(r.state_bytes * r.elements for r in flat),
            whole=sum(r.elements for r in whole),
            owned=owned,
            owned_state=state,
        )
        out.append((split, max((r.elements for r in flat), default=0)))
    (dense, dense_largest), (experts, expert_largest) = out
    return dense, experts, dense_largest, expert_largest


def owner_step(cfg: Config, pp_rank: int) -> tuple[float, int, int]:
    """The whole-matrix groups' optimizer step on the pipeline rank's most-loaded owner, summed
    over its dense and expert groups (they step one after the other): (its update cost, the
    spec's FLOPs: Muon's Newton–Schulz on whole logical matrices, every TP rank of the owner
    computing it; the TP-local elements of its TP-sharded parameters, whose shards it
    gathers; the elements of every whole-matrix parameter of the rank, which the owners
    broadcast). ZeRO-0: every rank steps all of them."""
    return modules.per_config(cfg, ("owner_step", pp_rank), lambda: _owner_step(cfg, pp_rank))


def _owner_step(cfg: Config, pp_rank: int) -> tuple[float, int, int]:
    p = cfg.parallel
    rows = [r for c in range(p.vpp) for r in reversed(optimizer_rows(cfg, pp_rank, c))]
    cost = gathered = whole_elements = 0
    for expert, n in ((False, p.dp * p.cp), (True, max(p.dp * p.cp // p.ep, 1))):
        n = (p.dp_shard or n) if p.zero_stage == 3 else n
        whole = [r for r in rows if r.whole and r.is_expert == expert]
        owners = owner_table(whole, n, lambda r: r.cost) if p.zero_stage >= 1 else [0] * len(whole)
        loads = [[0.0, 0] for _ in range(max(owners, default=0) + 1)]  # [cost, gathered]
        for r, k in zip(whole, owners, strict=True):
            loads[k][0] += r.cost
            loads[k][1] += r.elements if r.tp_sharded else 0
        top = max(loads, default=[0.0, 0])
        cost, gathered = cost + top[0], gathered + top[1]
        whole_elements += sum(r.elements for r in whole)
    return cost, gathered, whole_elements


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
                # (zero3_grad_reduce=microbatch: no unsharded gradients between microbatches)
                microbatches=num_microbatches(cfg.train, p.dp)
                if p.zero3_grad_reduce == "step"
                else 1,
                reduce_bytes=2 if p.grad_reduce_dtype == "bf16" else 4,
            )
        terms = split_formula_bytes(split, cfg.train.precision, p.zero_stage, n, **extra)
        for k, v in terms.items():
            out[k] += v
    if p.zero_stage == 3 and not transient:  # (the grads exist from the reduce to the step)
        out["grads"] = 0.0
    return out
