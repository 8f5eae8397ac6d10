"""docs/own_model.md's example ("Using the layers in your own model") runs as printed, on tp2 and on
tp2 × dp2, and both layouts give the same losses (so the snippet cannot rot)."""

import os
import re

from tests.dist_harness import run_ranks

PAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "docs", "own_model.md"
)


def snippet() -> str:
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"<!-- snippet: own-model .*?-->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/own_model.md lost its own-model snippet"
    return match.group(1)


def _run(rank, world, code):
    scope = {"__name__": "__main__"}
    exec(compile(code, "docs/own_model.md:own-model", "exec"), scope)
    return scope["losses"]


def test_readme_snippet_runs_and_dp_matches():
    code = snippet()
    tp2 = run_ranks(2, _run, code, timeout=60)
    tp2_dp2 = run_ranks(4, _run, code, timeout=60)
    losses = tp2[0]
    assert len(losses) == 10 and losses[-1] < losses[0], losses
    assert tp2[1] == losses  # TP ranks agree
    diff = max(abs(a - b) / b for a, b in zip(tp2_dp2[0], losses, strict=True))
    assert diff < 1e-5, f"tp2 vs tp2 x dp2: max relative loss difference {diff:.2e}"
