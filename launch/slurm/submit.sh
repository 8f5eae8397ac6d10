#!/bin/bash
# Check a run on the login node, then submit train.sbatch.
#
#   launch/slurm/submit.sh NODES GPUS_PER_NODE CONFIG [section.key=value ...]
#   launch/slurm/submit.sh 4 8 configs/quickstart.yaml parallel.tp=8 parallel.dp=4
#   NPROC_PER_NODE=2 launch/slurm/submit.sh 2 0 configs/smoke.yaml ...   # CPU ranks (gloo)
#
# Before anything is queued it validates the config for NODES × GPUS_PER_NODE ranks and
# prepares the data (tokenizer, preprocessing: cached, so compute nodes need no network), so a
# bad config fails here in seconds. GPUS_PER_NODE=0 means CPU mode: NPROC_PER_NODE ranks per
# node on gloo. Extra sbatch options go in SBATCH_ARGS (e.g. "--partition=p --account=a
# --time=24:00:00"); sbatch's own SBATCH_* variables work too. train.sbatch documents the
# environment variables it reads (NCCL settings, MAX_REQUEUES, MAX_RESTARTS, STEP_WAIT_S,
# LOG_ROOT, ...).
# Prints the job id on stdout.
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,15p' "$0" >&2
    exit 2
fi
NODES=$1 GPUS_PER_NODE=$2 CONFIG=$3
shift 3

# Every number is checked with a regex before any arithmetic: bash evaluates a variable's text
# inside $((...)) and [ -gt ] as an expression, so '1+$(cmd)' or 'a[$(cmd)]' would run cmd.
check_count() {  # NAME VALUE MIN FIX: a decimal integer >= MIN (no sign, no leading zeros)
    if ! [[ $2 =~ ^(0|[1-9][0-9]{0,8})$ ]] || [ "$2" -lt "$3" ]; then
        echo "error: $1=${2@Q}: must be an integer >= $3 (digits only, at most 9). Fix: $4" >&2
        exit 2
    fi
}
USAGE_FIX="e.g. launch/slurm/submit.sh 2 8 configs/quickstart.yaml (NODES GPUS_PER_NODE CONFIG)"
check_count NODES "$NODES" 1 "$USAGE_FIX"
check_count GPUS_PER_NODE "$GPUS_PER_NODE" 0 "$USAGE_FIX"
if [ "$GPUS_PER_NODE" -eq 0 ]; then
    check_count NPROC_PER_NODE "${NPROC_PER_NODE:-}" 1 \
        "GPUS_PER_NODE=0 (CPU mode) needs NPROC_PER_NODE=N ranks per node, e.g. NPROC_PER_NODE=2"
fi
# read by train.sbatch on the compute nodes: a typo there would fail only after queueing
for name in MAX_REQUEUES MAX_RESTARTS STEP_WAIT_S; do
    [ -z "${!name:-}" ] || check_count "$name" "${!name}" 0 "set $name to a count, e.g. $name=3"
done
# paths (CONFIG, train.out_dir, logs) stay relative to this directory, where the job runs too
MEGATRON_LITE_ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export MEGATRON_LITE_ROOT PYTHONPATH="$MEGATRON_LITE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}

SBATCH_OPTS=(--nodes="$NODES")
if [ "$GPUS_PER_NODE" -gt 0 ]; then
    SBATCH_OPTS+=(--gpus-per-node="$GPUS_PER_NODE" --exclusive --mem=0)  # whole nodes
    PER_NODE=$GPUS_PER_NODE
else
    PER_NODE=$NPROC_PER_NODE  # checked above: GPUS_PER_NODE=0 (CPU mode) needs it
    export CPU_ONLY=1 NPROC_PER_NODE
fi

# validate for the whole world and prepare the data once, here (exit 2 with one message);
# its output goes to stderr: stdout is the job id
"$PYTHON" - "$((NODES * PER_NODE))" --config "$CONFIG" "$@" >&2 <<'PY'
import sys

from megatron_lite.config import ConfigError
from megatron_lite.data import DataFileError
from megatron_lite.train import prepare, user_error

try:
    prepare(sys.argv[2:], world_size=int(sys.argv[1]), hardware=False)  # no GPU needed here
except (ConfigError, DataFileError) as e:
    user_error(e)
PY

LOG_ROOT=${LOG_ROOT:-$PWD/logs}
export LOG_ROOT
mkdir -p "$LOG_ROOT"
# shellcheck disable=SC2206  # SBATCH_ARGS is a list of options, split on purpose
SBATCH_OPTS+=(--output="$LOG_ROOT/%x-%j.out" ${SBATCH_ARGS:-})
SCRIPT=$MEGATRON_LITE_ROOT/launch/slurm/train.sbatch
JOB=$(sbatch --parsable "${SBATCH_OPTS[@]}" "$SCRIPT" --config "$CONFIG" "$@")
JOB=${JOB%%;*}
echo "submitted job $JOB: $NODES node(s) x $PER_NODE ranks; logs in $LOG_ROOT/ (*-$JOB.out," \
    "*-$JOB/node<N>.log)" >&2
echo "$JOB"
