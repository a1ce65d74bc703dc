#!/usr/bin/env python3
"""On the GPU machine: build, validate and time the imported KernelBench level-2 modules,
within a time budget, writing JSON and Markdown under --out as it goes.

Input: the specs `scripts/kernelbench_import.py` wrote (build/kernelbench/specs; carry
that folder to the GPU machine). Three phases, each stopping at its share of --budget:

1. render every spec (for this GPU) and build the CUDA modules, --build-jobs at a time;
2. `kgen validate --device cuda --example-batch` of each built module: the CUDA build
   against the float64 reference, at batches 1 to 3 and at the file's own batch;
3. time each validated module at the file's own sizes, as `kgen bench` does (CUDA
   events, warm-up, median of --reps): eager PyTorch (the reference model in float32)
   and kgen for all, then torch.compile (default mode) while time is left.

Problems the budget did not reach are listed as such; run again with --start NUMBER
(builds of a warm machine are reused). Everything runs in this one process, so a CUDA
error that poisons the context ends the run; the report says where.

    python3 scripts/kernelbench_gpu.py --specs build/kernelbench/specs --out "$OUT" --budget 560
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def number_of(spec: Path) -> int:
    try:
        return int(spec.stem.split("_")[1])
    except (IndexError, ValueError):
        return 10**6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", type=Path, default=ROOT / "build" / "kernelbench" / "specs")
    ap.add_argument("--gen", type=Path, default=ROOT / "build" / "kernelbench" / "generated_gpu")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for all three phases")
    ap.add_argument("--build-share", type=float, default=0.5, help="share of the budget for building")
    ap.add_argument("--validate-share", type=float, default=0.2, help="share for validating")
    ap.add_argument("--build-jobs", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--start", type=int, default=0, help="skip problems numbered below this")
    ap.add_argument("--only", default="", help="comma-separated problem numbers")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    args = ap.parse_args()
    t0 = time.time()
    deadline = {"build": t0 + args.budget * args.build_share,
                "validate": t0 + args.budget * (args.build_share + args.validate_share),
                "end": t0 + args.budget}
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from kgen.bench import environment, time_interleaved, time_ms
    from kgen.ir import load_pipeline
    from kgen.reference import ReferenceModel
    from kgen.render import render_spec, write_rendered
    from kgen.validate import import_module_dir, init_args, validate

    specs = sorted(args.specs.glob("*.yaml"), key=number_of)
    if args.only:
        wanted = {int(v) for v in args.only.split(",")}
        specs = [s for s in specs if number_of(s) in wanted]
    specs = [s for s in specs if number_of(s) >= args.start]
    rows = {s.stem: {"number": number_of(s), "module": s.stem, "status": "not reached (time box)"} for s in specs}
    env = environment()

    def write():
        ordered = sorted(rows.values(), key=lambda r: r["number"])
        (args.out / "kernelbench_gpu.json").write_text(json.dumps({"environment": env, "rows": ordered}, indent=1) + "\n")
        (args.out / "kernelbench_gpu.md").write_text(markdown(ordered, env, args, time.time() - t0))

    # 1. render and build
    args.gen.mkdir(parents=True, exist_ok=True)
    for s in specs:
        try:
            write_rendered(render_spec(s, args.gen), args.gen)
        except Exception as e:  # noqa: BLE001
            rows[s.stem].update(status="render failed", reason=_line(e))

    def build(name):
        left = deadline["build"] - time.time()
        if left <= 5:
            return name, None, "not built (time box)"
        cmd = [sys.executable, "-m", "kgen", "build", name, "--out", str(args.gen), "--device", "cuda"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
        except subprocess.TimeoutExpired:
            return name, None, "not built (time box)"
        return name, p.returncode == 0, _last_error(p.stdout + p.stderr)

    todo = [s.stem for s in specs if rows[s.stem]["status"] == "not reached (time box)"]
    with cf.ThreadPoolExecutor(max_workers=max(1, args.build_jobs)) as pool:
        for name, ok, why in pool.map(build, todo):
            if ok is None:
                rows[name]["status"] = why
            elif not ok:
                rows[name].update(status="build failed", reason=why)
            else:
                rows[name]["status"] = "built"
    write()
    print(f"built {sum(r['status'] == 'built' for r in rows.values())}/{len(rows)} in {time.time() - t0:.0f} s", flush=True)

    # 2. validate
    for s in specs:
        row = rows[s.stem]
        if row["status"] != "built":
            continue
        if time.time() > deadline["validate"]:
            row["status"] = "built, not validated (time box)"
            continue
        try:
            rep = validate(s, args.gen / s.stem, "cuda", example_batch=True)
            row["cases"] = f"{sum(c.passed for c in rep.cases)}/{len(rep.cases)}"
            row["rel_l2"] = rep.worst_rel_l2()
            if rep.passed:
                row["status"] = "validated"
            else:
                bad = next(c for c in rep.cases if not c.passed)
                row.update(status="validation failed", reason=f"{bad.case}: {bad.problem}")
        except Exception as e:  # noqa: BLE001
            row.update(status="validation failed", reason=_line(e))
            if "CUDA error" in str(e):
                write()
                sys.exit(f"CUDA error at {s.stem}; resume with --start {row['number'] + 1}")
        write()
        print(f"{row['number']:3d} {s.stem}: {row['status']} {row.get('reason', '')[:120]}", flush=True)

    # 3. time: eager and kgen for every validated module, then torch.compile while time is left
    models = {}
    for s in specs:
        row = rows[s.stem]
        if row["status"] != "validated":
            continue
        if time.time() > deadline["end"] - 20:
            row["status"] = "validated, not timed (time box)"
            continue
        try:
            pipe = load_pipeline(s)
            mod = import_module_dir(args.gen / s.stem)
            batch = pipe.example_batch()
            torch.manual_seed(0)
            model = mod.Model(*init_args(mod)).cuda().eval()
            ref = ReferenceModel(pipe).cuda().eval()
            ref.load_state_dict(model.state_dict())
            inputs = [torch.randn(pipe.inputs[n].concrete(batch), device="cuda") for n in pipe.input_names]
            with torch.no_grad():
                timed = time_interleaved({"eager_ms": lambda: ref(*inputs), "kgen_ms": lambda: model(*inputs)}, args.reps)
                row.update(timed)
            row.update(status="ok", batch=batch)
            models[s.stem] = (ref, inputs)
        except Exception as e:  # noqa: BLE001
            row.update(status="timing failed", reason=_line(e))
            if "CUDA error" in str(e):
                write()
                sys.exit(f"CUDA error at {s.stem}; resume with --start {row['number'] + 1}")
        write()
        print(f"{row['number']:3d} {s.stem}: eager {row.get('eager_ms', 0):.3f} ms, kgen {row.get('kgen_ms', 0):.3f} ms",
              flush=True)
        torch.cuda.empty_cache()
    if args.compile:
        for name, (ref, inputs) in models.items():
            if time.time() > deadline["end"] - 30:
                break
            row = rows[name]
            try:
                compiled = torch.compile(ref)
                with torch.no_grad():
                    row["compile_ms"] = time_ms(lambda: compiled(*inputs), args.reps)
            except Exception as e:  # noqa: BLE001
                row["compile_error"] = _line(e)
            write()
            torch._dynamo.reset()
    write()
    print(f"done in {time.time() - t0:.0f} s: {args.out / 'kernelbench_gpu.md'}", flush=True)


def _line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()
    return text[0][:300] if text else type(e).__name__


def _last_error(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def _f(v):
    return "-" if v is None else f"{v:.3f}"


def markdown(rows, env, args, elapsed) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    lines = [
        f"# KernelBench level 2 on {env['device']}: validation and timings",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), commit {env['commit']}, {env['date']}; "
        f"{elapsed:.0f} s of a {args.budget:.0f} s budget. Validation: `kgen validate --device cuda --example-batch` "
        "(the CUDA build against the float64 reference, batches 1 to 3 and the file's own). Timings at the file's own "
        f"sizes, eval mode: median of {args.reps} runs after warm-up, CUDA events, eager and kgen in turns; eager = the imported model in "
        "PyTorch (float32), torch.compile = the same in default mode.",
        "",
        f"{len(ok)} of {len(rows)} validated and timed.",
        "",
        "| # | module | status | cases | batch | eager ms | torch.compile ms | kgen ms | vs eager | vs compile | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, c, k = r.get("eager_ms"), r.get("compile_ms"), r.get("kgen_ms")
        ve = f"{e / k:.2f}x" if e and k else "-"
        vc = f"{c / k:.2f}x" if c and k else "-"
        reason = (r.get("reason") or r.get("compile_error") or "").replace("|", "\\|")
        lines.append(f"| {r['number']} | {r['module']} | {r['status']} | {r.get('cases', '')} | {r.get('batch', '')} | "
                     f"{_f(e)} | {_f(c)} | {_f(k)} | {ve} | {vc} | {reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
