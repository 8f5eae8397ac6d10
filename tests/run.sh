#!/usr/bin/env bash
# The test command of the README's quickstart (and of CI): installs the test extras if they are
# missing, checks lint and formatting, then runs the whole suite on CPU. Extra arguments go to
# pytest (e.g. bash tests/run.sh tests/unit). pytest exits 5 when it collected no tests; that is
# a failure here, never a pass.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q torch==2.13.0 || exit 1
"$PYTHON" -c "import megatron_lite.kernels, pytest, pytest_timeout, transformers, ruff" \
    2>/dev/null || "$PYTHON" -m pip install -q -e ".[dev]" || exit 1
if [ "$#" -eq 0 ]; then  # the whole suite: lint first (seconds)
    "$PYTHON" -m ruff check . || exit 1
    "$PYTHON" -m ruff format --check . || exit 1
fi
"$PYTHON" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
