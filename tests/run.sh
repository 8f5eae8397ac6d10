#!/usr/bin/env bash
# The test command of the README's quickstart (and of CI): the whole suite on CPU.
# pytest exits 5 when it collected no tests; that is a failure here, never a pass.
set -u
cd "$(dirname "$0")/.."
python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
