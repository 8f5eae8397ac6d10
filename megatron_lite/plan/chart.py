"""PNG chart of memory per rank by term (stacked bars), one group of bars per layout."""

from __future__ import annotations

from megatron_lite.plan.memory import RankMemory


def memory_chart(layouts: list[tuple[str, list[RankMemory]]], budget: float, path: str) -> None:
    """Stacked bars of each layout's pipeline ranks; a line at the usable memory."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(
            f"--chart needs matplotlib ({e}). Fix: pip install -e '.[dev]' or pip install "
            f"matplotlib"
        ) from None
    terms = list(layouts[0][1][0].terms)
    labels, rows = [], []
    for name, ranks in layouts:
        for r in ranks:
            labels.append(f"{name} pp{r.pp_rank}")
            rows.append([r.terms[t] / 2**30 for t in terms])
    fig, ax = plt.subplots(figsize=(max(7, 0.35 * len(rows) + 3), 5))
    bottom = [0.0] * len(rows)
    for i, t in enumerate(terms):
        vals = [row[i] for row in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=t)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(budget / 2**30, color="k", linestyle="--", label="usable memory")
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("GiB per rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
