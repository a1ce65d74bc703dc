#!/usr/bin/env python3
"""On the GPU machine: build, validate and time the imported KernelBench level-2 modules,
within a time budget, writing JSON and Markdown under --out as it goes.

Input: the specs `bench/kernelbench_import.py` wrote (build/kernelbench/specs; carry
that folder to the GPU machine). Three phases; --phase picks one or all, and each
phase reads where the previous ones left off from --state (so a warm machine can run
them in consecutive runs, and a fresh one can be handed the state file):

1. build: render every spec (for this GPU) and build the CUDA modules, --jobs at a time;
2. check: in --check-jobs worker processes at a time (correctness only, so they may
   share the GPU): `kgen validate --device cuda --example-batch` of each built module
   (the CUDA build against the float64 reference, at batches 1 to 3 and at the file's
   own batch), then torch.compile of the reference model once, which fills the
   inductor cache (build/inductor_cache) so that the timing phase compiles from it;
3. time: in this one process, nothing else on the GPU, each validated module at the
   file's own sizes as `kgen bench` does: eager PyTorch (the reference model in
   float32), torch.compile (default mode) and kgen, in turns (blocks of consecutive
   calls), CUDA events, median of --reps after warm-up.

Problems a time box did not reach are listed as such; run the phase again. With --only, the state file's rows
of other problems stay; --restart builds, checks and times this run's problems again whatever the state file
says of them (after a commit changed their generated code), and each row records the commit it ran at.

--dtype bfloat16 (or float16) runs everything in that dtype: each spec copied with its input's dtype set
(into --gen's `specs` folder), validated in the dtype (`kgen validate`: the float64 reference of the rounded
inputs, KernelBench's 1e-2 against eager in the dtype), KernelBench's check at 1e-2 against the reference in
the dtype, and eager, torch.compile and kgen timed on the model converted with .to(dtype) (KernelBench's
precision=bf16|fp16). Give each dtype its own --gen and --state.

    python3 bench/kernelbench_gpu.py --specs build/kernelbench/specs --out "$OUT" --phase all --budget 560
    python3 bench/kernelbench_gpu.py --dtype bfloat16 --gen build/kernelbench/gen_bf16 --state build/kernelbench/bf16.json ...
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
# One inductor cache for the check workers and the timing process (before torch is imported).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor_cache"))
PENDING = "not reached (time box)"
FINISHED = ("ok", "render failed", "build failed", "validation failed", "timing failed")


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
    ap.add_argument("--state", type=Path, default=ROOT / "build" / "kernelbench" / "gpu_state.json",
                    help="rows of earlier phases (read if present, always written)")
    ap.add_argument("--phase", choices=["build", "check", "time", "all"], default="all")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for this call")
    ap.add_argument("--build-until", type=float, default=0.35, help="with --phase all: share of the budget for building")
    ap.add_argument("--check-until", type=float, default=0.7, help="with --phase all: share by which checking stops")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 8, help="builds at a time")
    ap.add_argument("--check-jobs", type=int, default=2, help="check workers at a time (then one at a time for those out of GPU memory)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--start", type=int, default=0, help="skip problems numbered below this")
    ap.add_argument("--only", default="", help="comma-separated problem numbers")
    ap.add_argument("--restart", action="store_true",
                    help="build, check and time this run's problems again, whatever the state file says of them "
                         "(the state's other rows stay)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="skip torch.compile's mode=\"reduce-overhead\" (CUDA graphs) in the timing phase")
    ap.add_argument("--training", action="store_true",
                    help="time in training mode (batch norm's batch statistics; KernelBench's own check runs so)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="the models' dtype (16 bits: KernelBench's precision=bf16|fp16, checked at 1e-2)")
    ap.add_argument("--precision", action=argparse.BooleanOptionalAction, default=True,
                    help="float32: first measure eager's cuDNN precision of each spec's convolutions on this GPU "
                         "(`kgen tune --precision-only`, written beside the specs), so the plans match it; "
                         "--no-precision: the untuned rules")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one spec's check, JSON on stdout
    args = ap.parse_args()
    args.precision = args.precision and args.dtype == "float32"  # (16-bit convolutions have no TF32 question)
    if args.worker:
        print("KGEN_ROW " + json.dumps(check_one(args.worker, args.gen, args.compile, args.dtype)), flush=True)
        return
    t0 = time.time()
    deadline = t0 + args.budget
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from kgen.bench import environment

    specs = sorted(args.specs.glob("*.yaml"), key=number_of)
    if args.only:
        wanted = {int(v) for v in args.only.split(",")}
        specs = [s for s in specs if number_of(s) in wanted]
    specs = [s for s in specs if number_of(s) >= args.start]
    if args.dtype != "float32":
        specs = [spec_in_dtype(s, args.dtype, args.gen / "specs") for s in specs]
    rows = {s.stem: {"number": number_of(s), "module": s.stem, "status": PENDING} for s in specs}
    stored = json.loads(args.state.read_text())["rows"] if args.state.exists() else []
    if not args.restart:
        rows.update({r["module"]: r for r in stored if r["module"] in rows})
    # rows of problems outside this run (--only, --start) stay in the state file as they were
    kept = [r for r in stored if r["module"] not in rows]
    env = environment()
    args.commit = env["commit"]  # each timed row records it (a state file can hold rows of several runs)

    def write():
        ordered = sorted(list(rows.values()) + kept, key=lambda r: r["number"])
        text = json.dumps({"environment": env, "rows": ordered}, indent=1) + "\n"
        args.state.parent.mkdir(parents=True, exist_ok=True)
        args.state.write_text(text)
        (args.out / "kernelbench_gpu.json").write_text(text)
        (args.out / "kernelbench_gpu.md").write_text(markdown(ordered, env, args))

    phases = ["build", "check", "time"] if args.phase == "all" else [args.phase]
    if "build" in phases:
        build_all(specs, rows, args, deadline if args.phase == "build" else t0 + args.budget * args.build_until)
        write()
    if "check" in phases:
        check_all(specs, rows, args, deadline if args.phase == "check" else t0 + args.budget * args.check_until, write)
        write()
    if "time" in phases:
        time_all(specs, rows, args, deadline, write)
    write()
    counts = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"done in {time.time() - t0:.0f} s: {counts}", flush=True)
    del torch


def build_all(specs, rows, args, deadline):
    from kgen.render import render_spec, write_rendered

    args.gen.mkdir(parents=True, exist_ok=True)
    # Every module not yet finished is (re)built, also those a previous call checked: on a fresh machine their
    # builds are gone; on a warm one ninja finds them up to date at once. A finished row (timed, or failed for good)
    # needs nothing more.
    specs = [s for s in specs if rows[s.stem]["status"] not in FINISHED]
    if args.precision:
        from kgen.tune import run_precision

        t = time.time()
        run_precision(specs)
        print(f"eager's convolution precision measured in {time.time() - t:.0f} s", flush=True)
    todo = []
    for s in specs:
        try:
            write_rendered(render_spec(s, args.gen), args.gen)
            todo.append(s.stem)
        except Exception as e:  # noqa: BLE001
            rows[s.stem].update(status="render failed", reason=_line(e))

    def build(name):
        left = deadline - time.time()
        if left <= 5:
            return name, None, "not built (time box)"
        cmd = [sys.executable, "-m", "kgen", "build", name, "--out", str(args.gen), "--device", "cuda"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
        except subprocess.TimeoutExpired:
            return name, None, "not built (time box)"
        return name, p.returncode == 0, _last_error(p.stdout + p.stderr)

    t = time.time()
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for name, ok, why in pool.map(build, todo):
            row = rows[name]
            if ok is None:
                row["status"] = why
            elif not ok:
                row.update(status="build failed", reason=why)
            elif row["status"] in (PENDING, "not built (time box)"):
                row["status"] = "built"
    print(f"built {sum(r['status'] == 'built' for r in rows.values())}/{len(rows)} in {time.time() - t:.0f} s", flush=True)


def spec_in_dtype(spec: Path, dtype: str, folder: Path) -> Path:
    """A copy of ``spec`` in ``folder`` whose input (every input) has ``dtype``: the same name, so that its module
    has the float32 module's name (each dtype builds into its own --gen)."""
    import yaml

    data = yaml.safe_load(spec.read_text())
    for inp in [data["input"]] if "input" in data else data["inputs"].values():
        inp["dtype"] = dtype
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / spec.name
    out.write_text(f"# {spec} with its input in {dtype} (bench/kernelbench_gpu.py --dtype)\n"
                   + yaml.safe_dump(data, sort_keys=False))
    return out


def kernelbench_allclose(model, ref, inputs, trials: int = 5, training: bool = True) -> str:
    """KernelBench's own correctness check: kgen's Model and the reference with the same weights
    (kgen.bench.models_and_inputs), in training mode as KernelBench's evaluator runs them (it never
    calls eval(): a batch norm normalizes with the batch's statistics; ``training`` False for a
    dropout with p > 0, which kgen refuses in training mode), `trials` inputs from
    torch.rand shaped as `inputs`, torch.allclose(atol = rtol = 1e-4; 1e-2 for 16-bit models, as its
    precision=bf16|fp16 checks); "k/n", the largest difference, and for the worst trial whose error it is:
    each side's largest difference from the reference run in float64 on the same input (the model's
    16-bit parameters and inputs converted exactly). PyTorch's defaults (cuDNN may use TF32)."""
    import copy

    import torch

    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False  # PyTorch's defaults
    model.train(training), ref.train(training)
    ref64 = copy.deepcopy(ref).double()
    passed, worst, kept = 0, -1.0, None
    tol = 1e-4 if inputs[0].dtype == torch.float32 else 1e-2
    with torch.no_grad():
        for _ in range(trials):
            xs = [torch.rand_like(x) for x in inputs]
            a, b = model(*xs), ref(*xs)
            passed += bool(torch.allclose(a, b, atol=tol, rtol=tol))
            diff = float((a - b).abs().max())
            if diff > worst:
                worst, kept = diff, (xs, a, b)  # the worst trial's inputs and both outputs
        xs, a, b = kept
        exact = ref64(*[x.double() for x in xs])
        kgen_err, eager_err = (float((y.double() - exact).abs().max()) for y in (a, b))
    return (f"{passed}/{trials} (max |diff| {worst:.2g}; off float64: kgen {kgen_err:.2g}, "
            f"eager {eager_err:.2g})")


def check_one(spec: Path, gen: Path, compile_too: bool, dtype: str = "float32") -> dict:
    """In a worker process: validate one built module; then compile its reference once."""
    import torch

    from kgen.bench import models_and_inputs
    from kgen.validate import modes, validate

    row = {}
    t = time.time()
    try:
        rep = validate(spec, gen / spec.stem, "cuda", example_batch=True)
    except Exception as e:  # noqa: BLE001
        return dict(status="validation failed", reason=_line(e), check_s=round(time.time() - t, 1))
    row["cases"] = f"{sum(c.passed for c in rep.cases)}/{len(rep.cases)}"
    row["rel_l2"] = rep.worst_rel_l2()
    row["check_s"] = round(time.time() - t, 1)
    # KernelBench's own criterion, also where a stricter validation case failed (which of the two a problem misses)
    try:
        pipe, _, model, ref, inputs = models_and_inputs(gen / spec.stem, spec, dtype)  # the module and its reference
        refused = modes(pipe) == [False]  # eval mode only: a dropout with p > 0, which kgen refuses in training mode
        row["kb_allclose"] = kernelbench_allclose(model, ref, inputs, training=not refused) + (" (eval mode: dropout)" if refused else "")
    except Exception as e:  # noqa: BLE001
        if rep.passed:
            raise
        row["kb_allclose"] = f"not run: {_line(e)}"
    if not rep.passed:
        bad = next(c for c in rep.cases if not c.passed)
        row.update(status="validation failed", reason=f"{bad.case}: {bad.problem}")
        return row
    row["status"] = "validated"
    if compile_too:
        t = time.time()
        try:
            compiled = torch.compile(ref)
            with torch.no_grad():
                compiled(*inputs)
            torch.cuda.synchronize()
            row["compile_s"] = round(time.time() - t, 1)
        except Exception as e:  # noqa: BLE001
            row["compile_error"] = _line(e)
    return row


def check_all(specs, rows, args, deadline, write):
    def pending(row):  # out of memory: the workers share the GPU; checked again one at a time below
        return row["status"] in ("built", "built, not checked (time box)") or (
            row["status"] == "validation failed" and "out of memory" in row.get("reason", ""))

    todo = [s for s in specs if pending(rows[s.stem])]

    def check(spec):
        left = deadline - time.time()
        if left <= 10:
            return spec, {"status": "built, not checked (time box)"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec), "--gen", str(args.gen), "--dtype", args.dtype]
        if not args.compile:
            cmd.append("--no-compile")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
        except subprocess.TimeoutExpired:
            return spec, {"status": "built, not checked (time box)"}
        for line in reversed(p.stdout.splitlines()):
            if line.startswith("KGEN_ROW "):
                return spec, json.loads(line[len("KGEN_ROW "):])
        return spec, {"status": "validation failed", "reason": "worker died: " + _last_error(p.stdout + p.stderr)}

    for jobs in (args.check_jobs, 1):
        with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for spec, result in pool.map(check, todo):
                row = rows[spec.stem]
                row.pop("reason", None)
                row.update(result)
                write()
                print(f"{row['number']:3d} {spec.stem}: {row['status']} ({row.get('check_s', '-')} s, compile "
                      f"{row.get('compile_s', '-')} s) {row.get('reason', '')[:120]}", flush=True)
        todo = [s for s in todo if pending(rows[s.stem]) and rows[s.stem]["status"] == "validation failed"]


def time_all(specs, rows, args, deadline, write):
    import torch

    from kgen.bench import models_and_inputs, time_in_blocks

    for s in specs:
        row = rows[s.stem]
        if row["status"] not in ("validated", "validated, not timed (time box)"):
            continue
        # its two torch.compile modes (from the inductor cache the check filled) and the timing: a problem that
        # would run past the deadline is left for the next call (a call killed at its limit returns no output)
        if time.time() > deadline - (15 + 2.5 * row.get("compile_s", 20)):
            row["status"] = "validated, not timed (time box)"
            continue
        t = time.time()
        try:
            _, batch, model, ref, inputs = models_and_inputs(args.gen / s.stem, s, args.dtype)
            if args.training:
                model.train(), ref.train()
            fns = {"eager_ms": lambda: ref(*inputs), "kgen_ms": lambda: model(*inputs)}
            with torch.no_grad():
                if args.compile and "compile_error" not in row:
                    try:
                        compiled = torch.compile(ref)
                        compiled(*inputs)
                        fns["compile_ms"] = lambda: compiled(*inputs)
                    except Exception as e:  # noqa: BLE001
                        row["compile_error"] = _line(e)
                if args.compile and args.graphs:
                    try:  # its CUDA-graph mode: the peer of kgen's replay of its kernels
                        graphed = torch.compile(ref, mode="reduce-overhead")
                        for _ in range(3):  # warm-up, record, replay
                            graphed(*inputs)
                        fns["compile_graphs_ms"] = lambda: graphed(*inputs)
                    except Exception as e:  # noqa: BLE001
                        row["compile_graphs_error"] = _line(e)
                row.update(time_in_blocks(fns, args.reps))
            row.update(status="ok", batch=batch, time_s=round(time.time() - t, 1), commit=args.commit,
                       **({"eager_precision": "measured"} if args.precision else {}))
        except Exception as e:  # noqa: BLE001
            row.update(status="timing failed", reason=_line(e))
            if "CUDA error" in str(e):
                write()
                sys.exit(f"CUDA error at {s.stem}; resume with --phase time --start {row['number'] + 1}")
        write()
        print(f"{row['number']:3d} {s.stem}: eager {row.get('eager_ms', 0):.3f} ms, compile "
              f"{row.get('compile_ms', 0):.3f} ms, compile graphs {row.get('compile_graphs_ms', 0):.3f} ms, "
              f"kgen {row.get('kgen_ms', 0):.3f} ms ({time.time() - t:.1f} s)", flush=True)
        del model, ref, inputs, fns
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()
    return text[0][:300] if text else type(e).__name__


def _last_error(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def _f(v):
    return "-" if v is None else f"{v:.3f}"


def level_of(rows) -> str:
    """The KernelBench level of the modules (kb2_..., kb3_...)."""
    levels = {r["module"].split("_")[0].removeprefix("kb") for r in rows}
    return levels.pop() if len(levels) == 1 else "/".join(sorted(levels))


def markdown(rows, env, args) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    faster = sum(1 for r in ok if r["kgen_ms"] < r["eager_ms"])
    faster_c = sum(1 for r in ok if r.get("compile_ms") and r["kgen_ms"] < r["compile_ms"])
    with_c = sum(1 for r in ok if r.get("compile_ms"))
    faster_g = sum(1 for r in ok if r.get("compile_graphs_ms") and r["kgen_ms"] < r["compile_graphs_ms"])
    with_g = sum(1 for r in ok if r.get("compile_graphs_ms"))
    lines = [
        f"# KernelBench level {level_of(rows)} on {env['device']}: validation and timings" + ("" if args.dtype == "float32" else f", {args.dtype}"),
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), commit {env['commit']}, {env['date']}. "
        "Validation: `kgen validate --device cuda --example-batch` (the CUDA build against the float64 reference, "
        "batches 1 to 3 and the file's own, normal and adversarial data). Timings at the file's own sizes, " + ("training" if args.training else "eval") + " mode, "
        f"one process with nothing else on the GPU: median of {args.reps} runs after warm-up, CUDA events, eager, "
        f"torch.compile and kgen in turns (blocks of consecutive calls); eager = the imported model in PyTorch ({args.dtype}), torch.compile = the same "
        "in default mode, torch.compile graphs = the same in mode=\"reduce-overhead\" (CUDA graphs, as kgen's module "
        "replays its kernels where no autograd graph is recorded).",
        "",
        f"{len(ok)} of {len(rows)} validated and timed; kgen faster than eager on {faster}, than torch.compile on "
        f"{faster_c} of {with_c}, than torch.compile's CUDA graphs on {faster_g} of {with_g}.",
        "",
        "KernelBench's check: its evaluator's criterion, in training mode as it runs the models, torch.allclose(kgen, eager, atol = rtol = "
        + ("1e-4" if args.dtype == "float32" else f"1e-2, both in {args.dtype}") + ") on 5 inputs "
        "from torch.rand, the same weights (PyTorch's defaults: cuDNN may use TF32).",
        "",
        "| # | module | status | cases | KernelBench's check | batch | eager ms | torch.compile ms | torch.compile graphs ms | kgen ms | vs eager | vs compile | vs compile graphs | timed at | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, c, g, k = r.get("eager_ms"), r.get("compile_ms"), r.get("compile_graphs_ms"), r.get("kgen_ms")
        ve, vc, vg = (f"{t / k:.2f}x" if t and k else "-" for t in (e, c, g))
        reason = (r.get("reason") or r.get("compile_error") or r.get("compile_graphs_error") or "").replace("|", "\\|")
        lines.append(f"| {r['number']} | {r['module']} | {r['status']} | {r.get('cases', '')} | {r.get('kb_allclose', '')} | {r.get('batch', '')} | "
                     f"{_f(e)} | {_f(c)} | {_f(g)} | {_f(k)} | {ve} | {vc} | {vg} | {r.get('commit', '-')} | {reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
