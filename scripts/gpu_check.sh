#!/usr/bin/env bash
# One-command GPU check (issue 8): on a machine with CUDA, runs
#   1. the GPU tests (tests that skip without CUDA),
#   2. the kernel benchmark on CUDA (n=20, f=4, d=1e6 and 1e7, float32),
#   3. a short training run with CUDA tensors (simulated mode: one GPU hosts every worker),
#   4. the distributed benchmark with NCCL when there are at least 2 GPUs.
# Without CUDA it says so and exits 0. Usage: scripts/gpu_check.sh [OUT_DIR]  (default outputs/gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-outputs/gpu_check}
mkdir -p "$OUT"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch; nothing to check."
  exit 0
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
export WANDB_MODE=disabled
"$PY" -m pytest -q -k "cuda or gpu or device" tests 2>&1 | tee "$OUT/tests.log"
"$PY" -m experiments.bench device=cuda 'ns=[20]' 'ds=[1000000,10000000]' naive=false \
  hydra.run.dir="$OUT/bench" 2>&1 | tee "$OUT/bench.log"
"$PY" -m experiments.train trainer.mode=simulated trainer.device=cuda trainer.steps=100 trainer.eval_every=50 \
  logger=none trainer.progress=false hydra.run.dir="$OUT/train" 2>&1 | tee "$OUT/train.log"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  "$PY" -m experiments.bench_distributed backend=nccl "worlds=[$GPUS]" 'ds=[10000000]' \
    hydra.run.dir="$OUT/bench_distributed" 2>&1 | tee "$OUT/bench_distributed.log"
else
  echo "gpu_check: one GPU: skipping the NCCL distributed benchmark (NCCL needs one GPU per rank)."
fi
echo "gpu_check: done; logs in $OUT"
