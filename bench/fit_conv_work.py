"""Fit conv_work's cuDNN rates (kgen.families.conv_aten) to the calibration data of cudnn_calibrate.py.

Each calibration row is one spec's first convolution in one form (as written, flipped kernel, sub-pixel phases;
NC[D]HW or channels_last) with its time on the GPU, TF32 allowed and off. The estimate's arguments are
recomputed here on the "meta" device (no GPU), so the fit can change the model's structure too. The TF32-allowed
times fit the tensor-core constants (of the calls that ran TF32 kernels); the TF32-off times fit
CUDNN_FP32_FRACTION and the fp32 transposed terms.
Prints the fitted values and measured / model per kind of call (needs numpy
and scipy, which kgen itself does not):

    PYTHONPATH=. python bench/fit_conv_work.py reports/cudnn_calibration_h200.json SPEC_DIR ...

With --dtype: calibration files of 16-bit calls (`cudnn_calibrate.py --dtype`, one or more, e.g. bfloat16 and
float16 together) fit the 16-bit terms (SIXTEEN_BIT):

    PYTHONPATH=. python bench/fit_conv_work.py --dtype reports/cudnn_calibration_h200_bf16.json \
        reports/cudnn_calibration_h200_f16.json --specs SPEC_DIR ...
"""
import argparse
import collections
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cudnn_calibrate import forms  # noqa: E402

from kgen.cost import work_s  # noqa: E402
from kgen.families import conv_aten  # noqa: E402
from kgen.ir import load_pipeline  # noqa: E402
from kgen.target import current  # noqa: E402

# CUDNN_FULL_N / CUDNN_FULL_K stay as set (96, 320): left free the fit moved them to 29 / 790 (rms 0.35 instead
# of 0.39), which made cuDNN's small sub-pixel phase calls look 2.5x slower and put #100 and #93 on the generated
# convolution, 3.4x and 2x slower in the 2026-11-25 sweep at d5b17bd (docs/performance.md)
# CUDNN_FRACTION and NCHW_CONVERSION are left as the H100's fit set them (conv_aten.py says why)
TENSOR_CORE = ["TRANSPOSED_STRIDE1_EFFICIENCY", "TRANSPOSED_STRIDED_EFFICIENCY", "TRANSPOSED_NCHW_EFFICIENCY",
               "TRANSPOSED_3D_EFFICIENCY"]
# With --bias-less (bench/cudnn_bias.py's times of the same calls with and without their bias): the bias pass is
# told apart from the call itself, and the rates the calls with a bias had hidden it in are fitted too
BIAS_LESS = ["CUDNN_FRACTION", "NCHW_CONVERSION", "BIAS_PASS", "TRANSPOSED_3D_STRIDE1_CL_EFFICIENCY"]
# A call whose TF32-allowed time is above this fraction of its TF32-off time ran cuDNN's fp32 kernels anyway: it
# says nothing of the tensor-core rates (the TF32-allowed fit leaves it out)
FP32_KERNELS_TIME_RATIO = 0.85
FP32 = ["CUDNN_FP32_FRACTION", "FP32_TRANSPOSED_STRIDED_EFFICIENCY", "FP32_TRANSPOSED_STRIDE1_EFFICIENCY",
        "FP32_TRANSPOSED_3D_EFFICIENCY"]
# CUDNN16_FRACTION and BIAS16_PASS are set from a profile (conv_aten.py says which): every calibration call adds a
# bias, and left free the two traded against each other (fraction 4.2 of the peak, pass 4.3)
SIXTEEN_BIT = ["TRANSPOSED16_STRIDE1_EFFICIENCY", "TRANSPOSED16_STRIDED_EFFICIENCY",
               "TRANSPOSED16_NCHW_EFFICIENCY", "TRANSPOSED16_STRIDE1_NCHW_EFFICIENCY", "TRANSPOSED16_3D_EFFICIENCY",
               "NCHW16_CONVERSION", "CUDNN16_FULL_CHANNELS", "CUDNN16_CHANNELS_POWER"]
RESTARTS = 12


def kind(row) -> str:
    if row["form"] != "as written":
        return "flipped kernel" if row["form"] == "flipped kernel" else "sub-pixel phases"
    if not row["conv"].startswith("conv_transpose"):
        return "forward"
    stride = row["conv"].split(" s[")[1].split("]")[0]
    return "transposed strided" if any(int(s) > 1 for s in stride.split(",")) else "transposed stride 1"


def samples(rows, spec_dirs):
    """(row, conv_work argument dicts) for each calibration row whose spec and form are still found."""
    specs = {}
    for d in spec_dirs:
        for f in sorted(Path(d).glob("*.yaml")):
            try:
                p = load_pipeline(f)
            except Exception:  # specs that are not pipelines (tuning files' siblings) or no longer load
                continue
            specs[p.name] = p
    args, out = {}, []
    for r in rows:
        p = specs.get(r["spec"])
        if p is None:
            continue
        if p.name not in args:
            x = torch.empty(p.input.concrete(p.example_batch()), device="meta")
            args[p.name] = {(name, layout): est for name, layout, _, est in forms(p, x)}
        est = args[p.name].get((r["form"], r["layout"]))
        if est is not None:
            out.append((r, est))
    return out


def with_bias_less(data, bias_rows):
    """``data`` where bench/cudnn_bias.py timed a row's call (a KernelBench problem's first convolution, as written
    or flipped, in its layout) with and without its bias: both, each with its own estimate (``bias``); the
    TF32-off time of the bias-less one scaled as its TF32-allowed time (its kernels' kind stays the row's)."""
    import re

    by_problem = {r["problem"]: r for r in bias_rows}
    out = []
    for r, est in data:
        m = re.match(r"kb2_(\d+)_", r["spec"])
        timed = by_problem.get(int(m.group(1))) if m and r.get("dtype", "float32") == "float32" else None
        kind_ = {"as written": "transposed" if r["conv"].startswith("conv_transpose") else "forward",
                 "flipped kernel": "flipped"}.get(r["form"])
        layout = "cl" if r["layout"] == "channels_last" else "ncdhw"
        with_, without = (timed.get(f"{kind_}_{layout}_bias"), timed.get(f"{kind_}_{layout}_nobias")) if timed and kind_ else (None, None)
        if with_ is None or without is None:
            out.append((r, est))
            continue
        scale = lambda ms, r=r: dict(r, tf32_allowed_ms=ms, tf32_off_ms=r["tf32_off_ms"] * ms / r["tf32_allowed_ms"])  # noqa: E731
        out.append((scale(with_), est))
        out.append((scale(without), [dict(e, bias=False) for e in est]))
    return out


def log_errors(data, target, fp32: bool):
    """(row, log(measured / model)) per calibration row: a 16-bit row (its "dtype") against its 16-bit estimate."""
    for r, est in data:
        dtype = r.get("dtype", "float32")
        if dtype != "float32":
            column = "ms"
        elif not fp32 and r["tf32_allowed_ms"] > FP32_KERNELS_TIME_RATIO * r["tf32_off_ms"]:
            continue
        else:
            column = "tf32_off_ms" if fp32 else "tf32_allowed_ms"
        model = 1e3 * sum(work_s(w, target) for a in est
                          for w in conv_aten.conv_work("c", target=target, fp32=fp32, dtype=dtype, **a))
        yield r, math.log(r[column] / model)


def fit(data, target, names, fp32: bool, label: str | None = None):
    import numpy as np  # (the fit's own needs, not kgen's: imported here so that --help works without them)
    from scipy.optimize import minimize

    def loss(logp):
        for n, v in zip(names, np.exp(logp)):
            setattr(conv_aten, n, float(v))
        errs = [e * e for _, e in log_errors(data, target, fp32)]
        return sum(errs) / len(errs)

    start = np.log([getattr(conv_aten, n) for n in names])
    before = loss(start)
    rng = np.random.default_rng(0)
    best = None
    for i in range(RESTARTS):
        x0 = start + (rng.normal(0, 0.5, len(names)) if i else 0)
        r = minimize(loss, x0, method="Powell", options=dict(maxiter=20000, xtol=1e-3, ftol=1e-7))
        best = r if best is None or r.fun < best.fun else best
    loss(best.x)  # leave the best values set
    print(f"{label or ('TF32 off' if fp32 else 'TF32 allowed')}: rms log error {math.sqrt(before):.3f} -> {math.sqrt(best.fun):.3f}")
    for n, old, new in zip(names, np.exp(start), np.exp(best.x)):
        print(f"  {n:32s} {old:10.4g} -> {new:10.4g}")
    groups = collections.defaultdict(list)
    for r, e in log_errors(data, target, fp32):
        groups[(kind(r), r["layout"])].append(e)
    for (k, layout), errs in sorted(groups.items()):
        print(f"    {k:20s} {layout:13s} {len(errs):3d} calls: measured / model {math.exp(statistics.mean(errs)):5.2f} "
              f"(spread x{math.exp(statistics.pstdev(errs)):.2f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibration")
    ap.add_argument("spec_dirs", nargs="*")
    ap.add_argument("--dtype", action="store_true",
                    help="16-bit calibration files (the positional arguments up to --specs) and the 16-bit terms")
    ap.add_argument("--specs", nargs="+", default=[], help="with --dtype: the spec folders")
    ap.add_argument("--bias-less", type=Path, default=None,
                    help="bench/cudnn_bias.py's report: the calls timed without their bias too (fits BIAS_LESS)")
    args = ap.parse_args()
    target = current()
    if args.dtype:
        rows = [r for f in [args.calibration] + args.spec_dirs for r in json.load(open(f))["rows"]]
        data = samples(rows, args.specs)
        print(f"{len(data)} calls")
        fit(data, target, SIXTEEN_BIT, fp32=False, label="16-bit")
        return
    data = samples(json.load(open(args.calibration))["rows"], args.spec_dirs)
    names = TENSOR_CORE
    if args.bias_less:
        data = with_bias_less(data, json.load(open(args.bias_less))["rows"])
        names = TENSOR_CORE + BIAS_LESS
    print(f"{len(data)} calls")
    fit(data, target, names, fp32=False)
    fit(data, target, FP32, fp32=True)


if __name__ == "__main__":
    main()
