#!/usr/bin/env bash
# GPU check of the fused kernels in one command (at most 4 + 3.5 minutes on one H200, plus at
# most 2.7 minutes for step 3 where TE or flash-attn is installed):
#   1. tests/kernels with the compiled Triton kernels, including the bf16/fp16 cases that the
#      CPU interpreter skips;
#   2. the reduced benchmark (tools/bench_kernels.py --quick) into $OUT_DIR (default runs/bench_kernels);
#   3. when Transformer Engine / flash-attn are installed: 20 bf16 training steps on one GPU with
#      the local backends, then TE linears, TE linears in FP8 and flash-attn (compare the losses).
# Extra arguments go to the benchmark, e.g. `tools/gpu_check.sh --providers triton,torch`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-runs/bench_kernels}"

python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU is visible (torch.cuda.is_available() is False)")
print(f"gpu_check.sh: {torch.cuda.get_device_name()}, torch {torch.__version__}")
PY

# compiled kernels, not the interpreter; automatic dispatch (Triton on CUDA tensors)
unset TRITON_INTERPRET MEGATRON_LITE_KERNELS
echo "== tests/kernels (fp32 + bf16 + fp16 on the GPU)"
timeout 240 python -m pytest tests/kernels -q -rs
echo "== reduced benchmark -> ${OUT_DIR}"
timeout 210 python tools/bench_kernels.py --quick --rep-ms 50 --out-dir "${OUT_DIR}" "$@"

echo "== GPU backends (only those installed): 20 bf16 steps each on mock data"
SMOKE=(--config configs/smoke.yaml train.precision=bf16 train.steps=20 model.hidden_size=256
       model.num_attention_heads=8 model.seq_length=256 log.interval=5)
run() { echo "-- $*"; timeout 40 python -m megatron_lite.train "${SMOKE[@]}" "$@" | grep -E "step|error"; }
has_te=$(python -c "import transformer_engine.pytorch" 2>/dev/null && echo 1 || echo 0)
has_flash=$(python -c "import flash_attn" 2>/dev/null && echo 1 || echo 0)
if [ "$has_te" = 0 ] && [ "$has_flash" = 0 ]; then
  echo "-- neither transformer_engine nor flash_attn is installed: nothing to compare"
  exit 0
fi
run model.attention_backend=sdpa  # the reference curve
if [ "$has_te" = 1 ]; then
  run model.linear_backend=te
  run model.linear_backend=te model.fp8=hybrid
fi
if [ "$has_flash" = 1 ]; then
  run model.attention_backend=flash
fi
