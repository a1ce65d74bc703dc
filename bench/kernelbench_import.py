#!/usr/bin/env python3
"""Import every KernelBench problem of a level (2: fused chains, 3: whole models) with `kgen import`,
run `kgen all` on each, and write a report: status and, for each failure, the reason.

The KernelBench files are read where they lie (--kernelbench: the level2 folder of a
checkout, or a KernelBench repository root); nothing of them is copied into the
repository. Specs and modules go to --work (default build/kernelbench, ignored by
git). Each problem runs in its own processes (import, then all), --jobs at a time,
each with a time limit.

    python3 bench/kernelbench_import.py --kernelbench ~/KernelBench --jobs 2
    python3 bench/kernelbench_import.py --kernelbench DIR --only 1,12,92 --no-all
    python3 bench/kernelbench_import.py --kernelbench DIR --level 3 --only 1-27,45 --no-all

On the GPU machine, --device cuda validates the CUDA build at the files' own sizes
(the example batch too) instead of the CPU build with small batches.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kgen.bench import _commit, _utc_now  # noqa: E402  (one format for every report's commit and date)


def checkout(kernelbench: Path, work: Path, level: int) -> Path:
    """A bare git repository of KernelBench (a mirror) is read with `git archive` into the
    work folder (outside the repository); a folder is used as it is."""
    if (kernelbench / "HEAD").is_file() and (kernelbench / "objects").is_dir():
        dest = work / "kernelbench_src"
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(kernelbench), "archive", "HEAD", f"KernelBench/level{level}"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return dest
    return kernelbench


def problems(kernelbench: Path, level: int) -> list[Path]:
    """The level's files, ordered by problem number."""
    folder = kernelbench
    for sub in (f"KernelBench/level{level}", f"level{level}"):
        if (kernelbench / sub).is_dir():
            folder = kernelbench / sub
    files = [p for p in folder.glob("*.py") if re.match(r"\d+_", p.name)]
    if not files:
        sys.exit(f"no level-{level} problems (NUMBER_NAME.py) under {kernelbench}")
    return sorted(files, key=lambda p: int(p.name.split("_")[0]))


def module_name(path: Path, level: int = 2) -> str:
    """kb<level>_<number>_<name>, shortened to fit kgen's 64 characters."""
    number, _, rest = path.stem.partition("_")
    name = f"kb{level}_{number}_" + re.sub(r"[^a-z0-9]+", "_", rest.lower()).strip("_")
    return name[:64].rstrip("_")


def _run(cmd: list[str], timeout: int, env: dict) -> tuple[int, str, float]:
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        return p.returncode, p.stdout + p.stderr, time.time() - start
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\ntimed out after {timeout} s", time.time() - start


def _reason(output: str) -> str:
    """The line that says why: kgen's one-line error, else a failing case, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("kgen: error:"):
            return ln[len("kgen: error:"):].strip()
    for ln in lines:
        if ln.startswith("FAIL "):
            return ln[5:]
    return lines[-1] if lines else "no output"


def one(path: Path, args, env: dict) -> dict:
    name = module_name(path, args.level)
    spec = args.work / "specs" / f"{name}.yaml"
    row = {"problem": path.stem, "number": int(path.name.split("_")[0]), "module": name}
    if args.import_ or not spec.exists():
        rc, out, secs = _run([sys.executable, "-W", "ignore", "-m", "kgen", "import", str(path), "--name", name,
                              "--out", str(args.work / "specs")], args.timeout, env)
        row["import_s"] = round(secs, 1)
        if rc != 0:
            row.update(status="import failed", reason=_reason(out))
            return row
    if not args.all:
        row["status"] = "imported"
        return row
    cmd = [sys.executable, "-W", "ignore", "-m", "kgen", "all", str(spec), "--out", str(args.work / "generated")]
    if args.device:
        cmd += ["--device", args.device]
    if args.example_batch:
        cmd += ["--example-batch"]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    rc, out, secs = _run(cmd, args.timeout, env)
    row["all_s"] = round(secs, 1)
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    (args.work / "logs" / f"{name}.txt").write_text(out)
    table = [ln for ln in out.splitlines() if ln.startswith(name + " ")]
    if table:
        cells = table[-1].split()
        row["cases"] = cells[3] if len(cells) > 3 else ""
    if rc == 0:
        row["status"] = "ok"
    else:
        row.update(status="build failed" if "building" in out and "built" not in out else "validation failed",
                   reason=_reason(out))
    return row


def plan_summary(spec: Path) -> str:
    """The stages of the spec's plan, e.g. conv + pool_reduce."""
    try:
        from kgen.ir import load_pipeline
        from kgen.plan import make_plan
        from kgen.target import DEFAULT

        plan = make_plan(load_pipeline(spec), target=DEFAULT)
        return " + ".join(s.family.name for s in plan.stages)
    except Exception as e:  # noqa: BLE001 - a report line, not a crash
        return f"(plan failed: {type(e).__name__})"


def write_report(rows: list[dict], args, started: str) -> None:
    rows = sorted(rows, key=lambda r: r["number"])
    ok = sum(r["status"] == "ok" for r in rows)
    imported = sum(r["status"] != "import failed" for r in rows)
    lines = [
        f"# KernelBench level {args.level}: `kgen import`" + (" + `kgen all`" if args.all else ""),
        "",
        (f"{ok} of {len(rows)} problems import, build and validate; " if args.all else "")
        + f"{imported} of {len(rows)} import. "
        f"Device: {args.device or 'cpu (the C++ build)'}; started {started}; "
        f"commit {_commit()}; `python3 bench/kernelbench_import.py {' '.join(sys.argv[1:])}`.",
        "",
        "Validation is `kgen all`'s: the float64 reference built from the imported spec, on normal, NaN, "
        f"large, tied, non-contiguous inputs (batch {args.batch or '1 to 3'}; with --example-batch also the file's own), "
        "in training and eval mode where batch norm or dropout make them differ, plus the drop-in "
        "`Model(*get_init_inputs())` check and each fused stage on adversarial values.",
        "",
        "| # | problem | status | cases | stages | import s | all s | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spec = args.work / "specs" / f"{r['module']}.yaml"
        stages = plan_summary(spec) if spec.exists() and r["status"] != "import failed" else ""
        reason = (r.get("reason") or "").replace("|", "\\|")
        lines.append(f"| {r['number']} | {r['problem']} | {r['status']} | {r.get('cases', '')} | {stages} | "
                     f"{r.get('import_s', '')} | {r.get('all_s', '')} | {reason} |")
    failures: dict[str, int] = {}
    for r in rows:
        if r["status"] != "ok":
            failures[r["status"]] = failures.get(r["status"], 0) + 1
    lines += ["", "Failures by kind: " + (", ".join(f"{k}: {v}" for k, v in sorted(failures.items())) or "none"), ""]
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("\n".join(lines))
    args.report.with_suffix(".json").write_text(json.dumps({"rows": rows, "device": args.device or "cpu"}, indent=1) + "\n")


def numbers(text: str) -> set[int]:
    """Problem numbers from ``1,12,20-27``."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def job_threads(jobs: int) -> int:
    """Threads per job: this process's cores shared among the jobs running at a time."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, jobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernelbench", type=Path, required=True,
                    help="KernelBench checkout, its level folder, or a bare git mirror of it")
    ap.add_argument("--level", type=int, choices=(2, 3), default=2, help="KernelBench level")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "kernelbench", help="specs, modules and logs")
    ap.add_argument("--report", type=Path, default=None,
                    help="default: reports/kernelbench_level<N>_<device>.md for a whole run; with --only, or without kgen all,\n"
                         "under --work (a partial run does not replace the committed report)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="problems at a time; each job's processes get OMP_NUM_THREADS and MKL_NUM_THREADS =\n"
                         "max(1, cores // jobs) (torch would otherwise run each with every core, and parallel\n"
                         "imports of big models would oversubscribe the machine)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per step of a problem")
    ap.add_argument("--only", default="", help="comma-separated problem numbers or ranges (1-27,45)")
    ap.add_argument("--no-all", dest="all", action="store_false", help="import only")
    ap.add_argument("--no-import", dest="import_", action="store_false", help="reuse the specs already imported")
    ap.add_argument("--device", default=None, help="kgen all --device (default: cpu here, cuda where there is one)")
    ap.add_argument("--example-batch", action="store_true", help="also validate at each file's own batch")
    ap.add_argument("--batch", type=int, default=None,
                    help="kgen all --batch: every end-to-end case at this batch (default: 1 on the CPU, batches 1 to 3 "
                         "on a GPU)")
    args = ap.parse_args()
    if args.batch is None and (args.device or "cpu").startswith("cpu"):
        args.batch = 1
    args.work = args.work.resolve()
    if args.report is None:
        whole = not args.only and args.all
        device = "cpu" if (args.device or "cpu").startswith("cpu") else "cuda"
        report = f"kernelbench_level{args.level}_{device}.md"
        args.report = ROOT / "reports" / report if whole else args.work / report
    files = problems(checkout(args.kernelbench.expanduser(), args.work, args.level), args.level)
    if args.only:
        wanted = numbers(args.only)
        files = [f for f in files if int(f.name.split("_")[0]) in wanted]
    args.work = args.work.resolve()
    (args.work / "specs").mkdir(parents=True, exist_ok=True)
    threads = str(job_threads(min(max(1, args.jobs), max(1, len(files)))))
    env = dict(os.environ, PYTHONPATH=str(ROOT), KGEN_TARGET=os.environ.get("KGEN_TARGET", "default"),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    started = _utc_now()
    rows = []
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(one, f, args, env): f for f in files}
        for fut in cf.as_completed(futures):
            try:
                row = fut.result()
            except Exception as e:  # noqa: BLE001 - one problem's crash (a full disk, a bad file) is its row
                f = futures[fut]
                row = {"problem": f.stem, "number": int(f.name.split("_")[0]), "module": module_name(f, args.level),
                       "status": "error", "reason": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(f"{row['number']:3d} {row['module']:60s} {row['status']:18s} {row.get('reason', '')[:150]}", flush=True)
            write_report(rows, args, started)
    write_report(rows, args, started)
    print(f"{sum(r['status'] == 'ok' for r in rows)}/{len(rows)} ok; report: {args.report}")


if __name__ == "__main__":
    main()
