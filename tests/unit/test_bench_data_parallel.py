"""tools/bench_data_parallel.py: the model-state walk counts exactly what a plain AdamW run
allocates, and a --quick run (2 ranks, ours only) writes its outputs with every measured stage
at its ZeRO formula; a stage the config validation rejects is skipped with the reason."""

import json
import os

import pytest
import torch

from tools.bench_data_parallel import main, model_state_bytes
from tools.bench_data_parallel_peers import PlainLlama, Shape, param_groups


def test_model_state_walk_counts_weights_grads_and_adamw_states():
    torch.manual_seed(0)
    model = PlainLlama(Shape(vocab=64, layers=1, hidden=16, heads=2, groups=1, ffn=32, seq=8))
    opt = torch.optim.AdamW(param_groups(model, 0.1), foreach=False)
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens, tokens).backward()
    opt.step()
    params = list(model.parameters())  # the tied output weight once
    n = sum(p.numel() for p in params)
    got = model_state_bytes(params, opt)
    steps = 4 * len(params)  # AdamW's per-parameter fp32 `step` scalar
    want = {"weights": 4 * n, "grads": 4 * n, "master": 0, "optimizer": 8 * n + steps, "other": 0}
    assert {k: got[k] for k in want} == want, f"walked {got}, allocated {want}"


@pytest.mark.slow  # the suite's budget: CI's slow tier runs it
def test_quick_run_writes_outputs_at_the_formula(tmp_path):
    out = str(tmp_path)
    main(["--quick", "--no-peers", "--stages", "1,3", "--out-dir", out])
    for name in ("table.txt", "results.csv", "results.json", "plot.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, f"{name} is missing or empty"
    with open(os.path.join(out, "results.json")) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == 4, [r["name"] for r in rows]  # stages 1 and 3, overlap on and off
    for row in rows:
        if row["note"]:  # only a stage the validation rejects may be missing, with its reason
            assert row["stage"] == 3 and "config validation rejects" in row["note"], row
            continue
        assert row["step_ms"] > 0, row
        assert abs(row["mem_vs_formula"] - 1) <= 0.02, (
            f"{row['name']}: {row['total_MB']:.3f} MB measured vs {row['formula_MB']:.3f} MB "
            "by the ZeRO formula"
        )
