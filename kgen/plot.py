"""`kgen bench --plot FILE.png`: a roofline of kgen's stages and kgen vs eager vs torch.compile.

Left: each stage's achieved FLOP/s against its arithmetic intensity (FLOPs per
byte moved at best), under the device's ceilings (DRAM bandwidth x intensity,
the TF32 tensor-core peak); a stage's achieved bytes/s is its point's height
over its intensity. Right: each pipeline's time in eager PyTorch,
torch.compile and kgen. matplotlib is an optional extra (``pip install
'kgen[plot]'``); ``python -m kgen.plot BENCH.json FILE.png`` plots a saved
`kgen bench --json` result.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import KgenError
from .target import DEFAULT, Target


def plot(result: dict, path: Path, target: Target = DEFAULT) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KgenError("kgen bench --plot needs matplotlib: pip install 'kgen[plot]'") from None
    rows = result["rows"]
    fig, (roof, bars) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.3]})
    # roofline: ceilings, then one point per stage with a measured time
    points = [(r["name"], s) for r in rows for s in r.get("stages", []) if s["ms"] > 0 and s["bytes"] > 0]
    intensities = [s["flops"] / s["bytes"] for _, s in points if s["flops"] > 0] or [1.0]
    lo, hi = min(min(intensities) / 4, 0.01), max(max(intensities) * 4, 1000.0)
    ridge = target.tensor_flops / target.dram_bytes_per_s
    xs = [lo, ridge, hi]
    roof.plot(xs, [min(target.tensor_flops, target.dram_bytes_per_s * x) for x in xs], "k-", lw=2,
              label=f"ceiling: {target.dram_bytes_per_s / 1e12:.1f} TB/s, {target.tensor_flops / 1e12:.0f} TFLOP/s TF32")
    roof.axhline(target.fp32_flops, color="gray", ls=":", lw=1, label=f"{target.fp32_flops / 1e12:.0f} TFLOP/s FP32")
    markers = {"conv": "s", "pool_reduce": "o", "norm": "^", "eager": "D"}
    for name, s in points:
        x = max(s["flops"] / s["bytes"], lo)
        y = max(s["flops"] / (s["ms"] / 1e3), 1e9)
        roof.plot(x, y, markers.get(s["kind"], "x"), ms=7, alpha=0.8)
        roof.annotate(f"{name}:{s['stage']}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    roof.set(xscale="log", yscale="log", xlim=(lo, hi), xlabel="FLOPs per byte (at best)", ylabel="achieved FLOP/s",
             title=f"kgen stages on {result['environment']['device']}")
    roof.legend(fontsize=7, loc="lower right")
    roof.grid(True, which="both", alpha=0.2)
    # kgen vs eager vs torch.compile
    names = [r["name"] for r in rows]
    width = 0.27
    for k, (key, label) in enumerate((("eager_ms", "eager"), ("compile_ms", "torch.compile"), ("kgen_ms", "kgen"))):
        bars.bar([i + (k - 1) * width for i in range(len(rows))], [r[key] for r in rows], width, label=label)
    for i, r in enumerate(rows):
        mark = " (slower)" if r["kgen_ms"] > r["eager_ms"] else ""
        bars.annotate(f"{r['eager_ms'] / r['kgen_ms']:.2f}x{mark}", (i + width, r["kgen_ms"]), fontsize=6, ha="center",
                      xytext=(0, 2), textcoords="offset points", rotation=90)
    bars.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
    bars.set(yscale="log", ylabel="ms (median)", title="kgen vs eager vs torch.compile (label: speedup over eager)")
    bars.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m kgen.plot BENCH.json FILE.png")
    print(plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
