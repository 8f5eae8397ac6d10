"""The outputs of tools/bench_data_parallel.py: a table on screen (table.txt), results.csv,
results.json (raw per-step times included) and plot.png, plus the issue's targets checked."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import sys

# run as a script (python tools/bench_data_parallel_report.py), `tools` is not importable yet
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.parallel.data_parallel.memory import formula_bytes  # noqa: E402
from tools.bench_data_parallel import KINDS  # noqa: E402

MB = 1 << 20


def _median(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def _quartiles(xs) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"),) * 2
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def rows(cases: list[dict], measured: dict, world: int, num_params: int) -> list[dict]:
    """One row per configuration: medians in ms, memory in MB, formula and ratios."""
    out = []
    for case in cases:
        row = {k: case[k] for k in ("name", "family", "stage", "overlap", "note")}
        m = measured.get(case["name"])
        formula = sum(formula_bytes(num_params, "fp32", case["stage"], world).values())
        row["formula_MB"] = formula / MB
        if m is not None:
            q1, q3 = _quartiles(m["step_s"])
            row.update(
                step_ms=1e3 * _median(m["step_s"]),
                step_q1_ms=1e3 * q1,
                step_q3_ms=1e3 * q3,
                steps=len(m["step_s"]),
                sync_ms=1e3 * _median(m["sync_s"]),
                gather_ms=1e3 * _median(m["gather_s"]),
                **{f"{k}_MB": m["memory"][k] / MB for k in KINDS},
                total_MB=sum(m["memory"][k] for k in KINDS) / MB,
            )
            row["mem_vs_formula"] = row["total_MB"] / row["formula_MB"]
            row["other_paths"] = m["other_paths"]
            row["step_s"] = m["step_s"]
        out.append(row)
    return out


def _get(table: list[dict], name: str, key: str) -> float:
    for row in table:
        if row["name"] == name and key in row:
            return row[key]
    return float("nan")


def targets(table: list[dict]) -> list[dict]:
    """The issue's targets: (what, measured, rule, met?); nan where a configuration is missing."""
    step = lambda name: _get(table, name, "step_ms")  # noqa: E731
    out = []

    def check(what: str, value: float, limit: float, rule: str) -> None:
        met = None if math.isnan(value) else (value < limit if rule == "<" else value <= limit)
        out.append({"target": what, "value": value, "rule": f"{rule} {limit:g}", "met": met})

    for ov in ("on", "off"):
        ratio = step(f"ours z1 overlap {ov}") / step(f"ours z0 overlap {ov}")
        check(f"step z1 / z0 (overlap {ov})", ratio, 1.05, "<=")
    for stage in (0, 1, 2):
        off = f"ours z{stage} overlap off"
        hidden = step(off) - step(f"ours z{stage} overlap on")
        exposed = _get(table, off, "sync_ms") + (_get(table, off, "gather_ms") if stage else 0)
        # at least half hidden: hidden / exposed >= 0.5, written as 0.5 - ratio <= 0
        out.append(
            {
                "target": f"overlap hides (z{stage}): (step off - step on) / blocking comm off",
                "value": hidden / exposed,
                "rule": ">= 0.5",
                "met": None if math.isnan(hidden / exposed) else hidden / exposed >= 0.5,
                "detail": f"{hidden:.1f} ms hidden of {exposed:.1f} ms exposed",
            }
        )
    check("step z3 / torch FSDP2", step("ours z3 overlap on") / step("torch FSDP2"), 1.05, "<=")
    for stage in (1, 2, 3):
        ratio = step(f"ours z{stage} overlap on") / step(f"DeepSpeed ZeRO-{stage}")
        check(f"step z{stage} / DeepSpeed ZeRO-{stage}", ratio, 1.0, "<")
    for row in table:
        if row["family"] == "ours" and "mem_vs_formula" in row:
            check(f"memory / formula ({row['name']})", row["mem_vs_formula"], 1.02, "<=")
    z0, z3 = (_get(table, f"ours z{s} overlap on", "total_MB") for s in (0, 3))
    check("memory z3 / z0", z3 / z0, 0.3, "<=")
    return out


def format_table(table: list[dict]) -> str:
    cols = [
        ("configuration", "name", "{}"), ("step ms", "step_ms", "{:.0f}"),
        ("IQR ms", None, None), ("sync ms", "sync_ms", "{:.0f}"),
        ("gather ms", "gather_ms", "{:.0f}"), ("weights", "weights_MB", "{:.1f}"),
        ("grads", "grads_MB", "{:.1f}"), ("master", "master_MB", "{:.1f}"),
        ("optim", "optimizer_MB", "{:.1f}"), ("other", "other_MB", "{:.1f}"),
        ("total MB", "total_MB", "{:.1f}"), ("formula", "formula_MB", "{:.1f}"),
        ("/formula", "mem_vs_formula", "{:.3f}"),
    ]  # fmt: skip
    lines = [[c[0] for c in cols] + ["note"]]
    for row in table:
        cells = []
        for _, key, fmt in cols:
            if key is None:
                ok = "step_q1_ms" in row
                cells.append(f"{row['step_q1_ms']:.0f}-{row['step_q3_ms']:.0f}" if ok else "")
            else:
                value = row.get(key)
                ok = value is not None and not (isinstance(value, float) and math.isnan(value))
                cells.append(fmt.format(value) if ok else "")
        lines.append(cells + [row["note"]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    text = []
    for line in lines:
        pairs = enumerate(zip(line[:-1], widths, strict=True))
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs]
        text.append("  ".join(cells) + ("  " + line[-1] if line[-1] else ""))
    return "\n".join(text)


def format_targets(checks: list[dict]) -> str:
    lines = []
    for c in checks:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[c["met"]]
        detail = f" ({c['detail']})" if c.get("detail") else ""
        lines.append(f"  {c['target']}: {c['value']:.3f} (target {c['rule']}): {verdict}{detail}")
    return "\n".join(lines)


def plot(table: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in table if "step_ms" in r]
    names = [r["name"] for r in shown][::-1]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.8), sharey=True)
    y = range(len(names))
    med = [r["step_ms"] for r in shown][::-1]
    err = [
        [r["step_ms"] - r["step_q1_ms"] for r in shown][::-1],
        [r["step_q3_ms"] - r["step_ms"] for r in shown][::-1],
    ]
    ax_t.barh(y, med, xerr=err, color="tab:blue", capsize=3)
    ax_t.set_yticks(list(y), names)
    ax_t.set_xlabel("step time, ms (median; bars: quartiles)")
    left = [0.0] * len(names)
    colors = ("tab:blue", "tab:orange", "tab:purple", "tab:green", "grey")
    for kind, color in zip(KINDS, colors, strict=True):
        width = [r[f"{kind}_MB"] for r in shown][::-1]
        ax_m.barh(y, width, left=left, color=color, label=kind)
        left = [a + b for a, b in zip(left, width, strict=True)]
    formula = [r["formula_MB"] for r in shown][::-1]
    ax_m.scatter(formula, y, marker="|", s=300, c="k", label="formula")
    ax_m.set_xlabel("model states per rank, MB (max over ranks)")
    ax_m.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(a, shape, cases: list[dict], measured: dict, context: dict) -> dict:
    """Print the table and targets; write table.txt, results.csv, results.json, plot.png."""
    table = rows(cases, measured, a.world, context["num_parameters"])
    checks = targets(table)
    ours = context.get("num_parameters_ours")
    if ours is not None and ours != context["num_parameters"]:
        raise RuntimeError(  # the peers would not train the same model
            f"our model has {ours:,} parameters, the plain one {context['num_parameters']:,}: "
            "make tools/bench_data_parallel_peers.py's PlainLlama match ours_overrides()"
        )
    header = (
        f"{a.world} ranks, {context['num_parameters']:,} parameters {dataclasses.asdict(shape)}, "
        f"buckets of {a.bucket_size:,} parameters, "
        f"{a.rounds} rounds x {a.steps} timed steps per configuration; "
        f"load average {context['load_before'][0]:.1f} before, {context['load_after'][0]:.1f} after"
        f" on {context['cpus']} CPUs"
    )
    text = f"{header}\n{format_table(table)}\n\ntargets (issue 12):\n{format_targets(checks)}\n"
    print(text, flush=True)
    with open(os.path.join(a.out_dir, "table.txt"), "w") as f:
        f.write(text)
    flat = [{k: v for k, v in r.items() if k not in ("other_paths", "step_s")} for r in table]
    keys = list(dict.fromkeys(k for r in flat for k in r))
    with open(os.path.join(a.out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)
    results = {"args": vars(a), "shape": dataclasses.asdict(shape), "context": context}
    results.update(rows=table, targets=checks)
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    if any("step_ms" in r for r in table):
        plot(table, os.path.join(a.out_dir, "plot.png"))
    return results


if __name__ == "__main__":  # a module of tools/bench_data_parallel.py, not a command of its own
    print(
        f"{__doc__.strip()}\n\nRun python tools/bench_data_parallel.py (--help lists its options)."
    )
