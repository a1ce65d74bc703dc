#!/usr/bin/env bash
# On the GPU machine: tune the shipped specs and the variant specs (kgen tune),
# render with the new tuning files, build, validate on CUDA, and bench (with the
# roofline plot). Every output is written in place (specs/**/NAME.tune.json,
# generated/, reports/) and copied under $OUT. Progress lines start with [gpu_tune].
#
#   bash scripts/gpu_tune.sh                # everything (about 10-15 minutes on an H100)
#   PHASE=tune bash scripts/gpu_tune.sh     # call 1: measure, write the tuning files
#   PHASE=bench bash scripts/gpu_tune.sh    # call 2: render, build, validate, bench
#
# Between two calls on a fresh copy of the tree, the tuning files of call 1 come
# from $OUT/specs (copy them into specs/) or, on a machine that stayed warm, from
# .kgen-cache/gpu_tune/ (ignored by git, so it survives): phase bench restores a
# missing one from there and says so.
# Environment: OUT (default gpu-out), REPS (30), SHIPPED_BATCHES (""),
# VARIANT_BATCHES ("1 8"): the batches tuned besides each spec's example.
set -uo pipefail
OUT=${OUT:-gpu-out}
PHASE=${PHASE:-all}
REPS=${REPS:-30}
SHIPPED_BATCHES=${SHIPPED_BATCHES:-}
VARIANT_BATCHES=${VARIANT_BATCHES:-1 8}
CACHE=.kgen-cache/gpu_tune
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KGEN_COMMIT=${KGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT" "$CACHE" reports
log() { echo "[gpu_tune $(date +%H:%M:%S)] $*"; }
quiet() { grep -v '^kgen:   ' || true; }  # drop ninja's per-file lines
batch_flags() { for b in $1; do printf -- "--batch %s " "$b"; done; }
SHIPPED=(specs/*.yaml)
VARIANTS=(specs/variants/*.yaml)

save_tune_files() {  # in place -> $OUT and the cache
  for f in specs/*.tune.json specs/variants/*.tune.json; do
    [ -e "$f" ] || continue
    mkdir -p "$OUT/$(dirname "$f")" "$CACHE/$(dirname "$f")"
    cp "$f" "$OUT/$f"; cp "$f" "$CACHE/$f"
  done
}

if [ "$PHASE" = all ] || [ "$PHASE" = tune ]; then
  log "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python -c "import torch; print('[gpu_tune] torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  log "tune: ${#SHIPPED[@]} shipped specs at their example batch ${SHIPPED_BATCHES:+and $SHIPPED_BATCHES}"
  python -m kgen tune "${SHIPPED[@]}" --reps "$REPS" $(batch_flags "$SHIPPED_BATCHES") 2>&1 | quiet | tee "$OUT/tune-shipped.txt"
  log "tune: ${#VARIANTS[@]} variant specs at their example batch and $VARIANT_BATCHES"
  python -m kgen tune "${VARIANTS[@]}" --reps "$REPS" $(batch_flags "$VARIANT_BATCHES") 2>&1 | quiet | tee "$OUT/tune-variants.txt"
  save_tune_files
  { echo "# kgen tune on $(python -c 'import torch; print(torch.cuda.get_device_name())') (commit $KGEN_COMMIT)"; echo
    echo '## shipped specs'; echo; echo '```'; sed -n '/^spec  /,$p' "$OUT/tune-shipped.txt"; echo '```'; echo
    echo '## variant specs (specs/variants/)'; echo; echo '```'; sed -n '/^spec  /,$p' "$OUT/tune-variants.txt"; echo '```'
  } > reports/tune-h100.md
  cp reports/tune-h100.md "$OUT/"
  log "tune: done; tuning files in place and under $OUT/specs"
fi

if [ "$PHASE" = all ] || [ "$PHASE" = bench ]; then
  for spec in "${SHIPPED[@]}" "${VARIANTS[@]}"; do
    f=${spec%.yaml}.tune.json
    if [ ! -e "$f" ] && [ -e "$CACHE/$f" ]; then cp "$CACHE/$f" "$f"; log "restored $f from $CACHE (copy it into the tree)"; fi
    [ -e "$f" ] || log "WARNING: no $f: the cost model chooses for ${spec}"
  done
  log "render: shipped specs into generated/, variants into generated_variants/"
  python -m kgen render 2>&1 | tee "$OUT/render.txt"
  python -m kgen render "${VARIANTS[@]}" --out generated_variants 2>&1 | tee -a "$OUT/render.txt"
  mkdir -p "$OUT/generated"
  for d in generated/*/; do [ -e "$d/plan.json" ] && mkdir -p "$OUT/$d" && cp "$d"/*.* "$OUT/$d"; done
  cp generated/*.h "$OUT/generated/"
  log "build"
  python -m kgen build 2>&1 | quiet | tail -8
  python -m kgen build --out generated_variants 2>&1 | quiet | tail -16
  log "validate on cuda"
  python -m kgen validate 2>&1 | quiet | tee "$OUT/validate.txt" | tail -8
  python -m kgen validate --out generated_variants 2>&1 | quiet | tee "$OUT/validate-variants.txt" | tail -16
  log "bench: shipped specs (with the no-rewrite baseline)"
  python -m kgen bench --reps "$REPS" --json reports/h100-tuned.json --markdown reports/h100-tuned.md \
    --plot reports/h100-tuned.png 2>&1 | quiet | tee "$OUT/bench-shipped.txt"
  log "bench: variant specs"
  python -m kgen bench --out generated_variants --no-baseline --reps "$REPS" --json reports/variants-h100.json \
    --markdown reports/variants-h100.md --plot reports/variants-h100.png 2>&1 | quiet | tee "$OUT/bench-variants.txt"
  log "shipped specs against reports/h100.md (kgen ms before and after tuning)"
  python scripts/compare_bench.py reports/h100.json reports/h100-tuned.json | tee reports/h100-tuned-vs-before.md
  cp reports/h100-tuned.* reports/variants-h100.* reports/h100-tuned-vs-before.md "$OUT/" 2>/dev/null
  log "bench: done; reports in place (reports/) and under $OUT"
fi
