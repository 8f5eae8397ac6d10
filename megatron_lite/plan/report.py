"""Text report of a plan: per-rank memory by term, per-layer activations, step-time split."""

from __future__ import annotations

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
    """One layer's saved activations per microbatch, by term, in MiB."""
    cells = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in per_layer.items() if v)
    return f"activations per layer and microbatch (MiB): {cells}; total " + (
        f"{sum(per_layer.values()) / 2**20:.1f}"
    )


def time_table(t: StepTime, world: int) -> str:
    parts = [
        ("compute", t.compute), ("tp exposed", t.tp), ("cp exposed", t.cp),
        ("ep exposed", t.ep), ("pp p2p", t.pp), ("dp exposed", t.dp), ("bubble", t.bubble),
    ]  # fmt: skip
    cells = ", ".join(f"{k} {v:.3f}" for k, v in parts if v)
    return (
        f"step time {t.total:.3f} s = {cells} (overlap hides {t.hidden:.3f} s of communication); "
        f"bubble {t.bubble_fraction:.2%}; {t.tokens_per_s:,.0f} tokens/s, "
        f"{t.tokens_per_s / world:,.0f} per GPU, MFU {t.mfu:.1%}"
    )
