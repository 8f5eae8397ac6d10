#!/usr/bin/env bash
# The test command of the README's quickstart (and of CI): installs the test extras if they are
# missing, checks lint and formatting, then runs the whole suite on CPU. Extra arguments go to
# pytest (e.g. bash tests/run.sh tests/unit) and run it alone. pytest exits 5 when it collected
# no tests; that is a failure here, never a pass. Tests marked `slow` (more kill points, rarer
# fault forms) are left out of the whole-suite run; CI runs them after it with
# `bash tests/run.sh -m slow`.
#
# The whole suite runs as two pytest processes side by side: the end-to-end launch tests spend
# about a third of their time waiting (torchrun start-up, Slurm daemons, the timeouts they
# provoke), so they and the unit tests run beside the multi-rank and kernel tests. Their output
# follows; the last line sums both runs.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q torch==2.13.0 || exit 1
# installed (any megatron_lite install, e.g. `pip install -e .`) with what this command needs
# (found, not imported: an import of torch costs seconds)
"$PYTHON" -c "import importlib.metadata as m, importlib.util as u, sys; m.version('megatron_lite')
sys.exit(any(u.find_spec(x) is None for x in sys.argv[1:]))" pytest pytest_timeout transformers ruff \
    pyarrow zstandard datasets tensorboard torchao 2>/dev/null ||
    "$PYTHON" -m pip install -q -e ".[dev]" || exit 1

checked() {  # pytest's exit code -> ours: 5 (no tests collected) is a failure
  if [ "$1" -eq 5 ]; then
    echo "error: pytest collected no tests in $2" >&2
    return 1
  fi
  return "$1"
}

# `-m slow` alone (CI's second tier) runs split in two streams like the whole suite; any other
# arguments run one plain pytest
marker="not slow"
lint=1
if [ "$#" -eq 2 ] && [ "$1" = "-m" ] && [ "$2" = "slow" ]; then
  marker="slow"
  lint=0
  set --
fi
if [ "$#" -gt 0 ]; then
  "$PYTHON" -m pytest -q "$@"
  checked $? "$*"
  exit $?
fi

if [ "$lint" -eq 1 ]; then
  "$PYTHON" -m ruff check . || exit 1
  "$PYTHON" -m ruff format --check . || exit 1
fi
logs=$(mktemp -d)
# the GPU acceptance check's CPU run (about 50 s; now in the slow tier, so deselected here)
# belongs to the main stream when it runs
busy=tests/launch/test_gpu_check.py
"$PYTHON" -m pytest -q -m "$marker" -o cache_dir=.pytest_cache/side tests/unit tests/launch \
    --ignore="$busy" >"$logs/side" 2>&1 &
side=$!
trap 'kill "$side" 2>/dev/null; rm -rf "$logs"' EXIT
"$PYTHON" -m pytest -q -m "$marker" tests/parallel tests/kernels "$busy" 2>&1 | tee "$logs/main"
main_rc=${PIPESTATUS[0]}
wait "$side"
side_rc=$?
echo
echo "------------ tests/unit and tests/launch (ran beside tests/parallel, tests/kernels, $busy)"
cat "$logs/side"
checked "$main_rc" "tests/parallel, tests/kernels"
main_rc=$?
checked "$side_rc" "tests/unit, tests/launch"
side_rc=$?
# one closing line for the two runs, from each run's pytest summary line
"$PYTHON" - "$logs/main" "$logs/side" <<'PY'
import re
import sys

counts = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    summary = [ln for ln in open(path, errors="replace") if re.search(r"\d+ (passed|failed|error)", ln)]
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1] if summary else ""):
        counts["failed" if what.startswith("error") else what] += int(n)
print(f"suite: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
PY
[ "$main_rc" -eq 0 ] && [ "$side_rc" -eq 0 ]
