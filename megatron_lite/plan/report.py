"""Text report of a plan: per-rank memory by term, per-layer activations, step-time split, and
the dry run's figures beside the planner's (printed, and written to --json)."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.plan.dry_run import PLANNER_TERMS, RankResult, dry_run, to_json
from megatron_lite.plan.flags import parse_ranks, write_output
from megatron_lite.plan.memory import RankMemory
from megatron_lite.plan.step_time import StepTime

GIB = 2**30


def _g(x: float) -> str:
    return f"{x / GIB:7.2f}"


def memory_table(ranks: list[RankMemory], budget: float) -> str:
    """One line per pipeline rank: each term in GiB, total, fits."""
    terms = list(ranks[0].terms)
    head = "pp rank  in-flight " + " ".join(f"{t[:11]:>11}" for t in terms) + "    total  fits"
    lines = [head]
    for r in ranks:
        cells = " ".join(f"{_g(r.terms[t]):>11}" for t in terms)
        ok = "yes" if r.total <= budget else "NO"
        lines.append(f"{r.pp_rank:7d}  {r.in_flight:9d} {cells}  {_g(r.total)}  {ok}")
    return "\n".join(lines)


def layer_table(per_layer: dict[str, float]) -> str:
    """One layer's saved activations per microbatch in MiB, by the module whose code saved
    them (plan/saved.py: "layer" is the layer's own code; "input" the kept input under full
    recompute)."""
    cells = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in per_layer.items() if v)
    return f"activations per layer and microbatch (MiB): {cells}; total " + (
        f"{sum(per_layer.values()) / 2**20:.1f}"
    )


def time_table(t: StepTime, world: int) -> str:
    parts = [
        ("compute", t.compute), ("tp exposed", t.tp), ("cp exposed", t.cp),
        ("ep exposed", t.ep), ("pp p2p", t.pp), ("dp exposed", t.dp), ("bubble", t.bubble),
        ("optimizer", t.optimizer),
    ]  # fmt: skip
    cells = ", ".join(f"{k} {v:.3f}" for k, v in parts if v)
    return (
        f"step time {t.total:.3f} s = {cells} (overlap hides {t.hidden:.3f} s of communication); "
        f"bubble {t.bubble_fraction:.2%}; {t.tokens_per_s:,.0f} tokens/s, "
        f"{t.tokens_per_s / world:,.0f} per GPU, MFU {t.mfu:.1%}"
    )


def budget_table(budget) -> str:
    """The step's communication budget (plan/budget.py): per group and scope the bytes the
    busiest rank sends (bus bytes, GB = 1e9 B), the calls per op, the modelled seconds, what
    the step exposes and what overlap hides, NCCL's algorithm; then the cross-node total."""
    lines = ["communication per step (busiest rank; bus bytes it sends, GB = 1e9 B):"]
    lines.append(
        f"  {'group':11s} {'scope':5s} {'n':>4s} {'GB':>9s} {'seconds':>9s} {'exposed':>9s} "
        f"{'hidden':>9s}  algorithm  ops (calls)"
    )
    for v in budget.table():
        ops = ", ".join(f"{op} ×{calls:,.0f}" for op, calls in v.ops.items())
        algo = "+".join(sorted(v.algos)) or "-"
        lines.append(
            f"  {v.group:11s} {v.scope:5s} {v.n:4d} {v.bytes / 1e9:9.3f} {v.seconds:9.3f} "
            f"{v.exposed:9.3f} {v.hidden:9.3f}  {algo:9s}  {ops}"
        )
    if len(lines) == 2:
        lines.append("  (none: one rank per group)")
    nbytes, secs = budget.cross_node()
    lines.append(f"  across nodes: {nbytes / 1e9:.3f} GB, {secs:.3f} s per step per rank")
    return "\n".join(lines)


def _unit(results: list[RankResult]) -> tuple[str, float]:
    return ("GiB", 2**30) if max(r.peak for r in results) >= 2**30 else ("MiB", 2**20)


def dry_run_table(results: list[RankResult]) -> str:
    """Per rank: the peak by category beside the planner's terms, with ratios."""
    lines = []
    unit, scale = _unit(results)
    for res in results:
        where = " ".join(f"{k}{v}" for k, v in res.coords.items() if k != "edp")
        lines.append(
            f"rank {res.rank} ({where}): {res.microbatches} microbatches, "
            f"dry run {res.wall_s:.1f} s; peak in {res.phase}"
        )
        lines.append(f"  {unit:24s} {'dry run':>9s} {'planner':>9s}  ratio")
        pred = res.predicted.terms if res.predicted else {}
        rows = res.grouped()
        for name, terms in PLANNER_TERMS.items():
            want = sum(pred.get(t, 0.0) for t in terms)
            got = rows[name]
            ratio = f"{got / want:6.3f}" if want else ("  —" if got else "  =")
            lines.append(f"  {name:24s} {got / scale:9.2f} {want / scale:9.2f}  {ratio}")
        total = sum(pred.values())
        lines.append(
            f"  {'peak':24s} {res.peak / scale:9.2f} {total / scale:9.2f}  "
            + (f"{res.peak / total:6.3f}" if total else "")
        )
        if res.host_peak or res.predicted_host:  # model.activation_offload's host copies
            want, got = res.predicted_host, res.host_peak
            ratio = f"{got / want:6.3f}" if want else ""
            lines.append(
                f"  {'host (offloaded)':24s} {got / scale:9.2f} {want / scale:9.2f}  {ratio}"
            )
        lines.append(f"  {'initialization peak':24s} {res.init_peak / scale:9.2f}")
        lines.append(f"  {'checkpoint save extra':24s} {res.save_extra / scale:9.2f}")
        comm = _comm_line(res.comm)
        if comm:
            lines.append(f"  collectives of the step (bytes per rank, calls): {comm}")
        if res.device != "cpu":
            from megatron_lite.plan.cuda_dry_run import syncs_report

            lines.append(f"  every tensor of the step on {res.device} or a host site")
            lines.append(syncs_report(res.host_syncs, res.microbatches))
    return "\n".join(lines)


def _comm_line(comm: dict[str, float]) -> str:
    """comm_stats' summary as "kind 1.23 GiB ×n" per kind (the kind names the group: all_gather
    and reduce_scatter TP/SP, *_dp data parallel, p2p_* pipeline, all_to_all* CP/EP)."""
    kinds = sorted(k[len("comm_bytes/") :] for k in comm if k.startswith("comm_bytes/"))
    parts = []
    for k in kinds:
        n, calls = comm[f"comm_bytes/{k}"], int(comm.get(f"comm_calls/{k}", 0))
        size = f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
        parts.append(f"{k} {size} ×{calls}")
    return ", ".join(parts)


def dry_run_report(cfg: Config, world: int, ranks: str | None, microbatches: str,
                   json_path: str | None = None, kernels: str = "fused",
                   device: str = "cpu") -> str:  # fmt: skip
    """plan --dry-run: run, print the table (and write the figures to `json_path`); device
    "cuda": on fake CUDA tensors, with each rank's host syncs (plan/cuda_dry_run.py)."""
    import json

    chosen = parse_ranks(ranks, world)
    results = dry_run(cfg, world, chosen, microbatches, kernels=kernels, device=device)
    if json_path:  # checked before the run (plan/flags.py); written whole or not at all

        def write(path: str) -> None:
            with open(path, "w") as f:
                json.dump(to_json(results), f, indent=1)

        write_output("--json", json_path, write)
    tensors = "fake tensors" if device == "cpu" else "fake CUDA tensors, placement checked"
    head = f"dry run on {world} ranks (fake process group, {tensors}, kernels={kernels}):"
    return head + "\n" + dry_run_table(results)
