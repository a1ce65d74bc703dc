#!/usr/bin/env bash
# On the GPU machine: render check, CUDA build, validation (with the no-rewrite
# baseline), compute-sanitizer memcheck + racecheck on kgen's own kernels.
# Logs go to $OUT (or ./gpu-out). Usage: bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"
python -m kgen render --check 2>&1 | tee "$OUT/render.txt"
python -m kgen build 2>&1 | grep -v '^kgen:   ' | tee "$OUT/build.txt"
python -m kgen validate --baseline -v 2>&1 | grep -v '^kgen:   ' | tee "$OUT/validate.txt"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --kernel-name kns=kgen_ --error-exitcode 3 \
    python -m kgen validate 2>&1 | grep -v '^kgen:   ' | tail -25 | tee "$OUT/sanitizer-$tool.txt"
  echo "compute-sanitizer $tool exit ${PIPESTATUS[0]}" | tee -a "$OUT/sanitizer-$tool.txt"
done
