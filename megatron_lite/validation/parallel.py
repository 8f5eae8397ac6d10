"""Parallel-layout rules: world size and degrees, rank order, attention heads and query groups
over tp/cp, layers over pipeline stages, batch sizes, and the FFN width over tp; and the
one-line warnings of parallel keys whose feature is off (`parallel_warnings`).

A parallel key's rule holds whether or not its feature is on (an invalid value is an error at
cp=1, pp=1 or tp=1 too); a valid value other than the default of a feature that is off warns
that it has no effect (cp_comm_type at cp=1, pipeline_schedule and pipeline_layers at
pp·vpp=1, sequence_parallel at tp=1, order with at most one degree above 1). Keys that cannot
mean anything without their feature stay errors: vpp > 1 at pp=1, the first/last stage's
layers at pp·vpp=1, cp_a2a_size without a2a+p2p."""

from __future__ import annotations

import math

from megatron_lite.config import Config, ParallelConfig
from megatron_lite.parallel.mesh import order_problem
from megatron_lite.pipeline.registry import (
    fewest_microbatches,
    microbatches_problem,
    needs_multiple,
)
from megatron_lite.resolve import cp_a2a_size, num_microbatches
from megatron_lite.validation.rules import _no_effect, _rule


def _validate_world_size(p: ParallelConfig, world_size: int) -> None:
    """world size = tp·pp·cp·dp (dp may be null: then it is derived by `resolve`)."""
    mp = p.tp * p.pp * p.cp
    if p.dp is None:
        _rule(
            world_size % mp == 0,
            "parallel.tp·pp·cp",
            mp,
            f"world size {world_size} must be divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp}",
            f"launch a multiple of {mp} ranks or change the degrees",
        )
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


def _validate_order(p: ParallelConfig) -> None:
    """The rank order string that lays the degrees out over ranks (rules: parallel/mesh.py)."""
    problem = order_problem(p.order)
    fix = "use the default tp-cp-ep-dp-pp"
    _rule(problem is None, "parallel.order", p.order, str(problem), fix)


def _validate_heads(cfg: Config) -> None:
    """Attention heads and query groups over tp (on the resolved config)."""
    m, p = cfg.model, cfg.parallel
    _rule(
        m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
        "model.hidden_size",
        m.hidden_size,
        f"must be divisible by model.num_attention_heads={m.num_attention_heads} "
        "(the head dimension is hidden_size / heads when model.kv_channels is null)",
        "pick a hidden size that is a multiple of the head count, or set model.kv_channels",
    )
    _rule(
        m.num_attention_heads % p.tp == 0,
        "parallel.tp",
        p.tp,
        f"model.num_attention_heads={m.num_attention_heads} must be divisible by tp",
        f"use a tp that divides {m.num_attention_heads}",
    )
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


def _validate_sequence_split(cfg: Config) -> None:
    """Heads over the Ulysses ranks, the sequence over cp (2·ring chunks for the ring) and,
    with sequence parallelism, over tp."""
    m, p = cfg.model, cfg.parallel
    _validate_cp_comm_type(cfg)
    a2a = cp_a2a_size(p)
    ring = p.cp // a2a
    if a2a > 1:
        heads_local = m.num_attention_heads // p.tp
        what = "cp" if a2a == p.cp else "cp_a2a_size"
        _rule(
            heads_local % a2a == 0,
            f"parallel.{what}",
            a2a,
            f"query heads per TP rank ({heads_local}) must be divisible by the Ulysses ranks "
            f"({a2a}; Ulysses splits heads across them)",
            f"use a {what} that divides num_attention_heads/tp, or parallel.cp_comm_type=p2p "
            "or a2a+p2p (the ring splits the sequence, not the heads)",
        )
        groups_local = m.num_query_groups // p.tp
        _rule(
            groups_local % a2a == 0 or a2a % groups_local == 0,
            "model.num_query_groups",
            m.num_query_groups,
            f"KV groups per TP rank ({groups_local}) must divide or be divisible by the "
            f"Ulysses ranks ({a2a})",
            "use a power-of-two number of query groups",
        )
    seq_div = p.cp * (p.tp if p.sequence_parallel else 1)
    if ring > 1:  # causal load balancing: 2·ring chunks, each cut over the Ulysses ranks
        seq_div = math.lcm(seq_div, 2 * ring)
    _rule(
        m.seq_length % seq_div == 0,
        "model.seq_length",
        m.seq_length,
        f"must be divisible by cp{'·tp (sequence parallel)' if p.sequence_parallel else ''}"
        f"{' and by 2·ring (the ring splits it into 2·ring chunks)' if ring > 1 else ''}"
        f" = {seq_div}",
        f"use a multiple of {seq_div}",
    )


def _validate_cp_comm_type(cfg: Config) -> None:
    """a2a+p2p needs a Ulysses size strictly inside cp; the ring has no attention dropout and
    computes its blocks itself (no flash-attn / TE kernel)."""
    m, p = cfg.model, cfg.parallel
    hybrid = p.cp_comm_type == "a2a+p2p"
    _rule(
        p.cp_a2a_size is None or hybrid,
        "parallel.cp_a2a_size",
        p.cp_a2a_size,
        f"only a2a+p2p uses it (cp_comm_type is {p.cp_comm_type})",
        "remove it, or set parallel.cp_comm_type=a2a+p2p",
    )
    if hybrid:
        a = p.cp_a2a_size
        _rule(
            a is not None and 1 < a < p.cp and p.cp % a == 0,
            "parallel.cp_a2a_size",
            a,
            f"a2a+p2p needs Ulysses groups of 2..cp/2 ranks that divide cp={p.cp} (cp = "
            "cp_a2a_size · ring size)",
            "e.g. parallel.cp_a2a_size=2 with parallel.cp=4, or cp_comm_type=a2a / p2p",
        )
    if p.cp == 1 or p.cp_comm_type == "a2a":
        return
    _rule(
        m.attention_dropout == 0.0,
        "model.attention_dropout",
        m.attention_dropout,
        f"ring attention (parallel.cp_comm_type={p.cp_comm_type}) has no attention dropout",
        "set model.attention_dropout=0 or parallel.cp_comm_type=a2a",
    )
    _rule(
        m.attention_backend in ("auto", "sdpa"),
        "model.attention_backend",
        m.attention_backend,
        f"ring attention (parallel.cp_comm_type={p.cp_comm_type}) computes its blocks in torch "
        "(fp32 log-sum-exp merge), not with flash-attn or Transformer Engine",
        "set model.attention_backend=auto, or parallel.cp_comm_type=a2a",
    )


def _validate_pipeline_layers(cfg: Config) -> None:
    """Layers over pipeline stages and their virtual chunks (even, or an explicit split)."""
    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.vpp
    _rule(
        p.vpp == 1 or p.pp > 1,
        "parallel.vpp",
        p.vpp,
        "virtual stages need parallel.pp > 1",
        "set parallel.vpp=1 or parallel.pp >= 2",
    )
    ends = [p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers]
    if p.pipeline_layers is not None:
        _rule(
            ends == [None, None],
            "parallel.pipeline_layers",
            p.pipeline_layers,
            "cannot be combined with decoder_first/last_pipeline_num_layers",
            "give either the whole list or the first/last stage's layers",
        )
        _validate_layer_list(p.pipeline_layers, stages, m.num_layers)
    elif ends != [None, None]:
        _validate_end_stages(cfg, ends)
    else:
        _rule(
            m.num_layers % stages == 0,
            "model.num_layers",
            m.num_layers,
            f"must be divisible by pp·vpp = {p.pp}·{p.vpp}",
            f"use a multiple of {stages}, or an uneven split: parallel.pipeline_layers or "
            "parallel.decoder_first/last_pipeline_num_layers",
        )


def _validate_end_stages(cfg: Config, ends: list) -> None:
    """decoder_first/last_pipeline_num_layers (`ends`, one or both set): at least two stages,
    each end inside the model, and the other stages splitting the rest evenly."""
    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.vpp
    given = [n for n in ends if n is not None]
    key = "first" if ends[0] is not None else "last"
    _rule(  # named by the key the user set, whatever its value (pp·vpp = 1 has no stages)
        stages >= 2,
        f"parallel.decoder_{key}_pipeline_num_layers",
        ends[0] if key == "first" else ends[1],
        f"the first/last stage's layers need at least two stages (pp·vpp >= 2; here "
        f"pp·vpp = {p.pp}·{p.vpp})",
        f"set parallel.pp >= 2, or remove parallel.decoder_{key}_pipeline_num_layers",
    )
    for key, n in zip(("first", "last"), ends, strict=True):
        _rule(
            n is None or 1 <= n < m.num_layers,
            f"parallel.decoder_{key}_pipeline_num_layers",
            n,
            f"must be between 1 and model.num_layers - 1 = {m.num_layers - 1}",
            "give the layers of that stage",
        )
    middle, rest = stages - len(given), m.num_layers - sum(given)
    if middle == 0:  # pp·vpp = 2 with both ends given: they are the whole split
        _rule(
            rest == 0,
            "model.num_layers",
            m.num_layers,
            f"must equal decoder_first + decoder_last = {sum(given)}: pp·vpp = 2 stages "
            "have no others",
            "make the two stages' layers add up to model.num_layers",
        )
    else:
        _rule(
            rest > 0 and rest % middle == 0,
            "model.num_layers",
            m.num_layers,
            f"leaves {rest} layers for the other {middle} of pp·vpp = {stages} stages, "
            "which must split them evenly (at least one each)",
            "change the first/last stage's layers, or give parallel.pipeline_layers",
        )


def _validate_layer_list(layers: list, stages: int, num_layers: int) -> None:
    key = "parallel.pipeline_layers"
    _rule(
        len(layers) == stages,
        key,
        layers,
        f"needs one entry per virtual stage: pp·vpp = {stages}",
        f"give {stages} layer counts",
    )
    _rule(
        all(isinstance(n, int) and n >= 1 for n in layers),
        key,
        layers,
        "every stage needs at least one layer",
        "give positive integers",
    )
    _rule(
        sum(layers) == num_layers,
        key,
        layers,
        f"must add up to model.num_layers={num_layers} (they add up to {sum(layers)})",
        "make the counts add up to the model's layers",
    )


def _validate_batch_sizes(cfg: Config) -> None:
    """Micro and global batch sizes over dp, and enough microbatches for the pipeline."""
    p, t = cfg.parallel, cfg.train
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
    n_micro = num_microbatches(t, p.dp)
    problem = microbatches_problem(p.pp, n_micro, p.vpp, p.pipeline_schedule)
    if needs_multiple(p.pp, p.vpp, p.pipeline_schedule):  # the schedule record's rules
        fix = f"use a multiple of {p.pp * per_step}"
    else:
        fewest = fewest_microbatches(p.pp, p.vpp, p.pipeline_schedule)
        fix = f"use global_batch_size >= {fewest * per_step}"
    _rule(
        problem is None,
        "train.global_batch_size",
        t.global_batch_size,
        f"gives {n_micro} microbatches of micro_batch_size·dp = {per_step}, and {problem}",
        fix,
    )


def _validate_ffn_hidden_size(cfg: Config) -> None:
    """The dense MLP width over tp (on the resolved config)."""
    m, p = cfg.model, cfg.parallel
    _rule(
        m.ffn_hidden_size % p.tp == 0,
        "model.ffn_hidden_size",
        m.ffn_hidden_size,
        f"must be divisible by parallel.tp={p.tp}",
        f"use a multiple of {p.tp}",
    )


def parallel_warnings(cfg: Config) -> list[str]:
    """The one-line warnings of the resolved (and validated) config's parallel keys whose
    feature this run does not use (see the module docstring), in field order."""
    p = cfg.parallel
    default = ParallelConfig()
    out = []
    if p.pipeline_schedule != default.pipeline_schedule and p.pp == 1:
        why = "parallel.pp=1 runs no pipeline (each microbatch's forward, then its backward)"
        fix = "remove it, or set parallel.pp >= 2"
        out.append(_no_effect("parallel.pipeline_schedule", p.pipeline_schedule, why, fix))
    if p.pipeline_layers != default.pipeline_layers and p.pp * p.vpp == 1:
        why = "pp·vpp = 1 stage holds every layer"
        fix = "remove it, or set parallel.pp >= 2"
        out.append(_no_effect("parallel.pipeline_layers", p.pipeline_layers, why, fix))
    if p.sequence_parallel != default.sequence_parallel and p.tp == 1:
        why = "parallel.tp=1 has no tensor-parallel ranks to split the sequence over"
        fix = "remove it, or set parallel.tp >= 2"
        out.append(_no_effect("parallel.sequence_parallel", p.sequence_parallel, why, fix))
    degrees = [p.tp, p.cp, p.ep, p.dp, p.pp]
    if p.order != default.order and sum(d > 1 for d in degrees) <= 1:
        why = "at most one of tp, cp, ep, dp, pp is above 1, so every order lays out the same"
        fix = "remove it (it matters once two degrees are above 1)"
        out.append(_no_effect("parallel.order", p.order, why, fix))
    if p.cp_comm_type != default.cp_comm_type and p.cp == 1:
        why = "parallel.cp=1 splits no sequence"
        fix = "remove it, or set parallel.cp >= 2"
        out.append(_no_effect("parallel.cp_comm_type", p.cp_comm_type, why, fix))
    return out
