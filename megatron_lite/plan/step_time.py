"""Predicted step time of a layout: compute at a stated fraction of peak, each group's ring
communication on the slowest link it crosses, what overlap hides, and the pipeline bubble.

Overlap model (what our code overlaps):
- TP: forward all-gathers / reduce-scatters (all-reduces without SP) are exposed; in backward the
  async linear re-gathers the input during the input-gradient GEMM and reduce-scatters the input
  gradient during the weight-gradient GEMM, so each hides up to half the layer's backward GEMMs.
- CP: Ulysses' all-to-alls (q, k, v in; the output back) over the cp_a2a group are exposed,
  in forward and backward (and a full recompute's rerun). The ring (context/ring.py) over
  cp_ring overlaps each K/V send with attention: per layer the forward's R−1 steps each expose
  max(0, send of one K/V block − that step's two chunk² sub-blocks of attention), the
  backward's R−1 steps max(0, K/V + dK/dV send − those sub-blocks' backward, 2.5× the
  forward's FLOPs), plus the last dK/dV send, which nothing overlaps (`cp_ring_exposed`).
- EP (MoE) all-to-alls are exposed: EP's dispatch and combine, T·u·k·h·A
  each, in forward, backward and a recompute's rerun, on the MoE layers (moe_layer_freq).
- PP: each send/receive batch costs its p2p time on the schedule's critical path (simulator).
  A schedule whose record splits the backward (the zero-bubble ones) runs it as B and W, W
  being the linear layers' weight-gradient GEMMs (a layer's forward GEMM time; the attention
  core has no weights), with posted batches; B then has no weight-gradient GEMM to hide the TP
  reduce-scatter of the input gradient behind, so that is exposed.
- DP: gradient buckets reduce during the last microbatch's backward, all but the last bucket
  hidden (ZeRO-2 reduce-scatters every microbatch: the earlier ones hide behind their backward
  and the next forward); the ZeRO-1/2 weight all-gather hides behind the next forward but the
  first bucket; ZeRO-3 gathers are prefetched behind compute, the first unit exposed. Off when
  parallel.overlap_grad_reduce=false.
Compute: hardware FLOPs (model FLOPs plus recompute) / (peak · mfu).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.context.ulysses import ulysses_kv_heads
from megatron_lite.pipeline.schedules import (
    get_schedule_spec,
    schedule_placement,
    splits_backward,
    virtual_stage,
)
from megatron_lite.plan.activations import layer_shape, recompute_settings, resolved
from megatron_lite.plan.budget import Budget
from megatron_lite.plan.comm import collective_time, group_links
from megatron_lite.plan.dp_comm import dp_time, whole_matrix_step
from megatron_lite.plan.hardware import as_node
from megatron_lite.plan.params import chunk_moe, rank_layers
from megatron_lite.resolve import (
    cp_a2a_size,
    moe_layer_pattern,
    mtp_moe_pattern,
    num_microbatches,
    stage_layers,
)
from megatron_lite.training.flops import model_flops_per_token


@dataclass
class StepTime:
    """Seconds per optimizer step by part; `exposed` parts add up to `total`."""

    compute: float  # busiest rank's forward+backward compute (recompute included)
    tp: float  # exposed
    cp: float
    ep: float
    pp: float
    dp: float
    bubble: float
    hidden: float  # communication overlap hides
    total: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    # the optimizer step of whole-matrix groups (Muon): the most-loaded owner's update FLOPs
    # and its TP gathers, and the owners' broadcasts (ZeRO-3: the gathers to the owners)
    optimizer: float = 0.0
    budget: Budget | None = None  # the communication budget per group (plan/budget.py)
    layer_forward: float = 0.0  # one layer's forward compute for one microbatch


def _pipeline(pp: int, vpp: int, m: int, weights: tuple, fwd: float, bwd: float, comm: float,
              simulate: bool, schedule: str | None = None,
              wgt: float | None = None) -> tuple[float, float, float]:  # fmt: skip
    """(busy time of the busiest rank, bubble, time the p2p adds) of the schedule with these
    per-layer costs (`wgt`: W's part of `bwd` for a zero-bubble schedule). Bubble: the
    simulator's makespan minus busy, or the closed form: (pp - 1) times the mean virtual
    stage's fill and drain, the schedule record's `bubble_fill` (F + B for 1F1B, F + B - 2W
    for ZB-H1; a record without one: always the simulator). P2P: every send/receive batch on
    the critical path (an upper bound)."""
    stages = rank_stages(pp, vpp, schedule)
    busy = max(m * sum(weights[s] for s in stages[r]) * (fwd + bwd) for r in range(pp))
    if pp == 1:
        return busy, 0.0, 0.0
    fill = get_schedule_spec(schedule, vpp).bubble_fill
    if not simulate and fill is not None:  # the record's closed form
        mean = sum(weights) / len(weights)
        return busy, (pp - 1) * mean * fill(fwd, bwd, wgt), 2 * m * vpp * comm
    no_comm = _simulated(pp, vpp, m, weights, fwd, bwd, 0.0, schedule, wgt)
    return busy, max(0.0, no_comm - busy), 2 * m * vpp * comm


@functools.lru_cache(maxsize=256)
def rank_stages(pp: int, vpp: int, schedule: str | None = None) -> tuple[tuple[int, ...], ...]:
    """The virtual stages each pipeline rank holds (index = pp rank), by the schedule's
    placement."""
    place = schedule_placement(schedule, vpp)
    return tuple(tuple(virtual_stage(r, c, pp, place) for c in range(vpp)) for r in range(pp))


@functools.lru_cache(maxsize=256)
def _simulated(pp, vpp, m, weights, fwd, bwd, comm, schedule=None, wgt=None) -> float:
    """The simulator's makespan for m microbatches. Beyond fill and drain each microbatch adds
    the same time, so for m > 3·pp the makespan is extrapolated linearly from 2·pp and 3·pp."""
    from megatron_lite.pipeline.schedules import get_schedule_table, simulate_options
    from megatron_lite.pipeline.simulate import simulate

    how = simulate_options(schedule, vpp)

    def run(n: int) -> float:
        table = get_schedule_table(pp, n, vpp, schedule)
        return float(simulate(table, fwd, bwd, comm, list(weights), wgt, **how).makespan)

    if m <= 3 * pp:
        return run(m)
    m1, m2 = 2 * pp, 3 * pp
    t1, t2 = run(m1), run(m2)
    return t2 + (m - m2) * (t2 - t1) / (m2 - m1)


def ep_rows_bytes(cfg: Config) -> float:
    """Bytes of one EP token all-to-all (`cfg` resolved): dispatch and combine each move the
    T·u·k (token, expert) rows of h of a microbatch (a dry run's balanced dropless routing)."""
    shape = layer_shape(cfg)
    return shape.tokens * shape.u * cfg.model.moe_router_topk * shape.h * shape.act_bytes


def ep_calls(cfg: Config) -> int:
    """Token all-to-alls per MoE layer and microbatch: dispatch and combine, forward and
    backward, and again in backward where the MoE layer is recomputed."""
    gran, modules, _, _ = recompute_settings(cfg)
    return 6 if gran == "full" or (gran == "selective" and "moe" in modules) else 4


def ep_all_to_all_bytes(cfg: Config, pp_rank: int, microbatches: int) -> float:
    """Bytes one rank of pipeline rank `pp_rank` sends through the EP token all-to-alls in
    `microbatches` microbatches (`cfg` resolved; 0 without EP)."""
    if not cfg.model.num_experts or cfg.parallel.ep == 1:
        return 0.0
    p = cfg.parallel
    layers = sum(sum(chunk_moe(cfg, pp_rank, c)) for c in range(p.vpp))
    loss = any(
        virtual_stage(pp_rank, c, p.pp, schedule_placement(p.pipeline_schedule, p.vpp))
        == p.pp * p.vpp - 1
        for c in range(p.vpp)
    )
    if loss:  # the loss chunk's MTP modules' MoE layers
        layers += sum(mtp_moe_pattern(cfg.model))
    return microbatches * layers * ep_calls(cfg) * ep_rows_bytes(cfg)


def cp_ring_blocks(cfg: Config) -> tuple[float, float]:
    """(bytes of one K/V block, of one dK/dV block) a ring step sends, per layer and microbatch
    (`cfg` resolved): the ring rank's s/R·b tokens of its g_r KV heads of widths dk + dv (the
    attention part's), g_r = g/tp, or max(g/tp, a2a)/a2a after Ulysses; K/V in the compute
    dtype, dK/dV in the ring's fp32."""
    shape = layer_shape(cfg)
    a2a, g = shape.a2a, shape.g // shape.tp
    g_r = ulysses_kv_heads(g, a2a) // a2a if a2a > 1 else g
    elements = shape.tokens * a2a * g_r * (shape.d + shape.dv)  # s_r·b = T·a2a tokens
    return elements * shape.act_bytes, elements * 4


def cp_ring_sends(cfg: Config) -> tuple[int, int]:
    """(K/V sends, dK/dV sends) per layer and microbatch: R−1 forward and R−1 backward K/V
    (and R−1 again in a full recompute's rerun; selective recompute never reruns the ring), R
    dK/dV."""
    ring = layer_shape(cfg).ring
    if ring == 1:
        return 0, 0
    rerun = 1 if cfg.model.recompute_granularity == "full" else 0
    return (ring - 1) * (2 + rerun), ring


def cp_ring_bytes(cfg: Config, pp_rank: int, microbatches: int) -> float:
    """Bytes one rank of pipeline rank `pp_rank` sends (and as many receives: comm_stats'
    `cp_send` and `cp_recv`) around the ring in `microbatches` microbatches (`cfg` resolved;
    0 without a ring)."""
    kv, dkv = cp_ring_blocks(cfg)
    n_kv, n_dkv = cp_ring_sends(cfg)
    layers = sum(c for _, c in rank_layers(cfg, pp_rank))
    return microbatches * layers * (n_kv * kv + n_dkv * dkv)


def cp_ring_exposed(cfg: Config, link: str, gpu, rate: float) -> tuple[float, float]:
    """(forward, backward) seconds the ring exposes per layer and microbatch (module
    docstring): each step computes two sub-blocks of c = s/(2R) queries against c keys over
    n/(tp·a2a) heads, 2·b·c²·n·(dk + dv)/(tp·a2a) FLOPs forward (QKᵀ and PV), 2.5× that
    backward."""
    shape = layer_shape(cfg)
    ring = shape.ring
    if ring == 1:
        return 0.0, 0.0
    kv, dkv = (collective_time("send", x, ring, link, gpu) for x in cp_ring_blocks(cfg))
    c = shape.s / (2 * ring)
    step = 2 * 2 * shape.b * c * c * shape.n / (shape.tp * shape.a2a) * (shape.d + shape.dv) / rate
    fwd = (ring - 1) * max(0.0, kv - step)
    bwd = (ring - 1) * max(0.0, kv + dkv - 2.5 * step) + dkv
    return fwd, bwd


def cp_a2a_blocks(cfg: Config) -> tuple[float, float]:
    """(bytes of Ulysses' q, k, v all-to-all, of its output's) per layer and microbatch, one
    direction (`cfg` resolved; 0 without Ulysses): q over n/tp heads of width dk, k and v over
    max(g/tp, a2a) heads (replicated up to a2a) of widths dk and dv, the output n/tp heads of
    width dv, for the rank's T tokens."""
    shape = layer_shape(cfg)
    a2a, T, A, t = shape.a2a, shape.tokens, shape.act_bytes, shape.tp
    if a2a == 1:
        return 0.0, 0.0
    g = max(shape.g / t, a2a)
    qkv = T * (shape.n / t * shape.d + g * (shape.d + shape.dv)) * A
    return qkv, T * shape.n / t * shape.dv * A


def cp_a2a_bytes(cfg: Config, pp_rank: int, microbatches: int) -> float:
    """Bytes of Ulysses' all-to-alls (comm_stats' all_to_all, beside EP's) one rank of
    pipeline rank `pp_rank` moves in `microbatches` microbatches: forward and backward, and the
    forward again per full recompute (`cfg` resolved)."""
    qkv, out = cp_a2a_blocks(cfg)
    passes = 3 if cfg.model.recompute_granularity == "full" else 2
    layers = sum(c for _, c in rank_layers(cfg, pp_rank))
    return microbatches * layers * passes * (qkv + out)


def cp_a2a_exposed(cfg: Config, link: str, gpu) -> float:
    """Seconds of Ulysses' two all-to-alls over the a2a ranks (q, k, v in with the KV heads
    replicated up to a2a; the output back), per layer and microbatch, one direction."""
    a2a = layer_shape(cfg).a2a
    if a2a == 1:
        return 0.0
    return sum(collective_time("all_to_all", x, a2a, link, gpu) for x in cp_a2a_blocks(cfg))


def step_time(cfg: Config, world: int, gpu, mfu: float, gpus_per_node: int,
              simulate: bool = True) -> StepTime:  # fmt: skip
    """Predicted step time of `cfg` on `world` GPUs: `gpu` a hardware.Node (a GPU: its usual
    node of `gpus_per_node`), with the step's communication budget (`StepTime.budget`; the
    algorithms NCCL would pick recorded when `simulate`, the plan's full report)."""
    node = as_node(gpu, gpus_per_node)
    r = resolved(cfg, world)
    m_, p, t_ = r.model, r.parallel, r.train
    shape = layer_shape(r)
    links = group_links(world, p.tp, p.pp, p.cp, p.ep, p.order, node.gpus_per_node,
                        cp_a2a_size(p), p.dp_shard)  # fmt: skip
    budget = Budget(node, detail=simulate)
    m = num_microbatches(t_, p.dp)
    T, A, rate = shape.tokens, shape.act_bytes, node.peak_tflops * 1e12 * mfu
    gran, modules, method, num = recompute_settings(r)
    schedule = p.pipeline_schedule
    split = splits_backward(schedule, p.vpp)  # B and W apart (zero bubble)
    layers_busiest = max(sum(c for _, c in rank_layers(r, rk)) for rk in range(p.pp))
    per_layer = m * layers_busiest  # layer-microbatches of the busiest rank (budget counts)

    # training.flops owns the FLOP count: per token 6·N + 6·L·s·q; a layer's share is the total
    # without the output layer (6·h·V) over L, in forward FLOPs (a third)
    flops_tok = model_flops_per_token(r)
    head = 6.0 * m_.hidden_size * m_.vocab_size
    # the multi-token prediction modules' FLOPs: on the last virtual stage, beside its head
    no_mtp = dataclasses.replace(r, model=dataclasses.replace(m_, mtp_num_layers=0))
    mtp = flops_tok - model_flops_per_token(no_mtp) if m_.mtp_num_layers else 0.0
    layer_fwd = (flops_tok - mtp - head) / 3 / m_.num_layers  # per token
    attn_flops = 2 * m_.seq_length * m_.hidden_size * T / p.tp  # causal QKᵀ and AV, forward
    t_fwd = layer_fwd * T / p.tp / rate  # one layer, one microbatch
    extra = 0.0
    if gran == "full":
        extra = 1.0  # the forward again in backward (block: averaged below over recomputed)
    elif gran == "selective" and "core_attn" in modules and shape.ring == 1:
        extra = attn_flops / rate / t_fwd
    if gran == "full" and method == "block":
        per_chunk = [c for _, c in rank_layers(r, 0)]
        extra = min(num, per_chunk[0]) / max(per_chunk[0], 1)

    # per layer, per microbatch communication
    size = T * m_.hidden_size * A  # the full [s/cp, b, h] activation
    tp_f = tp_b = hidden = 0.0
    if p.tp > 1:
        ops = ("all_gather", "reduce_scatter") if shape.sp else ("all_reduce", "all_reduce")
        rerun = 1 if gran == "full" else 0
        calls = (2 + 2 * (2 if shape.sp else 1) + rerun, 4 + rerun)  # per layer, microbatch
        if ops[0] == ops[1]:
            one = [budget.add("TP", ops[0], size, p.tp, links["tp"], per_layer * sum(calls))] * 2
        else:
            one = [budget.add("TP", op, size, p.tp, links["tp"], per_layer * c)
                   for op, c in zip(ops, calls, strict=True)]  # fmt: skip
        tp_f = 2 * sum(one)
        gathers = 2 * one[0] * (2 if shape.sp else 1) + (tp_f / 2 if gran == "full" else 0)
        scatters = 2 * one[1]
        half = t_fwd  # the backward GEMMs cost 2·t_fwd: half dgrad, half wgrad
        # a split backward defers the wgrad GEMMs to W: nothing hides the dgrad reduce-scatter
        hides = 0.0 if split else half
        tp_b = max(0.0, gathers - half) + max(0.0, scatters - hides)
        hidden += (gathers + scatters - tp_b) * m * sum(stage_layers(m_, p)) / p.pp
    a2a = cp_a2a_exposed(r, links["cp_a2a"], node)
    ring_f, ring_b = cp_ring_exposed(r, links["cp_ring"], node, rate)
    _cp_budget(r, links, budget, per_layer)
    rerun = a2a + ring_f if gran == "full" else 0.0  # the forward's again in backward
    cp_f, cp_b = a2a + ring_f, a2a + ring_b + rerun
    ep_f = ep_b = 0.0
    if m_.num_experts is not None and p.ep > 1:
        # per mean layer: times the share of MoE layers (moe_layer_freq)
        share = sum(moe_layer_pattern(m_)) / m_.num_layers
        calls = per_layer * share * ep_calls(r)
        one = share * budget.add("EP", "all_to_all", ep_rows_bytes(r), p.ep, links["ep"], calls)
        ep_f, ep_b = 2 * one, (ep_calls(r) - 2) * one
    p2p = 0.0
    if p.pp > 1:
        p2p = budget.add("PP", "send", size * shape.u, 2, links["pp"], 2 * m * p.vpp)

    # virtual-stage weights in mean-layer units, the output layer (and MTP) on the last one
    counts = stage_layers(m_, p)
    weights = [float(c) for c in counts]
    weights[-1] += (head + mtp) / 3 / layer_fwd
    fwd = t_fwd + tp_f + cp_f + ep_f
    bwd = 2 * t_fwd + extra * t_fwd + tp_b + cp_b + ep_b
    # W: the linear layers' weight-gradient GEMMs (the forward GEMMs' time; the attention
    # core has no weights); only for a schedule that splits the backward
    wgt = max(t_fwd - attn_flops / rate, 0.0) if split else None
    busy, bubble, pp_exp = _pipeline(p.pp, p.vpp, m, tuple(weights), fwd, bwd, p2p, simulate,
                                     p.pipeline_schedule, wgt)  # fmt: skip
    compute = (
        max(m * sum(weights[s] for s in held) for held in rank_stages(p.pp, p.vpp, schedule))
        * t_fwd
        * (3 + extra)
    )
    tp_exp = per_layer * (tp_f + tp_b)
    cp_exp = per_layer * (cp_f + cp_b)
    ep_exp = per_layer * (ep_f + ep_b)
    for group, seconds in (("TP", tp_exp), ("CP", cp_exp), ("EP", ep_exp), ("PP", pp_exp)):
        budget.expose(group, seconds)

    dp_exp, dp_hidden = dp_time(r, links, m, t_fwd, layers_busiest, budget)
    opt = whole_matrix_step(r, node, links, rate)
    total = busy + bubble + pp_exp + dp_exp + opt
    tokens = t_.global_batch_size * m_.seq_length
    model_flops = flops_tok * tokens
    return StepTime(
        compute=compute, tp=tp_exp, cp=cp_exp, ep=ep_exp, pp=pp_exp, dp=dp_exp, bubble=bubble,
        hidden=hidden + dp_hidden, total=total, tokens_per_s=tokens / total,
        mfu=model_flops / (total * world * node.peak_tflops * 1e12),
        bubble_fraction=bubble / busy if busy else 0.0, optimizer=opt, budget=budget,
        layer_forward=t_fwd,
    )  # fmt: skip


def _cp_budget(r: Config, links, budget: Budget, per_layer: float) -> None:
    """CP's collectives in the budget: Ulysses' all-to-alls over cp_a2a (forward, backward and
    a full recompute's rerun) and the ring's K/V and dK/dV sends over cp_ring."""
    p = r.parallel
    if p.cp == 1:
        return
    qkv, out = cp_a2a_blocks(r)
    passes = 3 if r.model.recompute_granularity == "full" else 2
    a2a, ring = layer_shape(r).a2a, layer_shape(r).ring
    for x in (qkv, out):
        budget.add("CP", "all_to_all", x, a2a, links["cp_a2a"], per_layer * passes)
    kv, dkv = cp_ring_blocks(r)
    n_kv, n_dkv = cp_ring_sends(r)
    if ring > 1:
        budget.add("CP", "send", kv, 2, links["cp_ring"], per_layer * n_kv)
        budget.add("CP", "send", dkv, 2, links["cp_ring"], per_layer * n_dkv)
