#!/usr/bin/env bash
# On a GPU machine: KernelBench level 3's convolutional and MLP problems (1-27 and 45) end to end:
# `kgen import` of each (the CPU's cores), then bench/kernelbench_gpu.py: build, validate against float64
# at the files' own sizes, KernelBench's own check, and eager / torch.compile / kgen timed in one process
# (training mode, as KernelBench's evaluator runs the models), eager's cuDNN precision of each convolution
# measured first (`kgen tune --precision-only`, kernelbench_gpu.py's default). KernelBench is read where it lies (KB: a
# checkout, its level3 folder, or a bare git mirror); reports go to $OUT. Specs already in $WORK/specs (imported
# on a CPU machine and carried) are not imported again.
#
#   KB=~/KernelBench OUT=out BUDGET=500 bash bench/kernelbench_level3.sh
#   GPU_ONLY=2,3,7 PHASE=time MODE=" " ...   (some problems; one phase; eval mode: MODE set to a space)
set -uo pipefail
KB=${KB:?the KernelBench checkout (KB=...)}
OUT=${OUT:-gpu-out}
ONLY=${ONLY:-1-27,45}
BUDGET=${BUDGET:-500}
WORK=${WORK:-build/kernelbench3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ -z "$(ls "$WORK"/specs/*.yaml 2>/dev/null)" ]; then  # imported already (on a CPU machine, carried): skip
  python3 bench/kernelbench_import.py --kernelbench "$KB" --level 3 --only "$ONLY" --no-all --jobs "$(nproc)" \
    --timeout 300 --work "$WORK" --report "$OUT/kernelbench_level3_import.md" | cut -c1-220
fi
python3 bench/kernelbench_gpu.py --specs "$WORK/specs" --gen "$WORK/generated_gpu" --state "$WORK/gpu_state.json" \
  --out "$OUT" --phase "${PHASE:-all}" --budget "$BUDGET" ${MODE:---training} ${GPU_ONLY:+--only "$GPU_ONLY"}
