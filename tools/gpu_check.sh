#!/usr/bin/env bash
# The acceptance run on a fresh GPU node, in one command: installs what is missing
# (pip install -e ".[dev]"; install the CUDA build of torch you want first), then runs
# tools/gpu_check.py: the kernel tests with compiled Triton kernels in fp32/bf16/fp16, the kernel
# benchmark, a ~1B Llama for 30 bf16 steps per backend (plain, selective and full recompute,
# TE, TE FP8 and flash-attn where installed) with tokens/s, TFLOP/s and MFU, the allocator's
# peak beside the planner's and the dry run's, a save and resume. A pass/fail line per item;
# one JSON report, its path printed last; exit 0 when nothing failed.
#   tools/gpu_check.sh                   # on one GPU (target: 8 minutes on an H200)
#   tools/gpu_check.sh --cpu             # the same on CPU with a tiny model (the suite runs it)
# Other arguments go to tools/gpu_check.py (--out-dir, --data, --budget-s; see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
SECONDS=0
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then
  if [[ " $* " != *" --cpu "* ]]; then
    echo "gpu_check.sh: torch is not installed: install a CUDA build of torch first" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q torch==2.13.0  # the CPU wheel, as quickstart.sh
fi
# installed (any megatron_lite install, e.g. `pip install -e .`) with what this command needs
# (found, not imported: an import of torch costs seconds)
"$PYTHON" -c "import importlib.metadata as m, importlib.util as u, sys; m.version('megatron_lite')
sys.exit(any(u.find_spec(x) is None for x in sys.argv[1:]))" pytest pytest_timeout 2>/dev/null ||
    "$PYTHON" -m pip install -q -e ".[dev]"
exec "$PYTHON" tools/gpu_check.py --install-s "$SECONDS" "$@"
