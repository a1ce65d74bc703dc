#!/usr/bin/env bash
# On the GPU machine: the turned-around window loop (pair_window.cu) beside conv_gemm's window loop on the
# same convolution (KernelBench #87's, stored with its bias), one machine, one call.
#   bash scripts/conv_lab/pair_window/run.sh
set -uo pipefail
cd "$(dirname "$0")"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I../../../templates -Xptxas -v pair_window.cu -o /tmp/pair_window 2>&1 | grep -E "error|registers|spill"
/tmp/pair_window
cd ../../..
PYTHONPATH=. KGEN_TARGET=default python scripts/conv_lab/time_specs.py scripts/conv_lab/specs/e87_convonly.yaml --profile 2>&1 | grep -v "^kgen:"
