#!/usr/bin/env bash
# On the GPU machine: the shipped specs whose convolution conv_gemm generates, at
# precision ieee (the direct fp32 loop): render, build, validate, compute-sanitizer
# over their kernels, kgen bench. Logs go to $OUT (or ./gpu-out).
# Usage: bash bench/gpu_ieee.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_TARGET=default
W=${IEEE_DIR:-/tmp/kgen-ieee}; rm -rf "$W"; mkdir -p "$W/specs"
for n in instnorm_clamp_max div_max_gap_bias_sum avgpool_sigmoid_sum; do
  sed "s/^name: $n\$/name: ${n}_ieee/" "specs/$n.yaml" > "$W/specs/${n}_ieee.yaml"
  echo "precision: ieee" >> "$W/specs/${n}_ieee.yaml"
done
python -m kgen render --out "$W/gen" "$W"/specs/*.yaml > /dev/null
python -m kgen build --out "$W/gen" 2>&1 | grep -v '^kgen:   ' | tail -3
python -m kgen build --out "$W/gen" --device cpu 2>&1 | grep -v '^kgen:   ' | tail -1
python -m kgen validate --out "$W/gen" -v 2>&1 | grep -v '^kgen:   ' | tee "$OUT/ieee-validate.txt" | grep -v "^  ok"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --kernel-name kns=kgen --error-exitcode 3 \
    python bench/sanitize_stages.py "$W/gen" > "$OUT/ieee-sanitizer-$tool.txt" 2>&1
  echo "$tool (ieee stage kernels): exit $?; $(grep -c '^ok' "$OUT/ieee-sanitizer-$tool.txt") cases ok; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/ieee-sanitizer-$tool.txt" | tail -1)"
done
python -m kgen bench --out "$W/gen" --no-baseline --reps 20 --json "$OUT/ieee.json" --markdown "$OUT/ieee-bench.md" 2>&1 | grep -v '^kgen:   ' | tail -8
