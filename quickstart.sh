#!/usr/bin/env bash
# The main job from a fresh machine: installs what is missing (torch first, so pip never pulls
# a multi-GB CUDA build; an installed torch, e.g. a CUDA one, is kept), then trains the embedded
# default (configs/quickstart.yaml) on 8 local CPU ranks. Extra arguments are config overrides:
#   bash quickstart.sh train.steps=20
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q torch==2.13.0
"$PYTHON" -c "import megatron_lite.kernels, tokenizers" 2>/dev/null ||
    "$PYTHON" -m pip install -q -e .
exec "$PYTHON" -m megatron_lite.launch --config configs/quickstart.yaml "$@"
