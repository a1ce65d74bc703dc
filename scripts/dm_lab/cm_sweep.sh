#!/bin/bash
# dm_lab kernel_cm.cu (or LAB_SRC) variants on the GPU machine: the default checked in full, the rest checked quickly and timed.
# VARIANTS="defs|defs|..." overrides the list (each entry a space-separated LAB_DEFS).
cd "$(dirname "$0")/../.."
export LAB_SRC=${LAB_SRC:-kernel_cm.cu} PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python scripts/dm_lab/run.py 2>&1 | tail -14
IFS='|' read -ra VS <<< "${VARIANTS:-LAB_BUFS=1 LAB_MINB=2|LAB_WH=2 LAB_BUFS=1 LAB_MINB=3|LAB_WH=2}"
for v in "${VS[@]}"; do
  echo "== $v"
  LAB_DEFS="$v" LAB_QUICK=1 python scripts/dm_lab/run.py 2>&1 | grep -E "registers|spill|CHECK|nan_inf|Error|error" | tail -4
  LAB_DEFS="$v" LAB_TIME_ONLY=1 python scripts/dm_lab/run.py 2>&1 | tail -1
done
