#!/usr/bin/env bash
# On a GPU machine: the given specs (default: the shipped ones and specs/small/) in every dtype kgen computes:
# each spec copied with `dtype: [float32, bfloat16, float16]` into $WORK/specs, rendered for this GPU, built,
# and checked by `kgen validate --device cuda` (per dtype: the float64 reference of the rounded inputs, 16-bit
# tolerances, KernelBench's 1e-2 check against eager in the same dtype, poisoned outputs, per-stage cases).
#
#   bash bench/gpu_dtypes.sh [SPECS...]
set -uo pipefail
WORK=${WORK:-build/dtypes}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(specs/*.yaml specs/small/*.yaml)
rm -rf "$WORK" && mkdir -p "$WORK/specs"
for s in "${specs[@]}"; do
  name=$(basename "$s" .yaml)
  sed -e "s/^name: $name\$/name: ${name}_dt/" -e 's/^\(  *\)dtype: float32$/\1dtype: [float32, bfloat16, float16]/' \
      -e 's/\(input: {.*\)dtype: float32/\1dtype: [float32, bfloat16, float16]/' "$s" > "$WORK/specs/${name}_dt.yaml"
done
python -m kgen render "$WORK"/specs/*.yaml --out "$WORK/gen" | tail -1
python -m kgen build --out "$WORK/gen" 2>&1 | grep -v '^kgen:   ' | tail -3
python -m kgen validate --out "$WORK/gen" --device cuda 2>&1 | grep -v '^kgen:   '
