#!/usr/bin/env bash
# On the GPU machine: kgen bench of every shipped module (with the no-rewrite
# baseline), reports to $OUT. Set KGEN_COMMIT to the commit being measured.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -m kgen build 2>&1 | grep -v '^kgen:   '
python -m kgen bench --reps ${REPS:-30} --json "$OUT/shipped.json" --markdown "$OUT/shipped.md" 2>&1 | grep -v '^kgen:   ' | tee "$OUT/bench.txt"
