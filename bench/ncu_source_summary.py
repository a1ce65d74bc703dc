"""Summarizes an Nsight Compute source page (SASS, CSV) of one kernel: warp stall samples and
executed instructions per opcode, and the hottest instructions with their addresses.

    ncu --kernel-name regex:conv_kernel --launch-skip 5 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python bench/gpu_timeline.py MOD > x.csv
    python bench/ncu_source_summary.py x.csv [--top 40]
"""
import argparse
import csv
import io
from collections import defaultdict


def rows(path: str):
    text = open(path, errors="replace").read()
    start = text.find('"Address"')  # ncu prints the program's own output before the table
    if start < 0:
        start = text.find("Address")
    return list(csv.DictReader(io.StringIO(text[start:])))


def number(v) -> float:
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    table = rows(args.csv)
    if not table:
        print("no source table in", args.csv)
        return
    cols = list(table[0].keys())
    stall = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    execd = next((c for c in cols if c.startswith("Instructions Executed")), None)
    src = next((c for c in cols if c.strip() == "Source"), cols[1])
    reasons = [c for c in cols if c.startswith("stall_") or c.startswith("Stall ")]
    total_s = sum(number(r[stall]) for r in table) or 1.0
    total_e = sum(number(r[execd]) for r in table) or 1.0
    print(f"{len(table)} SASS instructions; stall samples {total_s:.0f}; warp instructions executed {total_e:.0f}")
    by_op = defaultdict(lambda: [0.0, 0.0, 0])
    for r in table:
        op = r[src].split()[0] if r[src].split() else "?"
        if op.startswith("@"):
            op = r[src].split()[1]
        op = op.split(".")[0]
        by_op[op][0] += number(r[stall])
        by_op[op][1] += number(r[execd])
        by_op[op][2] += 1
    print(f"{'opcode':12s} {'stall%':>7s} {'exec%':>7s} {'executed':>12s} {'static':>7s}")
    for op, (s, e, n) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{op:12s} {100 * s / total_s:7.1f} {100 * e / total_e:7.1f} {e:12.0f} {n:7d}")
    print(f"hottest {args.top} by stall samples (address, stall%, executed, source, top stall reasons)")
    for r in sorted(table, key=lambda r: -number(r[stall]))[:args.top]:
        why = sorted(((number(r[c]), c) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{c.replace('stall_', '')}={v:.0f}" for v, c in why if v > 0)
        print(f"  {r['Address']:>8s} {100 * number(r[stall]) / total_s:5.1f} {number(r[execd]):10.0f}  {r[src][:70]:70s} {why}")


if __name__ == "__main__":
    main()
