#!/usr/bin/env bash
# GPU check in one command (steps 1-2 at most 4 + 3.5 minutes on one H200; step 3 at most
# 80 s, plus 40 s per TE / flash-attn run where they are installed):
#   1. tests/kernels with the compiled Triton kernels, including the bf16/fp16 cases that the
#      CPU interpreter skips;
#   2. the reduced benchmark (tools/bench_kernels.py --quick) into $OUT_DIR (default runs/bench_kernels);
#   3. 20 bf16 training steps on one GPU saving at step 10, a resume from it (the losses must
#      repeat), then where installed TE linears, TE FP8, TE on GPT and flash-attn (compare).
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

echo "== training on the GPU: 20 bf16 steps on mock data (save at 10, resume, then the GPU backends)"
RUN_DIR="${OUT_DIR}/train"
SMOKE=(--config configs/smoke.yaml train.precision=bf16 train.steps=20 model.hidden_size=256
       model.num_attention_heads=8 model.seq_length=256 log.interval=5
       train.out_dir="${RUN_DIR}")
run() { echo "-- $*"; timeout 40 python -m megatron_lite.train "${SMOKE[@]}" "$@" | grep -E "step|rror"; }
losses() { grep -E "^step +(15|20)/" | sed -E 's/ \| lr.*//'; }  # "step N/20 | loss X"
run model.attention_backend=sdpa train.resume=none train.save_interval=10 | tee "${RUN_DIR}.ref"
# fused AdamW's state must come back on the GPU and the run continue exactly
run model.attention_backend=sdpa train.resume="${RUN_DIR}/checkpoints/step_10" | tee "${RUN_DIR}.res"
if [ "$(losses < "${RUN_DIR}.ref")" != "$(losses < "${RUN_DIR}.res")" ]; then
  echo "gpu_check.sh: the resumed run's losses at steps 15 and 20 differ from the unbroken run's"
  exit 1
fi
if python -c "import transformer_engine.pytorch" 2>/dev/null; then
  run model.linear_backend=te train.resume=none
  run model.linear_backend=te model.fp8=hybrid train.resume=none
  run model.linear_backend=te model.arch=gpt train.resume=none  # biases: dtypes as local
else
  echo "-- transformer_engine is not installed: TE linear/FP8 runs skipped"
fi
if python -c "import flash_attn" 2>/dev/null; then
  run model.attention_backend=flash train.resume=none
else
  echo "-- flash_attn is not installed: flash-attn run skipped"
fi
