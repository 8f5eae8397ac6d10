"""The planner's memory terms against the dry run of the real training step (plan --dry-run)
on a full-size-shaped layout: Llama-3 8B's layers (h 4096, 32 heads, 8 KV groups, ffn 14336,
vocab 128256, seq 8192, bf16) cut to 2, tp8 pp2 dp2 ZeRO-2, first pipeline stage. The dry run
measures what the code allocates (training/memory_tracker.py); the planner is formulas
(plan/activations.py, plan/working.py, plan/peak.py): every term and the peak agree within 3%
and the peak is in the same phase.

The dry run initializes a fake process group, process-global state, so it runs in a child
process (never in pytest's); tools/bench_dry_run.py runs the same comparison at full depth."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD, RANK = 32, 0
OVERRIDES = [
    "parallel.tp=8", "parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=2",
    "model.num_layers=2",
]  # fmt: skip
TOLERANCE = 0.03

CHILD = """
import json, sys
from megatron_lite.config import load_config
from megatron_lite.plan.__main__ import with_vocab
from megatron_lite.plan.dry_run import dry_run, to_json
from megatron_lite.validation import validate

world, rank, overrides = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
cfg = validate(with_vocab(load_config("configs/llama3_8b.yaml", overrides)), world)
(res,) = dry_run(cfg, world, [rank], "steady", workers=1, kernels="fused")
print(json.dumps(dict(to_json([res])[0], predicted_phase=res.predicted.phase)))
"""


def _dry_run() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(WORLD), str(RANK), *OVERRIDES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_planner_terms_match_the_dry_run_of_a_full_size_layer():
    res = _dry_run()
    gib = 2**30
    for term, got in res["compared"].items():
        want = res["predicted"][term]
        assert abs(got - want) <= TOLERANCE * want or got == want == 0, (
            f"{term}: dry run {got / gib:.3f} GiB, planner {want / gib:.3f} GiB"
        )
    got, want = res["peak_bytes"], res["predicted_peak_bytes"]
    assert abs(got - want) <= TOLERANCE * want, f"peak: dry run {got}, planner {want}"
    kind = res["peak_phase"].split()[0]  # "forward layer 1", "backward", "recompute layer 0"
    assert res["predicted_phase"].endswith("forward" if kind == "forward" else "backward"), (
        f"peak in {res['peak_phase']!r} (dry run) vs {res['predicted_phase']!r} (planner)"
    )
