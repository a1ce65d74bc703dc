#!/usr/bin/env bash
# On the GPU machine: Nsight Compute sections and a SASS instruction histogram
# for the fused-stage kernels of the named modules (their stages run once).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -m kgen build 2>&1 | grep -v '^kgen:   ' | tail -1
python bench/profile_stages.py "$@" 2>&1 | grep -E "^====|alone"
ncu --kernel-name regex:"reduce_kernel|stats_kernel|apply_kernel" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats python bench/profile_stages.py --once "$@" > "$OUT/ncu.txt" 2>&1
grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|L1/TEX Hit|L2 Hit|Stall|Grid Size|Warp Cycles Per Issued|Issued Warp" "$OUT/ncu.txt" | head -80
for m in "$@"; do
  obj=$(ls generated/$m/_build/cuda-*/kernel.cuda.o | head -1)
  cuobjdump -sass "$obj" > "$OUT/sass-$m.txt" 2>&1
  echo "== SASS $m reduce/stats kernel instruction mix"
  awk '/Function : .*(reduce|stats)_kernel/{f=1} /Function : .*(finalize|apply)/{f=0} f' "$OUT/sass-$m.txt" | grep -oE "^\s+/\*[0-9a-f]{4}\*/\s+[A-Z0-9]+" | awk '{print $2}' | sort | uniq -c | sort -rn | head -12
done
