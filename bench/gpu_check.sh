#!/usr/bin/env bash
# On the GPU machine: render (writes the shared headers git ignores) and check
# that generated/ is committed as rendered, CUDA build, validation (with the
# no-rewrite baseline), compute-sanitizer memcheck + racecheck + synccheck on
# kgen's own kernels, then a quick bench. Logs go to $OUT (or ./gpu-out).
# Usage: bash bench/gpu_check.sh          (the whole suite on the GPU machine: bash bench/gpu_tests.sh)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_TARGET=default
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/device.txt"
python -m kgen render > /dev/null && python -m kgen render --check 2>&1 | tee "$OUT/render.txt"
python -m kgen build 2>&1 | grep -v '^kgen:   ' | tail -6 | tee "$OUT/build.txt"
python -m kgen validate --baseline -v 2>&1 | grep -v '^kgen:   ' > "$OUT/validate.txt"; grep -v "^  ok" "$OUT/validate.txt"
# memcheck over the whole validation (kgen's kernels instrumented, cuDNN not);
# racecheck and synccheck over kgen's kernels alone (racecheck fails inside
# some of PyTorch's own kernels on this machine).
compute-sanitizer --tool memcheck --kernel-name kns=kgen --error-exitcode 3 \
  python -m kgen validate > "$OUT/sanitizer-memcheck-validate.txt" 2>&1
echo "memcheck (kgen validate): exit $?; $(grep 'ERROR SUMMARY' "$OUT/sanitizer-memcheck-validate.txt")"
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool $tool --kernel-name kns=kgen --error-exitcode 3 \
    python bench/sanitize_stages.py > "$OUT/sanitizer-$tool-stages.txt" 2>&1
  echo "$tool (stage kernels): exit $?; $(grep -c '^ok' "$OUT/sanitizer-$tool-stages.txt") cases ok; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK' "$OUT/sanitizer-$tool-stages.txt" | tail -1)"
done
