"""The data-parallel part of the step time: gradient reduction and weight gathers per ZeRO
stage (with hybrid sharding, the shards' all-reduce across replicas), what the backward and
the next forward hide of them, and the whole-matrix optimizer step (Muon). Recorded in the
step's communication budget (plan/budget.py) under DP."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.parallel.data_parallel.optimizer_spec import get_optimizer
from megatron_lite.plan.budget import Budget
from megatron_lite.plan.comm import collective_time
from megatron_lite.plan.optimizer_states import owner_step, rank_splits
from megatron_lite.plan.params import optimizer_settings, rank_params
from megatron_lite.plan.peak import fp8_gathered_elements


def whole_matrix_step(r: Config, node, links, rate: float) -> float:
    """Exposed seconds of the whole-matrix groups' optimizer step (Muon, whole_matrix.py and
    fsdp_whole_matrix.py), on the busiest pipeline rank: the most-loaded owner's update FLOPs
    at the compute rate, its TP gathers (in the NS dtype), then ZeRO-1/2's broadcasts of every
    whole parameter from its owner (nothing overlaps them: the step waits), or ZeRO-3's two
    fp32 all-gathers to the owner and the broadcast back."""
    p = r.parallel
    if get_optimizer(r.train.optimizer).elementwise:
        return 0.0
    hyper = optimizer_settings(r)[1]
    ns = 2 if hyper.get("ns_dtype") == "bf16" else 4  # what the update gathers over TP
    worst = 0.0
    for rank in range(p.pp):
        cost, gathered, whole = owner_step(r, rank)
        if not whole:
            continue
        t = cost / rate
        t += collective_time("all_gather", ns * gathered * p.tp, p.tp, links["tp"], node)
        n, w = p.dp * p.cp, 2 if r.train.precision == "bf16" else 4
        if p.zero_stage in (1, 2):
            t += collective_time("broadcast", w * whole, n, links["dp_cp"], node)
        elif p.zero_stage == 3:
            n = p.dp_shard or n
            t += 2 * collective_time("all_gather", 4 * whole, n, links["dp_cp"], node)
            t += collective_time("broadcast", 4 * whole, n, links["dp_cp"], node)
        worst = max(worst, t)
    return worst


def dp_time(r: Config, links, m: int, t_fwd: float, layers: int, budget: Budget):
    """(exposed, hidden) seconds of the data-parallel gradient and weight traffic per step,
    recorded in `budget` (group DP; the experts' as "DP experts")."""
    p, prec = r.parallel, r.train.precision
    dense, expert = rank_params(r, 0)
    w_bytes = 2 if prec == "bf16" else 4
    g_bytes = 2 if p.grad_reduce_dtype == "bf16" else 4
    # whole-matrix groups' parameters (Muon's) are all-reduced whole under ZeRO-1/2 and sent
    # from their owners in the optimizer step (whole_matrix_step), not all-gathered here
    whole = (0, 0)
    if p.zero_stage in (1, 2) and not get_optimizer(r.train.optimizer).elementwise:
        whole = tuple(s.whole for s in rank_splits(r, 0)[:2])
    exposed = hidden = 0.0
    fp8_dense = fp8_gathered_elements(r, 0)  # ZeRO-3 gathers these in 1 byte each
    for count, own, full, name, label, fp8 in (
        (dense, whole[0], p.dp * p.cp, "dp_cp", "DP", fp8_dense),
        (expert, whole[1], p.dp * p.cp // p.ep, "edp", "DP experts", 0),
    ):
        if not count or full <= 1:
            continue
        n = min(p.dp_shard or full, full)  # the flat shards' group (whole parameters: full)
        hybrid = n < full
        link = links[f"{name}_shard"] if hybrid else links[name]
        last = min(1.0, p.ddp_bucket_size / count)  # the last bucket's share
        # ZeRO-2 reduce-scatters every microbatch (buffers.py), ZeRO-3 too under
        # zero3_grad_reduce=microbatch (fsdp.py; with HSDP the replicas' all-reduce follows
        # each): the earlier ones hide behind their own backward and the next forward, the
        # last one as ZeRO-1's
        per_mb = p.zero_stage == 3 and p.zero3_grad_reduce == "microbatch"
        earlier = m - 1 if p.zero_stage == 2 or per_mb else 0
        gather = 0.0
        if p.zero_stage == 0:
            reduce = budget.add("DP", "all_reduce", g_bytes * count, n, link, 1, label)
        elif p.zero_stage in (1, 2):
            flat = count - own
            rs = budget.add("DP", "reduce_scatter", g_bytes * flat, n, link, 1 + earlier, label)
            reduce = rs if flat else 0.0
            gather = budget.add("DP", "all_gather", w_bytes * flat, n, link, 1, label)
            if own:
                ar = budget.add("DP", "all_reduce", g_bytes * own, full, links[name], 1, label)
                reduce += ar
        else:
            reduce = budget.add("DP", "reduce_scatter", g_bytes * count, n, link, 1 + earlier,
                                label)  # fmt: skip
            gathered = w_bytes * count - (w_bytes - 1) * fp8
            gather = 2 * m * budget.add("DP", "all_gather", gathered, n, link, 2 * m,
                                        label)  # fmt: skip
            last = 1.0 / max(layers, 1)
        rep = 0.0
        reps = 1 + earlier if per_mb else 1
        if hybrid:  # the shard's all-reduce across the replicas, once per step (or reduction)
            flat = count - own if p.zero_stage in (1, 2) else count
            rep = budget.add("DP", "all_reduce", g_bytes * flat / n, full // n,
                             links[f"{name}_replica"], reps, label)  # fmt: skip
        if not p.overlap_grad_reduce:
            exposed += (1 + earlier) * reduce + reps * rep + gather
            continue
        window_b = 2 * t_fwd * layers  # the last microbatch's backward
        window_f = t_fwd * layers * (m if p.zero_stage == 3 else 1)
        final = reduce + rep  # the last microbatch's reduction, then the replicas'
        e = max(final * last, final - window_b) + max(gather * last, gather - window_f)
        each = reduce + (rep if per_mb else 0.0)  # an earlier microbatch's reductions
        e += earlier * max(0.0, each - window_b - t_fwd * layers)
        exposed += e
        hidden += (1 + earlier) * reduce + reps * rep + gather - e
    budget.expose("DP", exposed)
    return exposed, hidden
