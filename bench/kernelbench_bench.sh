#!/usr/bin/env bash
# On a GPU machine, in one run: build, validate (CUDA, at the files' own sizes) and
# time the imported KernelBench level-2 modules against eager PyTorch and torch.compile,
# within BUDGET seconds (default 560); JSON and Markdown go to $OUT.
#
# Import first, on any machine (the KernelBench files are read where they lie):
#   python3 bench/kernelbench_import.py --kernelbench DIR --no-all   # -> build/kernelbench/specs
# then carry build/kernelbench/specs to the GPU machine and run this script there.
# Problems the budget does not reach are listed; run again with START=<number> on the
# same machine (its builds are kept).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
python3 bench/kernelbench_gpu.py --specs build/kernelbench/specs --out "$OUT" \
  --phase "${PHASE:-all}" --budget "${BUDGET:-560}" --check-until "${CHECK_UNTIL:-0.7}" --start "${START:-0}" ${ONLY:+--only "$ONLY"} 2>&1 | tee "$OUT/kernelbench_gpu.log"
