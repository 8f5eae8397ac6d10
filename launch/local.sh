#!/bin/bash
# Train on this machine: as many ranks as the config's layout needs (tp·pp·cp·dp), via torchrun.
#
#   launch/local.sh --config configs/quickstart.yaml [section.key=value ...]
#   launch/local.sh --max-restarts 1 --config configs/smoke.yaml train.resume=auto
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m megatron_lite.launch "$@"
