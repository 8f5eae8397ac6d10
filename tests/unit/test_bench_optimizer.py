"""tools/bench_optimizer.py: issue #40's done criterion, ZeRO-1 at dp 8 on configs/llama3_8b.yaml
(its tp2) spreads Muon's Newton–Schulz FLOPs within 1.1 of the mean per owner rank, on the
parameters the planner measures on the meta device; the owners' costs add up to Llama-3 8B's
published matrices (h 4096, 32 heads, 8 KV groups of 128, ffn 14336, 32 layers: q, k, v, o,
gate, up, down, each whole after the TP gather) at 5 steps of the quintic iteration,
5·(4m²n + 2m³) FLOPs on an m×n matrix (m ≤ n); and a --quick run prints both tables."""

from tools.bench_optimizer import balance, layout_config, main, rank_costs

LLAMA3_8B = "configs/llama3_8b.yaml"


def ns(rows: int, cols: int) -> int:
    m, n = sorted((rows, cols))
    return 5 * (4 * m * m * n + 2 * m**3)


def test_llama3_8b_zero1_dp8_balances_newton_schulz_within_1_1():
    row = balance(LLAMA3_8B, 8)
    assert (row["tp"], row["pp"]) == (2, 1), row  # the config's own layout
    assert row["dense_max_mean"] <= 1.1, f"max/mean NS FLOPs per rank {row['dense_max_mean']}"
    cfg, _ = layout_config(LLAMA3_8B, 8)
    loads = rank_costs(cfg, 0)["dense"]
    h, kv, f = 4096, 8 * 128, 14336
    layer = 2 * ns(h, h) + 2 * ns(kv, h) + 2 * ns(f, h) + ns(h, f)
    assert len(loads) == 8 and sum(loads) == 32 * layer, (sum(loads), 32 * layer)


def test_quick_run_prints_both_tables(capsys):
    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "muon/adamw" in out and "llama3_8b.yaml" in out, out
