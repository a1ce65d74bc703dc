#!/usr/bin/env bash
# On a GPU machine: the whole test suite, the slow set included (-m "slow or not slow"; the README's command
# leaves it out), one pytest per test file, JOBS files at a time (each builds its own modules; one GPU serves all).
# Per file: a line with its exit code, seconds and pytest's summary; its log in $OUT/tests/FILE.log.
# Usage: JOBS=6 OUT=gpu-out bash bench/gpu_tests.sh [tests/test_a.py ...]   (default: every file with a test)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/tests"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT
MARKS="slow or not slow"
export MARKS
if [ $# -gt 0 ]; then
  files=$(printf '%s\n' "$@")
else  # the files with the most tests first, so that the longest start early
  files=$(python3 -m pytest --collect-only -q -p no:cacheprovider -m "$MARKS" 2>/dev/null | grep "::" | cut -d: -f1 \
    | sort | uniq -c | sort -rn | awk '{print $2}')
fi
one_file() {
  local f=$1 name start rc
  name=$(basename "$f" .py); start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider -m "$MARKS" "$f" > "$OUT/tests/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s: $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/tests/$name.log" | tail -1)"
}
export -f one_file
echo "$files" | xargs -P "${JOBS:-6}" -I{} bash -c 'one_file {}' | tee "$OUT/tests/summary.txt"
! grep -q "rc=[1-9]" "$OUT/tests/summary.txt"
