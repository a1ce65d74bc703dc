#!/usr/bin/env bash
# On the GPU machine: A/B of a template change on imported KernelBench problems, in one run.
# The working tree is B; A is the same tree with templates/ taken from BASE (a folder holding a
# templates/ tree, and a kgen/ tree where the plans differ, prepared on this side, e.g. for the last commit:
#   mkdir -p build/ab/base && git archive HEAD templates kgen | tar -x -C build/ab/base
# carry build/ab and build/kernelbench/specs). Both are built at once; B is validated
# (kernelbench_gpu.py's check: the float64 reference with the adversarial cases, KernelBench's
# own check); then both are timed in the same process order, eager beside each.
#   ONLY=15,34,58 BASE=build/ab/base bash bench/kernelbench_ab.sh
# TRAINING=1 times in training mode (default: eval mode, as kgen bench).
set -uo pipefail
ONLY=${ONLY:?problem numbers, comma-separated}
BASE=${BASE:-build/ab/base}
BUDGET=${BUDGET:-500}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KGEN_TARGET=${KGEN_TARGET:-default}
SPECS=$PWD/build/kernelbench/specs
A=/tmp/kgen-ab-base
rm -rf "$A" && mkdir -p "$A" && cp -a kgen bench pyproject.toml "$A"/ && cp -a "$BASE/templates" "$A/templates"
if [ -d "$BASE/kgen" ]; then rm -rf "$A/kgen" && cp -a "$BASE/kgen" "$A/kgen"; fi  # a plan change: BASE's kgen/ too
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
kb() {  # kb TREE GEN STATE PHASE [args]: kernelbench_gpu.py of TREE
  local tree=$1 gen=$2 state=$3 phase=$4; shift 4
  (cd "$tree" && PYTHONPATH=$tree python3 bench/kernelbench_gpu.py --specs "$SPECS" --gen "$gen" --state "$state" \
    --out "$OUT/$(basename "$gen")" --only "$ONLY" --phase "$phase" --no-compile "$@")
}
kb "$A" /tmp/gen_a /tmp/state_a.json build --jobs 8 --budget "$(left)" > "$OUT/build_a.txt" 2>&1 &
kb "$PWD" /tmp/gen_b /tmp/state_b.json build --jobs 8 --budget "$(left)" 2>&1 | tail -3
wait; tail -3 "$OUT/build_a.txt"
kb "$PWD" /tmp/gen_b /tmp/state_b.json check --check-jobs 4 --budget $(( $(left) / 2 )) 2>&1 | tail -12
# A is timed only where B validated (the state file says which), eager beside each
cp /tmp/state_b.json /tmp/state_a.json
# two rounds of B then A, each call its share of the time left (re-timing rows the last round timed)
calls=4
for round in 1 2; do
  for side in b a; do
    tree=$PWD; [ $side = a ] && tree=$A
    kb "$tree" /tmp/gen_$side /tmp/state_$side.json time --budget $(( $(left) / calls )) ${TRAINING:+--training} 2>&1 | grep -E "^ *[0-9]+ kb2" | sed "s/^/${side^^}$round /"
    calls=$((calls - 1))
    python3 -c "
import json, sys
p = sys.argv[1]; d = json.load(open(p))
for r in d['rows']:
    r['status'] = 'validated' if r['status'] == 'ok' else r['status']
open(p, 'w').write(json.dumps(d))" /tmp/state_$side.json
  done
done
cp /tmp/state_a.json "$OUT/state_a.json"; cp /tmp/state_b.json "$OUT/state_b.json"
