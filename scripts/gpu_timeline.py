"""The timeline of one call of generated modules, as `kgen bench` times it (queue drained
before the call): where each kernel starts and ends, and the idle gaps between them.
For the GPU machine:

    PYTHONPATH=. nsys profile -o /tmp/tl --trace=cuda,nvtx --force-overwrite true \\
        python scripts/gpu_timeline.py relu_group_norm maxpool_sum
    PYTHONPATH=. python scripts/gpu_timeline.py --report /tmp/tl.nsys-rep

The first form runs each module (warm-up, then three timed calls inside NVTX ranges);
the second reads nsys's export and prints, per call, each kernel's start and length
relative to the call's start.
"""
import argparse
import sqlite3
import subprocess
from pathlib import Path

import torch


def run(names):
    from kgen.cli import _spec_of
    from kgen.ir import load_pipeline
    from kgen.validate import import_module_dir

    for name in names:
        d = Path("generated") / name
        pipe = load_pipeline(_spec_of(d))
        mod = import_module_dir(d)
        model = mod.Model().cuda()
        x = torch.randn(pipe.input.concrete(pipe.example_batch()), device="cuda")
        with torch.no_grad():
            for _ in range(5):
                model(x)
            for i in range(3):
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"{name} call {i}")
                model(x)
                torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()


def report(rep: Path):
    sqlite = rep.with_suffix(".sqlite")
    subprocess.run(["nsys", "export", "--type", "sqlite", "--force-overwrite", "true", "-o", str(sqlite), str(rep)], check=True,
                   capture_output=True)
    db = sqlite3.connect(sqlite)
    ranges = [r for r in db.execute("SELECT start, end, COALESCE(text, (SELECT value FROM StringIds WHERE id = textId)) "
                                    "FROM NVTX_EVENTS ORDER BY start").fetchall() if r[2] and " call " in r[2]]
    names = dict(db.execute("SELECT id, value FROM StringIds").fetchall())
    for start, end, text in ranges:
        # kernels and memsets/copies launched inside the range (by their runtime call's correlation id)
        rows = []
        for table, name_col in (("CUPTI_ACTIVITY_KIND_KERNEL", "shortName"), ("CUPTI_ACTIVITY_KIND_MEMSET", None),
                                ("CUPTI_ACTIVITY_KIND_MEMCPY", None)):
            try:
                q = (f"SELECT k.start, k.end, {('k.' + name_col) if name_col else repr(table[20:].lower())} FROM {table} k "
                     "JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId "
                     "WHERE r.start >= ? AND r.start <= ?")
                rows += db.execute(q, (start, end)).fetchall()
            except sqlite3.OperationalError:
                continue
        rows.sort()
        print(f"== {text}: host {(end - start) / 1e3:.1f} us in the range")
        last = start
        for s, e, n in rows:
            label = names.get(n, n) if isinstance(n, int) else n
            print(f"  {(s - start) / 1e3:9.1f} us  +{(e - s) / 1e3:8.1f} us  gap {(s - last) / 1e3:7.1f}  {str(label)[:70]}")
            last = max(last, e)
        if rows:
            print(f"  end {(last - start) / 1e3:.1f} us after the range started")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        run(args.names)


if __name__ == "__main__":
    main()
