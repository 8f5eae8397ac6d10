"""tools/bench_compile.py --quick: the eager and compiled trainers of a tiny model on one rank
print both step times, the first step's time and dynamo's report (no graph break: a dense
Llama on one rank is one graph per region kind), then the FP8 vs bf16 GEMM figures
(tools/bench_fp8.py's, issue #41 item 3)."""

import os

import pytest

from tools.bench_compile import main


# two fresh processes, one compiles (1-7 min on 2 cores): on request only (CI's budget)
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MEGATRON_LITE_COMPILE_TABLE") != "1", reason="MEGATRON_LITE_COMPILE_TABLE=1"
)
@pytest.mark.timeout(900)
def test_quick_run_prints_the_figures(capsys):
    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "quick: step eager" in out and "compiled/eager" in out, out
    assert "quick: first step eager" in out, out
    assert "quick: compile: 2 graphs, 0 graph breaks, 0 recompiles" in out, out
    for path in ("bf16", "tensorwise", "rowwise"):
        assert f"fp8: {path}" in out and "rel. error fwd" in out, out
