#!/usr/bin/env python3
"""KernelBench problems under eager PyTorch, torch.compile (inductor) and torch.compile(backend="kgen").

For each problem (``--level`` and ``--problems``, from KernelBench's folder ``--kernelbench``, never
copied into this project), in one process:

1. the model, ``Model(*get_init_inputs())`` seeded as KernelBench seeds it, on ``--device``, in training
   mode as KernelBench's evaluator runs it (it never calls eval()), under ``torch.no_grad()``;
   each compiled form compiles a copy of it (``copy.deepcopy``: the same weights), as KernelBench builds
   the reference and the candidate apart: a model whose forward changes its own state (a hidden state kept
   between calls) sees each form's calls only;
2. KernelBench's check: ``--trials`` inputs from ``get_inputs()`` (seeds 42, 43, ...; the same seed
   before each model's call, for a model that draws random numbers), ``torch.allclose(atol=rtol=1e-4)``
   of each compiled form against eager (float32, PyTorch's defaults);
3. the median time of each (``kgen.bench.time_in_blocks``: warm-up, turns of blocks of calls, CUDA
   events on a GPU, the wall clock on the CPU), and the first call's time (the compile);
4. the share of kgen's time: under ``torch.profiler``, the device time (CPU time on the CPU) inside the
   generated ops (``kgen::<module>``) over all of the call's;
5. what the backend made of it (``kgen.backend.PARTITIONS``: partitions in kgen, those left eager and why).

Writes ``kernelbench_backend.json`` and ``.md`` under ``--out``:

    python3 bench/kernelbench_backend.py --level 3 --problems 1,4,8,35 --out "$OUT"
    python3 bench/kernelbench_backend.py --device cpu --level 2 --problems 1-3 --batch 2 --reps 5 --out /tmp/kb
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

PROCESS_START = time.perf_counter()  # since then, a row's seconds before its problem (a child's first: imports)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernelbench_gpu import ROOT, _f, _line  # noqa: E402  (also sets the inductor cache folder)

INIT_SEED = 42  # KernelBench seeds the model's construction so
SETTLE_CALLS = 10  # calls of each form between the check and the timing
MEASURING_CALLS = 60  # calls of the backend's form at most, after those, until its graphs have chosen their forms


def problem_numbers(text: str) -> list[int]:
    """``1,4,8`` or ``1-3,35``."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def problem_file(kb: Path, level: int, number: int) -> Path:
    found = sorted((kb / f"level{level}").glob(f"{number}_*.py"))
    if not found:
        raise FileNotFoundError(f"{kb}/level{level}: no problem {number}_*.py")
    return found[0]


def load_problem(path: Path, batch: int | None):
    """The problem's module; with ``batch``, its ``batch_size`` (read by get_inputs) set to it."""
    spec = importlib.util.spec_from_file_location(f"_kb_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if batch is not None and hasattr(mod, "batch_size"):
        mod.batch_size = batch
    return mod


def kgen_share(fn, inputs, device: str, calls: int = 3) -> float | None:
    """Of ``calls`` calls of ``fn``: the time inside kgen's generated ops (``kgen::...``) over the whole's:
    device time on a GPU, CPU time on the CPU."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kgen.runtime import launches_one_by_one

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof, launches_one_by_one():  # kgen's ranges, not one graph
        for _ in range(calls):
            fn(*inputs)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()

    def outermost_kgen(e) -> bool:  # a kgen op's range, not one of its stages' ranges inside it
        if not e.name.startswith("kgen::"):
            return False
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("kgen::"):
                return False
            parent = parent.cpu_parent
        return True

    host = [e for e in events if e.device_type == DeviceType.CPU]
    if cuda:  # each kernel's time counted once, at the host event that launched it (the device's own list also
        # holds a range's span as an annotation: kgen's share came out at 0.5 where kgen ran everything)
        total = sum(e.device_time_total for e in host if e.cpu_parent is None)
        kgen = sum(e.device_time_total for e in host if outermost_kgen(e))
    else:
        total = sum(e.cpu_time_total for e in host if e.cpu_parent is None)
        kgen = sum(e.cpu_time_total for e in host if outermost_kgen(e))
    return kgen / total if total > 0 else None


def compiled_copy(model, **compile_args):
    """``torch.compile`` of a copy of ``model`` (the same weights). A deep copy of an RNN module loses the one
    block of memory its weights share (cuDNN then copies them at every call): flattened again, as the original."""
    import torch

    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, torch.nn.RNNBase):
            m.flatten_parameters()
    return torch.compile(twin, **compile_args)


def run_problem(path: Path, args) -> dict:
    import torch

    from kgen import backend
    from kgen.bench import time_in_blocks

    row = {"problem": path.stem, "status": "ok"}
    device = args.device
    mod = load_problem(path, args.batch)
    torch.manual_seed(INIT_SEED)
    model = mod.Model(*mod.get_init_inputs()).to(device).train()
    before, graphs_before = len(backend.PARTITIONS), len(backend.GRAPHS)

    def measured_graphs() -> list:  # this problem's graphs measured in their forms (kgen.runtime.MeasuredGraph)
        return [m for m in (g["measured"]() for g in backend.GRAPHS[graphs_before:] if g["measured"]) if m is not None]

    forms = {"eager": model}
    if "inductor" not in args.skip:
        forms["inductor"] = compiled_copy(model)
    if "dynamo" not in args.skip:  # Dynamo's graphs run as PyTorch runs them: what Dynamo alone costs a call
        forms["dynamo"] = compiled_copy(model, backend="eager")
    if args.reduce_overhead:  # inductor's graphs replayed as CUDA graphs, as kgen's measured forms may be
        forms["inductor_cg"] = compiled_copy(model, mode="reduce-overhead")
    forms["kgen"] = compiled_copy(model, backend=backend.backend_for_compile(), options={"verbose": args.verbose})

    def inputs_for(seed: int):
        torch.manual_seed(seed)
        return [x.to(device) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]

    def call(fn, xs, seed):
        torch.manual_seed(seed)  # a model that draws random numbers draws the same ones
        return fn(*xs)

    phase = {"start": time.perf_counter()}  # where a row's seconds go (before it, first calls, check, timing, share)
    with torch.no_grad():
        xs = inputs_for(INIT_SEED)
        row["batch"] = next((int(x.shape[0]) for x in xs if isinstance(x, torch.Tensor) and x.dim()), None)
        for name, fn in forms.items():
            t = time.perf_counter()
            try:
                call(fn, xs, INIT_SEED)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                row[f"{name}_first_s"] = round(time.perf_counter() - t, 2)
            except Exception as e:  # noqa: BLE001 - a form that fails is reported, the others go on
                row[f"{name}_error"] = _line(e)
        if args.warm:  # the compiles only, into the caches (a parallel phase before the timed one)
            return row
        phase["first calls"] = time.perf_counter()
        ok = {n: f for n, f in forms.items() if f"{n}_error" not in row}
        passed = {n: 0 for n in ok if n != "eager"}
        worst = {n: 0.0 for n in passed}
        for trial in range(args.trials):
            seed = INIT_SEED + trial
            xs = inputs_for(seed)
            want = call(model, xs, seed)
            for n in passed:
                got = call(ok[n], xs, seed)
                passed[n] += bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4))
                worst[n] = max(worst[n], float((got - want).abs().max()))
        for n in passed:
            row[f"{n}_check"] = f"{passed[n]}/{args.trials} (max diff {worst[n]:.2g})"
        phase["check"] = time.perf_counter()
        xs = inputs_for(INIT_SEED)
        for f in ok.values():  # every form called alike before the timing: the backend's measurement of its graphs'
            for _ in range(SETTLE_CALLS):  # forms takes their first calls (kgen.runtime.MeasuredGraph)
                f(*xs)
        if "kgen" in ok:  # ... and where its partitions measured theirs first, a few more
            for _ in range(MEASURING_CALLS):
                if all(m.is_settled() for m in measured_graphs()):
                    break
                ok["kgen"](*xs)
        timed = time_in_blocks({f"{n}_ms": (lambda f=f: f(*xs)) for n, f in ok.items()}, args.reps, device)
        row.update({k: round(v, 4) for k, v in timed.items()})
        phase["timing"] = time.perf_counter()
        if "kgen" in ok:
            share = kgen_share(ok["kgen"], xs, device)
            row["kgen_share"] = None if share is None else round(share, 3)
            phase["share"] = time.perf_counter()
    marks = list(phase.items())
    row["phase_s"] = {name: round(t - marks[i][1], 1) for i, (name, t) in enumerate(marks[1:])}
    row["phase_s"]["before"] = round(phase["start"] - PROCESS_START, 1)
    made = backend.PARTITIONS[before:]
    row["partitions_kgen"] = sum(1 for p in made if p["module"])
    row["eager_reasons"] = sorted({f"{', '.join(p['calls'][:4])}: {p['reason']}" for p in made if not p["module"]})
    measured = measured_graphs()
    chosen = [c for m in measured for c in m.chosen()]
    row["forms_run"] = ", ".join(f"{c} x{chosen.count(c)}" for c in dict.fromkeys(chosen))
    row["forms_measured"] = [text for m in measured for text in m.choices()]
    runners = [r for r in (p["runner"]() for p in made if p.get("runner")) if r is not None and r.measured]
    row["partitions_as_pytorch"] = sum(1 for r in runners if "eager" in r.measured.chosen())
    row["forms_measured"] += [text for r in runners for text in r.measured.choices() if "runs eager's form" in text]
    if any(k.endswith("_error") for k in row):
        row["status"] = "failed"
    return row


def problem_rows(args, stop_at: float | None):
    """The rows of ``args.problems`` run in this process one after another; none started after ``stop_at``."""
    import gc

    import torch

    global PROCESS_START
    for n in args.problems:
        if stop_at is not None and time.time() > stop_at:
            return
        t = time.time()
        try:
            row = run_problem(problem_file(args.kernelbench, args.level, n), args)
        except Exception as e:  # noqa: BLE001 - one problem's failure is its row
            row = {"problem": f"{args.level}/{n}", "status": "failed", "error": _line(e)}
        yield row | {"number": n, "time_s": round(time.time() - t, 1)}
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        PROCESS_START = time.perf_counter()  # (the next row's seconds before it: from here)


def run_in_child(args) -> None:
    """A child's problems one after another (one interpreter's start for all: ~10-17 s of a row on the GPU
    machine), each row a line of ``args.rows`` as soon as it ends; none started after ``args.stop_at``."""
    with args.rows.open("a") as out:
        for row in problem_rows(args, args.stop_at):
            out.write(json.dumps(row) + "\n")
            out.flush()


def rows_in_children(args, stop_at: float | None):
    """The rows of ``args.problems`` timed by child processes (this script with ``--rows``), one child for as
    many problems as it gets through: a problem that crashes its child (a signal, an abort in a generated op) or
    runs past ``args.timeout`` seconds is its row, and a new child goes on with the rest. Yields each row as it
    ends; stops where the budget (``stop_at``) left the rest unstarted."""
    import subprocess
    import tempfile

    pending = list(args.problems)
    while pending:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.jsonl"
            out.touch()
            argv = _child_argv(args, pending) + ["--rows", str(out)]
            argv += ["--stop-at", str(stop_at)] if stop_at is not None else []
            child = subprocess.Popen(argv, start_new_session=True)  # its group: it and its builds
            seen, last = 0, time.time()
            while True:
                code = child.poll()
                lines = out.read_text().splitlines()
                for line in lines[seen:]:
                    row = json.loads(line)
                    pending.remove(row["number"])
                    yield row
                    last = time.time()
                seen = len(lines)
                if code is not None:
                    break
                limit = args.timeout or 3600.0
                if time.time() - last > limit or (args.deadline is not None and time.time() > args.deadline):
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    n = pending.pop(0)
                    yield {"problem": f"{args.level}/{n}", "status": "failed", "number": n,
                           "error": f"timed out after {limit:g} s", "time_s": round(time.time() - last, 1)}
                    break
                time.sleep(0.5)
            if code is None or not pending:
                continue
            if code == 0:  # the child stopped at the budget: the rest unstarted
                return
            n = pending.pop(0)
            yield {"problem": f"{args.level}/{n}", "status": "failed", "number": n, "error": _ended(code),
                   "time_s": round(time.time() - last, 1)}


def _child_argv(args, problems: list) -> list:
    argv = [sys.executable, str(Path(__file__).resolve()), "--level", str(args.level),
            "--problems", ",".join(map(str, problems)), "--kernelbench", str(args.kernelbench), "--device", args.device,
            "--trials", str(args.trials), "--reps", str(args.reps), "--skip", args.skip, "--out", str(args.out)]
    argv += ["--batch", str(args.batch)] if args.batch is not None else []
    argv += ["--reduce-overhead"] if args.reduce_overhead else []
    return argv + (["--verbose"] if args.verbose else [])


def warm_in_child(n: int, args) -> dict:
    """Problem ``n``'s compiles (its first calls) by a process of its own (this script with ``--warm``), stopped
    after ``args.timeout`` seconds: a crash or a hang is its row."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        child = subprocess.Popen(_child_argv(args, [n]) + ["--warm", "--rows", str(out)],
                                 start_new_session=True)  # its group: it and its builds
        try:
            limit = args.timeout or 3600.0
            code = child.wait(timeout=limit if args.deadline is None
                              else max(5.0, min(limit, args.deadline - time.time())))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return {"problem": f"{args.level}/{n}", "status": "failed", "error": f"timed out after {args.timeout:g} s"}
        written = out.read_text().splitlines() if out.exists() else []
        if written:
            return json.loads(written[0])
        return {"problem": f"{args.level}/{n}", "status": "failed", "error": _ended(code)}


def _ended(code: int) -> str:
    """Why a child ended without its row, from its exit code."""
    why = f"killed by signal {-code}" + (" (SIGKILL: the kernel's out-of-memory killer, most likely)" if code == -9
                                          else "") if code < 0 else f"exit status {code}"
    return f"the process ended without a result: {why}"


def environment(device: str) -> dict:
    import platform

    import torch

    from kgen.bench import _commit, _utc_now

    return dict(device=torch.cuda.get_device_name() if device.startswith("cuda") else (platform.processor() or "cpu"),
                torch=torch.__version__, cuda=torch.version.cuda, commit=_commit(),
                date=_utc_now(), host=platform.node())


def summary(rows) -> list[str]:
    """The table in a few lines: checks passed, geometric means, the problems slower than eager."""
    import math

    timed = [r for r in rows if r.get("eager_ms") and r.get("kgen_ms")]
    if not timed:
        return ["No problem timed."]

    def geomean(key, rows=timed):
        both = [r for r in rows if r.get(key)]
        return math.exp(sum(math.log(r[key] / r["kgen_ms"]) for r in both) / len(both)) if both else float("nan")

    def passed_all(check: str) -> bool:  # "5/5 (max diff ...)"
        got, _, of = check.partition(" ")[0].partition("/")
        return bool(of) and got == of

    passed = {f: sum(1 for r in timed if passed_all(r.get(f"{f}_check", ""))) for f in ("kgen", "inductor")}
    whole = sum(1 for r in timed if r.get("partitions_kgen") and not r.get("eager_reasons"))
    slower = [f"{r['number']} ({r['eager_ms'] / r['kgen_ms']:.2f}x)" for r in timed
              if r["kgen_ms"] > r["eager_ms"] and r.get("partitions_kgen")]
    idle = [f"{r['number']} ({r['eager_ms'] / r['kgen_ms']:.2f}x)" for r in timed
            if r["kgen_ms"] > r["eager_ms"] and not r.get("partitions_kgen")]
    # against inductor where its output passes KernelBench's check (elsewhere its speed is a TF32 call where eager's
    # is fp32-level: the check fails, and kgen, matching eager's precision, is not comparable in speed)
    correct = [r for r in timed if r.get("inductor_ms") and passed_all(r.get("inductor_check", ""))]
    vs_correct = ""
    if correct:
        worst = min(correct, key=lambda r: r["inductor_ms"] / r["kgen_ms"])
        vs_correct = (f" Against inductor where it passes the check ({len(correct)}): geometric mean "
                      f"{geomean('inductor_ms', correct):.2f}x, "
                      f"the least {worst['inductor_ms'] / worst['kgen_ms']:.2f}x ({worst['number']}).")
    graphs = [r for r in timed if r.get("inductor_cg_ms")]
    if graphs:
        vs_correct += (f" Against inductor's CUDA graphs (mode=\"reduce-overhead\", {len(graphs)} rows): geometric mean "
                       f"{geomean('inductor_cg_ms', graphs):.2f}x.")
    alone = [r for r in timed if r.get("dynamo_ms")]
    if alone:  # what the backend adds to Dynamo's own cost (its form measured, its partitions' ops)
        behind = [f"{r['number']} ({r['dynamo_ms'] / r['kgen_ms']:.2f}x)" for r in alone if r["kgen_ms"] > r["dynamo_ms"]]
        vs_correct += (f" Against Dynamo alone ({len(alone)} rows with it): geometric mean {geomean('dynamo_ms', alone):.2f}x;"
                       f" slower on {', '.join(behind) if behind else 'none'}.")
    return [f"**{len(timed)} of {len(rows)} problems timed; geometric mean {geomean('eager_ms'):.2f}x eager, "
            f"{geomean('inductor_ms'):.2f}x inductor. KernelBench's check passed by kgen on {passed['kgen']}, by "
            f"inductor on {passed['inductor']}. {whole} with every partition in kgen, "
            f"{sum(1 for r in timed if not r.get('partitions_kgen'))} with none in kgen.** Slower than eager: "
            + (", ".join(slower) if slower else "none")
            + (f"; with no partition in kgen (Dynamo's guards and its graph of PyTorch's calls): {', '.join(idle)}"
               if idle else "") + "." + vs_correct]


def _when(rows, env) -> str:
    """The commit and date of the rows: the run's, or where rows of earlier runs are kept, each row's."""
    commits = {r.get("commit", env["commit"]) for r in rows}
    if len(commits) <= 1:
        return f"commit {env['commit']}, {env['date']}"
    dates = sorted(r.get("date", env["date"]) for r in rows)
    return f"commit per row (last column), rows of {dates[0]} to {dates[-1]}"


def markdown(rows, env, args) -> str:
    lines = [
        f"# KernelBench level {args.level} under torch.compile(backend=\"kgen\") on {env['device']}",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}), {_when(rows, env)}, device {args.device}"
        + (f", batch {args.batch} (the problems' batch_size replaced)" if args.batch else ", the problems' own sizes") + ". "
        "Training mode as KernelBench runs the models, under torch.no_grad(). KernelBench's check: "
        f"torch.allclose(form, eager, atol=rtol=1e-4) on {args.trials} inputs from get_inputs() (seeds 42...). "
        f"Times: median of {args.reps} calls after warm-up, the forms in turns (blocks of calls), "
        + ("CUDA events" if args.device.startswith("cuda") else "wall clock") + "; first call = compile. "
        "Inductor CUDA graphs: torch.compile(mode=\"reduce-overhead\") (with --reduce-overhead; '-' where not run). "
        "Dynamo alone: torch.compile(backend=\"eager\"), Dynamo's graphs run as PyTorch runs them (its guards' and "
        "graph breaks' cost; '-' in rows timed before this column). Form run: which form of each graph the backend measured fastest and runs (kgen's partitions with the "
        "calls left to PyTorch, or the graph as PyTorch computes it; each directly or replayed as one CUDA graph; "
        "rows timed before ca99707 ran kgen's form directly). "
        "kgen share (of kgen's form): device time inside the generated ops over the call's (torch.profiler; rows timed before "
        "28784b2 counted a stage's range beside its op's, 0.67 where kgen ran everything, rows of 28784b2 to "
        "72b5dc4 the ranges' annotations beside the kernels, 0.5).",
        "",
        *summary(rows),
        "",
        "| problem | batch | eager ms | inductor ms | inductor CUDA graphs ms | Dynamo alone ms | kgen ms | vs eager | vs inductor | inductor check | kgen check | "
        "kgen share | partitions in kgen | form run (per graph) | first call s (inductor / kgen) | left eager / errors | "
        "commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, i, k = r.get("eager_ms"), r.get("inductor_ms"), r.get("kgen_ms")
        notes = "; ".join([*(r[x] for x in r if x.endswith("_error")), *r.get("eager_reasons", [])])
        share = r.get("kgen_share")
        n_slower = r.get("partitions_as_pytorch")
        slower = f" ({n_slower} measured slower: PyTorch's calls)" if n_slower else ""
        lines.append(
            f"| {r['problem']} | {r.get('batch', '')} | {_f(e)} | {_f(i)} | {_f(r.get('inductor_cg_ms'))} | {_f(r.get('dynamo_ms'))} | {_f(k)} | {f'{e / k:.2f}x' if e and k else '-'} | "
            f"{f'{i / k:.2f}x' if i and k else '-'} | {r.get('inductor_check', '-')} | {r.get('kgen_check', '-')} | "
            f"{'-' if share is None else f'{share:.0%}'} | {r.get('partitions_kgen', '')}{slower} | {r.get('forms_run', '')} | "
            f"{r.get('inductor_first_s', '-')} / {r.get('kgen_first_s', '-')} | {notes.replace('|', '/')[:400]} | {r.get('commit', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", type=int, required=True)
    ap.add_argument("--problems", type=problem_numbers, required=True, help="numbers: 1,4,8 or 1-3")
    ap.add_argument("--kernelbench", type=Path, default=ROOT / ".kb" / "KernelBench",
                    help="KernelBench's folder holding level1/ ... level4/")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=None, help="replace the problems' batch_size (small runs)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--skip", default="", help="forms not to run: inductor, dynamo (torch.compile(backend=\"eager\"), Dynamo's cost alone)")
    ap.add_argument("--reduce-overhead", action="store_true",
                    help="also torch.compile(mode=\"reduce-overhead\") (inductor replayed as CUDA graphs)")
    ap.add_argument("--verbose", action="store_true", help="kgen's progress on stderr")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "kb-backend-out")))
    ap.add_argument("--timeout", type=float, default=None,
                    help="run the problems in child processes, one after another in each (one interpreter's start "
                         "for many): a problem that crashes its child or runs past this many seconds is its row, and "
                         "a new child goes on with the rest")
    ap.add_argument("--jobs", type=int, default=1,
                    help="first compile the problems this many at a time, each in a process of its own (their first "
                         "calls fill kgen's and inductor's caches), then check and time them one by one")
    ap.add_argument("--state", type=Path, default=None,
                    help="a JSON report to merge into: its rows for other problems kept, these replaced; written "
                         "after each problem, and the report's .md beside it")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: start no problem (compile or timing) after this long; the rows made so far are "
                         "written")
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)  # (a child's: compile only)
    ap.add_argument("--rows", type=Path, default=None, help=argparse.SUPPRESS)  # (a child's: its rows, a line each)
    ap.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)  # (a child's: start none after)
    args = ap.parse_args()
    if args.rows is not None:  # a child of --timeout: its problems in turn, each row written as it ends
        run_in_child(args)
        return
    if not (args.kernelbench / f"level{args.level}").is_dir():
        sys.exit(f"{args.kernelbench}/level{args.level}: no such folder (KernelBench's; --kernelbench DIR)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    start = time.time()
    # a problem started before the budget's end may run past it by a minute at most (then it is stopped)
    args.deadline = None if args.budget is None else start + args.budget + 60

    def time_left() -> bool:
        return args.budget is None or time.time() - start < args.budget

    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        t = time.time()
        with ThreadPoolExecutor(args.jobs) as pool:
            warmed = list(pool.map(lambda n: warm_in_child(n, args) if time_left() else {}, args.problems))
        failed = [r["problem"] for r in warmed if r.get("status") == "failed"]
        print(f"compiled {len(args.problems)} problems, {args.jobs} at a time, in {time.time() - t:.0f} s"
              + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    earlier = []  # the state's rows: each replaced by this run's row of its problem, the others kept
    if args.state is not None and args.state.exists():
        earlier = json.loads(args.state.read_text())["rows"]
    rows = []
    stop_at = None if args.budget is None else start + args.budget
    for row in rows_in_children(args, stop_at) if args.timeout is not None else problem_rows(args, stop_at):
        rows.append(row)
        print(f"{row['problem']}: eager {_f(row.get('eager_ms'))} ms, inductor {_f(row.get('inductor_ms'))} ms, "
              f"Dynamo alone {_f(row.get('dynamo_ms'))} ms, "
              + (f"inductor CUDA graphs {_f(row.get('inductor_cg_ms'))} ms, " if args.reduce_overhead else "") +
              f"kgen {_f(row.get('kgen_ms'))} ms, check {row.get('kgen_check', '-')}, {row['status']} "
              f"({row['time_s']} s)", flush=True)
        row["commit"], row["date"] = env["commit"], env["date"]
        done = {r["number"] for r in rows}  # (a problem the budget left out keeps its earlier row)
        every = sorted([r for r in earlier if r.get("number") not in done] + rows, key=lambda r: r["number"])
        for path in [args.out / "kernelbench_backend.json"] + ([args.state] if args.state is not None else []):
            path.parent.mkdir(parents=True, exist_ok=True)  # (a state file in a folder not made yet)
            path.write_text(json.dumps({"environment": env, "rows": every}, indent=1) + "\n")
            path.with_suffix(".md").write_text(markdown(every, env, args))
    left = [n for n in args.problems if n not in {r["number"] for r in rows}]
    if left and args.budget is not None:
        print(f"the budget of {args.budget:g} s is spent: problems {','.join(map(str, left))} not run", flush=True)


if __name__ == "__main__":
    main()
