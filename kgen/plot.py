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
from .target import DEFAULT, KNOWN, Target


def plot(result: dict, path: Path, target: Target | None = None) -> Path:
    """Draw ``result`` (a `kgen bench` result) to ``path``, under ``target``'s ceilings (default: those of the
    device it was measured on, where kgen knows it, else the default target's)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KgenError("kgen bench --plot needs matplotlib: pip install 'kgen[plot]'") from None
    rows = result["rows"]
    target = target or KNOWN.get(result["environment"]["device"], DEFAULT)
    stages = [(r["name"], s) for r in rows for s in r.get("stages", []) if s["ms"] > 0 and s["bytes"] > 0]
    fig, (roof, band, bars) = plt.subplots(1, 3, figsize=(20, 7), gridspec_kw={"width_ratios": [1, 0.8, 1.1]})
    _roofline(roof, stages, target, result["environment"]["device"])
    _bandwidth(band, stages, target)
    _pipelines(bars, rows)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


MARKERS = {"conv": "s", "pool_reduce": "o", "norm": "^", "eager": "D"}


def _roofline(ax, stages, target: Target, device: str) -> None:
    """Achieved FLOP/s over FLOPs per byte, under min(peak, bandwidth x intensity)."""
    intensities = [s["flops"] / s["bytes"] for _, s in stages if s["flops"] > 0] or [1.0]
    lo, hi = min(min(intensities) / 4, 0.01), max(max(intensities) * 4, 1000.0)
    ridge = target.tensor_flops / target.dram_bytes_per_s
    xs = [lo, ridge, hi]
    ax.plot(xs, [min(target.tensor_flops, target.dram_bytes_per_s * x) for x in xs], "k-", lw=2,
            label=f"ceiling: {target.dram_bytes_per_s / 1e12:.1f} TB/s, {target.tensor_flops / 1e12:.0f} TFLOP/s TF32")
    ax.axhline(target.fp32_flops, color="gray", ls=":", lw=1, label=f"{target.fp32_flops / 1e12:.0f} TFLOP/s FP32")
    for name, s in stages:
        x, y = max(s["flops"] / s["bytes"], lo), max(s["flops"] / (s["ms"] / 1e3), 1e8)
        ax.plot(x, y, MARKERS.get(s["kind"], "x"), ms=7, alpha=0.8)
        ax.annotate(f"{name}:{s['stage']}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), xlabel="FLOPs per byte moved (at best)", ylabel="achieved FLOP/s",
           title=f"roofline: kgen's stages on {device}\n(square: conv, circle: pool_reduce, triangle: norm, diamond: eager)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)


def _bandwidth(ax, stages, target: Target) -> None:
    """Each stage's achieved bytes/s against DRAM bandwidth (label: its achieved TFLOP/s)."""
    labels = [f"{name}:{s['stage']} {s['kind']}" for name, s in stages]
    rates = [s["bytes"] / (s["ms"] / 1e3) / 1e12 for _, s in stages]
    ax.barh(range(len(stages)), rates, color=["C0" if s["kind"] == "conv" else "C2" for _, s in stages])
    ax.axvline(target.dram_bytes_per_s / 1e12, color="k", lw=2, label=f"DRAM {target.dram_bytes_per_s / 1e12:.1f} TB/s")
    for i, (_, s) in enumerate(stages):
        ax.annotate(f"{s['flops'] / (s['ms'] / 1e3) / 1e12:.1f} TFLOP/s, {s['ms']:.3f} ms", (rates[i], i), fontsize=6,
                    xytext=(3, -2), textcoords="offset points")
    ax.set_yticks(range(len(stages)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel="achieved TB/s (bytes moved at best / stage time)", title="bandwidth per stage")
    ax.legend(fontsize=7)


def _pipelines(ax, rows) -> None:
    """Speedup over eager PyTorch of torch.compile and kgen, per pipeline (eager = 1)."""
    width = 0.38
    xs = range(len(rows))
    ax.bar([i - width / 2 for i in xs], [r["eager_ms"] / r["compile_ms"] if r["compile_ms"] else 0.0 for r in rows], width, label="torch.compile", color="C1")
    ax.bar([i + width / 2 for i in xs], [r["eager_ms"] / r["kgen_ms"] for r in rows], width, label="kgen",
           color=["C3" if r["kgen_ms"] > r["eager_ms"] else "C2" for r in rows])
    ax.axhline(1.0, color="k", lw=1.5, label="eager PyTorch")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['kgen_ms']:.3f} ms", (i + width / 2, r["eager_ms"] / r["kgen_ms"]), fontsize=6, ha="center",
                    rotation=90, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(list(xs), [f"{r['name']} (N={r.get('batch', '?')})" for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set(yscale="log", ylabel="speedup over eager (log; red: kgen slower)", title="kgen vs eager vs torch.compile")
    ax.legend(fontsize=8)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m kgen.plot BENCH.json FILE.png")
    print(plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
