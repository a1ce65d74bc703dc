#!/usr/bin/env bash
# On the GPU machine: per-kernel times (torch.profiler), each stage alone, and
# Nsight Compute on the fused stages of the named modules. Logs in $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -m kgen build 2>&1 | grep -v '^kgen:   ' | tail -3
python bench/profile_stages.py "$@" > "$OUT/profile.txt" 2>&1
python bench/profile_stages.py --norewrite "$@" > "$OUT/profile-norewrite.txt" 2>&1
grep -E "^====|alone" "$OUT/profile.txt" "$OUT/profile-norewrite.txt"
ncu --kernel-name regex:"kgen_" --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
  python bench/profile_stages.py --once --norewrite "$@" > "$OUT/ncu.txt" 2>&1
grep -E "^  kgen_|  [a-z_:]+kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|L2 Hit|L1/TEX Hit" "$OUT/ncu.txt" | head -90
