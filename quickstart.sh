#!/usr/bin/env bash
# The main job from a fresh machine: installs what is missing (torch first, so pip never pulls
# a multi-GB CUDA build; an installed torch, e.g. a CUDA one, is kept), then trains the embedded
# default (configs/quickstart.yaml) on 8 local CPU ranks. Extra arguments are config overrides:
#   bash quickstart.sh train.steps=20
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q torch==2.13.0
# installed (any megatron_lite install, e.g. `pip install -e .`) with what this command needs
# (found, not imported: an import of torch costs seconds)
"$PYTHON" -c "import importlib.metadata as m, importlib.util as u, sys; m.version('megatron_lite')
sys.exit(any(u.find_spec(x) is None for x in sys.argv[1:]))" tokenizers 2>/dev/null ||
    "$PYTHON" -m pip install -q -e .
exec "$PYTHON" -m megatron_lite.launch --config configs/quickstart.yaml "$@"
