#!/usr/bin/env bash
# On the GPU machine: tune the shipped specs and the variant specs (kgen tune),
# render with the new tuning files, build, validate on CUDA, and bench (with the
# roofline plots). Every output is written in place (specs/**/NAME.tune.json,
# generated/, reports/shipped_DEV.* and reports/variants_DEV.*, DEV from the GPU's
# name: h100, h200, ...) and copied under $OUT. Progress lines start with [gpu_tune].
#
#   bash bench/gpu_tune.sh                          # everything (~15 min)
#   PHASE=tune bash bench/gpu_tune.sh               # first half: measure, write the tuning files (~7 min)
#   PHASE=bench bash bench/gpu_tune.sh              # second half: render, build, validate, bench (~8 min)
#   PHASE=tune SETS=variants bash bench/gpu_tune.sh # one set only (shipped | variants)
#
# Between the halves on a fresh copy of the tree, the tuning files come from $OUT/specs
# (copy them into specs/ and commit them) or, on a machine that stayed warm, from
# .kgen-cache/gpu_tune/ (ignored by git, so it survives): phase bench restores a
# missing one from there and says so.
# Environment: OUT (default gpu-out), DEV (h100, h200, ...: from the GPU's name), REPS (30), SETS ("shipped variants"),
# SHIPPED_BATCHES (""), VARIANT_BATCHES ("1 8"): batches tuned besides each spec's
# example; VARIANT_MAX_CANDIDATES (6): candidates measured per variant spec.
set -uo pipefail
OUT=${OUT:-gpu-out}
PHASE=${PHASE:-all}
SETS=${SETS:-shipped variants}
REPS=${REPS:-30}
SHIPPED_BATCHES=${SHIPPED_BATCHES:-}
VARIANT_BATCHES=${VARIANT_BATCHES:-1 8}
VARIANT_MAX_CANDIDATES=${VARIANT_MAX_CANDIDATES:-6}
CACHE=.kgen-cache/gpu_tune
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_COMMIT=${KGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DEV=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]{3}|a[0-9]{2,3}|l[0-9]{1,2}' | head -1 | tr A-Z a-z)}
DEV=${DEV:-gpu}
mkdir -p "$OUT" "$CACHE" reports
log() { echo "[gpu_tune $(date +%H:%M:%S)] $*"; }
quiet() { grep -v '^kgen:   ' || true; }  # drop ninja's per-file lines
batch_flags() { for b in $1; do printf -- "--batch %s " "$b"; done; }
has_set() { [[ " $SETS " == *" $1 "* ]]; }
SHIPPED=(specs/*.yaml)
VARIANTS=(specs/variants/*.yaml)

save_tune_files() {  # in place -> $OUT and the cache
  for f in specs/*.tune.json specs/variants/*.tune.json; do
    [ -e "$f" ] || continue
    mkdir -p "$OUT/$(dirname "$f")" "$CACHE/$(dirname "$f")"
    cp "$f" "$OUT/$f"; cp "$f" "$CACHE/$f"
  done
}

tune_table() {  # the table kgen tune prints at the end of its log
  echo "## $1"; echo; echo '```'; sed -n '/^spec  /,$p' "$2"; echo '```'; echo
}

if [ "$PHASE" = all ] || [ "$PHASE" = tune ]; then
  log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python -c "import torch; print('[gpu_tune] torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  if has_set shipped; then
    log "tune: ${#SHIPPED[@]} shipped specs at their example batch ${SHIPPED_BATCHES:+and $SHIPPED_BATCHES}"
    python -m kgen tune "${SHIPPED[@]}" --reps "$REPS" $(batch_flags "$SHIPPED_BATCHES") 2>&1 | quiet | tee "$OUT/tune-shipped.txt"
    tune_table "shipped specs" "$OUT/tune-shipped.txt" > "$OUT/tune-shipped.md"
  fi
  if has_set variants; then
    log "tune: ${#VARIANTS[@]} variant specs at their example batch and $VARIANT_BATCHES"
    python -m kgen tune "${VARIANTS[@]}" --reps "$REPS" --max-candidates "$VARIANT_MAX_CANDIDATES" \
      $(batch_flags "$VARIANT_BATCHES") 2>&1 | quiet | tee "$OUT/tune-variants.txt"
    tune_table "variant specs (specs/variants/)" "$OUT/tune-variants.txt" > "$OUT/tune-variants.md"
  fi
  save_tune_files
  log "tune: done; tuning files in place and under $OUT/specs"
fi

if [ "$PHASE" = all ] || [ "$PHASE" = bench ]; then
  for spec in "${SHIPPED[@]}" "${VARIANTS[@]}"; do
    f=${spec%.yaml}.tune.json
    if [ ! -e "$f" ] && [ -e "$CACHE/$f" ]; then cp "$CACHE/$f" "$f"; log "restored $f from $CACHE (copy it into the tree)"; fi
    [ -e "$f" ] || log "WARNING: no $f: the cost model chooses for ${spec}"
  done
  if has_set shipped; then
    log "render, build, validate: shipped specs (generated/)"
    python -m kgen render 2>&1 | tee "$OUT/render-shipped.txt"
    for d in generated/*/; do [ -e "$d/plan.json" ] && mkdir -p "$OUT/$d" && cp "$d"/*.* "$OUT/$d"; done
    cp generated/*.h "$OUT/generated/"
    python -m kgen build 2>&1 | quiet | tail -6
    python -m kgen validate 2>&1 | quiet | tee "$OUT/validate-shipped.txt" | tail -8
    log "bench: shipped specs (with the no-rewrite baseline)"
    [ -e "reports/shipped_$DEV.json" ] && cp "reports/shipped_$DEV.json" "$OUT/shipped-before.json"
    python -m kgen bench --reps "$REPS" --json "reports/shipped_$DEV.json" --markdown "reports/shipped_$DEV.md" \
      --plot "reports/shipped_$DEV.png" 2>&1 | quiet | tee "$OUT/bench-shipped.txt"
    if [ -e "$OUT/shipped-before.json" ]; then
      log "shipped specs against the previous reports/shipped_$DEV.json (kgen ms before and after tuning)"
      python bench/compare_bench.py "$OUT/shipped-before.json" "reports/shipped_$DEV.json" | tee "$OUT/shipped-vs-before.md"
    fi
    cp "reports/shipped_$DEV".* "$OUT/" 2>/dev/null
  fi
  if has_set variants; then
    log "render, build, validate: variant specs (generated_variants/)"
    python -m kgen render "${VARIANTS[@]}" --out generated_variants 2>&1 | tee "$OUT/render-variants.txt"
    python -m kgen build --out generated_variants 2>&1 | quiet | tail -16
    python -m kgen validate --out generated_variants 2>&1 | quiet | tee "$OUT/validate-variants.txt" | tail -16
    log "bench: variant specs"
    python -m kgen bench --out generated_variants --no-baseline --reps "$REPS" --json "reports/variants_$DEV.json" \
      --markdown "reports/variants_$DEV.md" --plot "reports/variants_$DEV.png" 2>&1 | quiet | tee "$OUT/bench-variants.txt"
    cp "reports/variants_$DEV".* "$OUT/" 2>/dev/null
  fi
  log "bench: done; reports in place (reports/) and under $OUT"
fi
