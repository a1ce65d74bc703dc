"""kgen's time per pipeline in two `kgen bench --json` results (before and after), as Markdown.

    python bench/compare_bench.py before.json after.json
"""
import argparse
import json
import sys

NOISE = 1.05  # after / before above this counts as a regression


def main(before_path: str, after_path: str) -> int:
    with open(before_path) as f:
        before = {r["name"]: r for r in json.load(f)["rows"]}
    with open(after_path) as f:
        after = json.load(f)["rows"]
    print("| pipeline | kgen ms before | kgen ms after | after / before | eager ms (after) | vs eager (after) |")
    print("|---|---|---|---|---|---|")
    worse = []
    for r in after:
        b = before.get(r["name"])
        ratio = r["kgen_ms"] / b["kgen_ms"] if b else None
        if ratio is not None and ratio > NOISE:
            worse.append(r["name"])
        shown = "-" if b is None else f"{b['kgen_ms']:.3f}"
        change = "-" if ratio is None else f"{ratio:.2f}"
        print(f"| {r['name']} | {shown} | {r['kgen_ms']:.3f} | {change} | {r['eager_ms']:.3f} | {r['eager_ms'] / r['kgen_ms']:.2f}x |")
    print()
    print(f"slower than before (> {NOISE:.2f}x): {', '.join(worse)}" if worse else "no pipeline is slower than before.")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="`kgen bench --json` of the earlier tree")
    ap.add_argument("after", help="... and of the later one")
    args = ap.parse_args()
    sys.exit(main(args.before, args.after))
