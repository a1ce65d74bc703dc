#!/usr/bin/env bash
# On the GPU machine: run several GPU scripts in one device call and pack what they
# write into one archive, $OUT/results.tgz (the device tool returns at most 8 files).
#   bash scripts/device_run.sh "bash scripts/gpu_check.sh" "PHASE=tune bash scripts/gpu_tune.sh"
# Each argument is a command, run in order with OUT set to the archive's folder; the
# tuning files and reports they write in place are packed too (under tree/). The whole
# run stops at DEADLINE seconds (default 570, under the tool's 600), so packing always runs.
# A command sees the seconds left to it in DEVICE_RUN_LEFT (to time-box itself).
set -uo pipefail
# The device copy's git metadata can be older than its tree (stop 29: it named the session's first commit), so
# the reports' commit comes from the caller: KGEN_COMMIT=<hash, evaluated on this side>.
if [ -z "${KGEN_COMMIT:-}" ]; then
  echo "[device_run] KGEN_COMMIT is not set: reports will say 'unknown' (pass the hash of the tree you sent)"
  export KGEN_COMMIT=unknown
fi
FINAL=${OUT:-gpu-out}; mkdir -p "$FINAL"
export OUT=/tmp/kgen-device-out; rm -rf "$OUT"; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_TARGET=${KGEN_TARGET:-default}
DEADLINE=${DEADLINE:-570}
START=$(date +%s)
for cmd in "$@"; do
  left=$((DEADLINE - ($(date +%s) - START)))
  if [ "$left" -le 5 ]; then echo "[device_run] no time left for: $cmd"; continue; fi
  echo "[device_run $(date +%H:%M:%S)] $cmd (${left}s left)"
  DEVICE_RUN_LEFT=$left timeout -k 5 "$left" bash -c "$cmd"
  echo "[device_run $(date +%H:%M:%S)] exit $? <- $cmd"
done
for f in specs/*.tune.json specs/variants/*.tune.json build/kernelbench/specs/*.tune.json reports/*; do
  [ -e "$f" ] && mkdir -p "$OUT/tree/$(dirname "$f")" && cp "$f" "$OUT/tree/$f"
done
tar -czf "$FINAL/results.tgz" -C "$OUT" .
echo "[device_run] packed $(tar -tzf "$FINAL/results.tgz" | wc -l) entries into results.tgz"
