#!/usr/bin/env bash
# On the GPU machine: the norm kernels' layouts (tests/conftest.py NORM_LAYOUTS: a warp or
# blocks per group's statistics; apply over channels, over all outputs, or a warp per
# position) rendered and built under build/norm_layouts, validated (with the specs'
# own batch), then compute-sanitizer memcheck, racecheck and synccheck on their kernels.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_TARGET=default
DIR=build/norm_layouts; rm -rf "$DIR"; mkdir -p "$DIR/specs"
python - "$DIR/specs" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import NORM_LAYOUTS, norm_layout_spec
for name in NORM_LAYOUTS:
    norm_layout_spec(name, Path(sys.argv[1]))
PY
python -m kgen render "$DIR"/specs/*.yaml --out "$DIR/gen" > /dev/null
python -m kgen build --out "$DIR/gen" --device cuda 2>&1 | grep -v '^kgen:   ' | tail -3
python -m kgen validate --out "$DIR/gen" --device cuda --example-batch 2>&1 | tee "$OUT/norm-layouts-validate.txt" | tail -8
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool $tool --kernel-name kns=kgen --error-exitcode 3 \
    python bench/sanitize_stages.py "$DIR/gen" > "$OUT/norm-layouts-$tool.txt" 2>&1
  echo "$tool (norm layouts): exit $?; $(grep -c '^ok' "$OUT/norm-layouts-$tool.txt") cases ok; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/norm-layouts-$tool.txt" | tail -1)"
done
