#!/usr/bin/env bash
# One-command GPU check (issues 8 and 14). On a machine with CUDA it runs
#   1. NCCL against CPU: the same short robust training run twice, on the bundled digits (n=4
#      workers, f=1, one Byzantine sign flip, trimmed mean, SGD lr 0.5, 40 steps, seed 0): over NCCL with CUDA
#      tensors and over gloo on the CPU, each with 2 worker processes hosting 2 workers each. It
#      prints both train/loss curves and their largest relative difference, and fails past TOL
#      (default 0.02). NCCL refuses two ranks on one GPU, so with a single GPU the CUDA run has
#      1 NCCL process hosting the 4 workers (and says so). About a minute.
#   2. the GPU tests (tests that skip without CUDA),
#   3. the kernel benchmark on CUDA (n=20, f=4, d=1e6 and 1e7, float32),
#   4. a short simulated training run with CUDA tensors and bf16 autocast,
#   5. the distributed benchmark with NCCL when there are at least 2 GPUs.
# --curves-only runs step 1 alone.
# Exit status: 0 when every step passed, and also without CUDA (it prints "no CUDA device: skipped");
# 1 when the CUDA and CPU loss curves differ by more than TOL; any other code: a step failed.
# Usage: scripts/gpu_check.sh [--curves-only] [OUT_DIR]   (default outputs/gpu_check; TOL=0.02 env)
set -euo pipefail
cd "$(dirname "$0")/.."
CURVES_ONLY=0
if [ "${1:-}" = "--curves-only" ]; then CURVES_ONLY=1; shift; fi
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${1:-outputs/gpu_check}
TOL=${TOL:-0.02}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device: skipped (torch sees no CUDA device; nothing was run)."
  exit 0
fi
mkdir -p "$OUT"
export WANDB_MODE=disabled
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count(), 'torch', torch.__version__)"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
PROCS=2
if [ "$GPUS" -lt 2 ]; then
  PROCS=1
  echo "gpu_check: one GPU: the NCCL run uses 1 process hosting the 4 workers (NCCL needs one GPU per process)."
fi
RUN=(-m experiments.train data=digits threat.n=4 threat.f=1 attack=sign_flip aggregator=trimmed_mean
     optimizer.lr=0.5 trainer.mode=processes "trainer.processes=$PROCS" trainer.steps=40 trainer.eval_every=0 seed=0
     logger=none trainer.progress=false)
"$PY" "${RUN[@]}" trainer.device=cuda trainer.backend=nccl out_dir="$OUT/curve-cuda" 2>&1 | tee "$OUT/curve-cuda.log"
"$PY" "${RUN[@]}" trainer.device=cpu trainer.backend=gloo out_dir="$OUT/curve-cpu" 2>&1 | tee "$OUT/curve-cpu.log"
set +e
"$PY" scripts/compare_curves.py "$OUT/curve-cpu" "$OUT/curve-cuda" --tol "$TOL" --labels cpu "cuda/nccl" \
  | tee "$OUT/curves.txt"
CURVES=${PIPESTATUS[0]}
set -e
if [ "$CURVES" -ne 0 ]; then
  echo "gpu_check: the CUDA/NCCL and CPU/gloo loss curves differ (see $OUT/curves.txt)."
  exit "$CURVES"
fi
if [ "$CURVES_ONLY" -eq 1 ]; then
  echo "gpu_check: done (curves only); logs in $OUT"
  exit 0
fi
"$PY" -m pytest -q -k "cuda or gpu or device" tests 2>&1 | tee "$OUT/tests.log"
"$PY" -m experiments.bench device=cuda 'ns=[20]' 'ds=[1000000,10000000]' naive=false \
  hydra.run.dir="$OUT/bench" 2>&1 | tee "$OUT/bench.log"
"$PY" -m experiments.train trainer.mode=simulated trainer.device=cuda trainer.precision=bf16 trainer.steps=100 \
  trainer.eval_every=50 logger=none trainer.progress=false hydra.run.dir="$OUT/train" 2>&1 | tee "$OUT/train.log"
if [ "$GPUS" -ge 2 ]; then
  "$PY" -m experiments.bench_distributed backend=nccl "worlds=[$GPUS]" 'ds=[10000000]' \
    hydra.run.dir="$OUT/bench_distributed" 2>&1 | tee "$OUT/bench_distributed.log"
else
  echo "gpu_check: one GPU: skipping the NCCL distributed benchmark (NCCL needs one GPU per rank)."
fi
echo "gpu_check: done; logs in $OUT"
