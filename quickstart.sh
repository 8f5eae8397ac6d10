#!/usr/bin/env bash
# The main job from a fresh machine: installs what is missing (torch first, so pip never pulls
# a multi-GB CUDA build; an installed torch, e.g. a CUDA one, is kept), then trains the embedded
# default (configs/quickstart.yaml) on 8 local CPU ranks. Extra arguments are config overrides:
#   bash quickstart.sh train.steps=20
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q torch==2.13.0
# installed from this tree: run from another folder (as ranks and tools may be), `megatron_lite`
# must resolve to this tree's package, and tokenizers must be found (found, not imported)
(here=$PWD && cd / && "$PYTHON" -c "import importlib.util as u, os, sys
s = u.find_spec('megatron_lite')
mine = s is not None and os.path.realpath(s.origin) == os.path.realpath(sys.argv[1])
sys.exit(not mine or any(u.find_spec(m) is None for m in sys.argv[2:]))" \
    "$here/megatron_lite/__init__.py" tokenizers) 2>/dev/null ||
    "$PYTHON" -m pip install -q -e .
exec "$PYTHON" -m megatron_lite.launch --config configs/quickstart.yaml "$@"
