#!/usr/bin/env bash
# On the GPU machine: the test suite's CUDA tests. Usage: bash bench/gpu_tests.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_TARGET=default
python -m kgen render > /dev/null
python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_conv_gemm.py tests/test_autograd.py tests/test_validate.py \
  tests/test_generated.py tests/test_tap_sums.py tests/test_pooled_linear.py tests/test_linear_gemm.py -k "cuda or random_convolutions or phase_pool_kernels or kernelbench or test_cuda" 2>&1 | tee "$OUT/pytest-cuda.txt" | tail -25
