"""conv_gemm lab: build the implicit-GEMM kernel for a set of problems, check
each against PyTorch in float64 and time it against cuDNN / eager.

    python3 scripts/conv_lab/lab.py build     # here: nvcc -> scripts/conv_lab/build/liblab.so (+ ptxas report)
    python3 scripts/conv_lab/lab.py run       # on the GPU: correctness + timing table

A development harness for templates/conv_gemm/conv_gemm.cuh: the problems and
epilogues are hand-written here; the product renders them from specs.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BUILD = HERE / "build"

# name: problem (3-D view; unused dims are 1), tile, epilogue
def conv3(cin, cout, ins, k, s=1, p=0, d=1):
    ins = tuple(ins)
    k, s, p, d = [(v,) * len(ins) if isinstance(v, int) else tuple(v) for v in (k, s, p, d)]
    pad = 3 - len(ins)
    ins, k, s, d = [(1,) * pad + t for t in (ins, k, s, d)]
    p = (0,) * pad + p
    out = tuple((i + 2 * pp - dd * (kk - 1) - 1) // ss + 1 for i, kk, ss, pp, dd in zip(ins, k, s, p, d))
    return dict(cin=cin, cout=cout, ins=ins, k=k, s=s, p=p, d=d, out=out, rank=3 - pad, full=out, wk=k,
                transposed=False, phases=[dict(k=k, p=p, out=out, os=(1, 1, 1), orr=(0, 0, 0), ws=(0, 0, 0), wst=(1, 1, 1))])


def tconv3(cin, cout, ins, k, s=1, p=0, op=0):
    """A transposed convolution as its sub-pixel phases (each an ordinary convolution)."""
    ins = tuple(ins)
    k, s, p, op = [(v,) * len(ins) if isinstance(v, int) else tuple(v) for v in (k, s, p, op)]
    pad = 3 - len(ins)
    full = tuple((i - 1) * ss - 2 * pp + kk + o for i, kk, ss, pp, o in zip(ins, k, s, p, op))
    per_dim = []
    for L, kk, ss, pp, E in zip(ins, k, s, p, full):
        rows = []
        for r in range(ss):
            k0 = (r + pp) % ss
            T = len(range(k0, kk, ss))
            c = (r + pp - k0) // ss
            rows.append(dict(k=T, p=T - 1 - c, out=-(-(E - r) // ss), os=ss, orr=r, ws=k0, wst=ss))
        per_dim.append(rows)
    import itertools
    phases = []
    for combo in itertools.product(*per_dim):
        get = lambda key, fill: (fill,) * pad + tuple(r[key] for r in combo)  # noqa: E731
        phases.append(dict(k=get("k", 1), p=get("p", 0), out=get("out", 1), os=get("os", 1), orr=get("orr", 0),
                           ws=get("ws", 0), wst=get("wst", 1)))
    return dict(cin=cin, cout=cout, ins=(1,) * pad + ins, full=(1,) * pad + full, wk=(1,) * pad + k, rank=3 - pad,
                transposed=True, phases=phases, tk=k, ts=s, tp=p, top=op)


def cfg(name, prob, tile, ci, bn, warps, stages, epilogue, mma="kTf32", residue=8, channels_last=False, batch=2,
        bench_batch=None, kind=None, window=False, wgmma=False, direct=False, teams=1):
    loop = "kDirect" if direct else "kWgmma" if wgmma else "kWindow" if window else "kGeneric"
    mma = "kFp32" if direct else mma
    return dict(name=name, prob=prob, tile=tile, ci=ci, bn=bn, warps=warps, stages=stages, epilogue=epilogue, mma=mma,
                residue=residue, channels_last=channels_last, batch=batch, bench_batch=bench_batch, kind=kind or name,
                loop=loop, teams=teams)


AVG = conv3(8, 64, (384, 384), 6, s=4)
DIVMAX = conv3(8, 16, (16, 64, 64), 3)
INST = conv3(3, 16, (16, 32, 32), 3)
CONFIGS = [
    # correctness over odd shapes (Store epilogue: the conv output itself)
    cfg("t2d_odd", conv3(3, 33, (37, 29), 3, p=1), (1, 4, 16), 4, 40, (2, 1), 2, "Store", batch=3),
    cfg("t2d_stride", conv3(16, 24, (40, 41), (5, 3), s=2, p=(2, 1)), (1, 8, 8), 8, 24, (2, 1), 3, "Store", residue=16),
    cfg("t3d_dil", conv3(9, 16, (9, 12, 13), 3, p=2, d=2), (2, 4, 8), 4, 16, (4, 1), 2, "Store", mma="kTf32x3", batch=1),
    cfg("t1d", conv3(33, 70, (101,), 7, s=3, p=3), (1, 1, 32), 16, 32, (2, 2), 3, "Store", batch=3),
    cfg("t2d_cl", conv3(12, 16, (20, 23), 3, p=1), (1, 4, 16), 8, 16, (2, 1), 2, "Store", channels_last=True),
    cfg("t3d_x3", conv3(3, 16, (16, 32, 32), 3), (2, 8, 16), 4, 16, (8, 1), 3, "Store", mma="kTf32x3"),
    cfg("w3d_x3", conv3(3, 16, (16, 32, 32), 3), (2, 8, 16), 4, 16, (8, 1), 3, "Store", mma="kTf32x3", window=True),
    cfg("w2d_odd", conv3(13, 40, (37, 29), (3, 5), p=(1, 2), d=(2, 1)), (1, 8, 32), 8, 40, (4, 1), 2, "Store", batch=3,
        window=True),
    cfg("w3d_c4", conv3(5, 8, (7, 19, 35), (2, 3, 3), p=1), (2, 4, 16), 4, 8, (4, 1), 2, "Store", window=True),
    cfg("tr3d_s2", tconv3(12, 20, (5, 7, 9), 3, s=2, p=1, op=1), (2, 4, 16), 4, 24, (4, 1), 2, "Store", window=True),
    cfg("tr2d_s3", tconv3(7, 33, (11, 13), 4, s=3, p=1), (1, 4, 16), 8, 40, (4, 1), 2, "Store", mma="kTf32x3",
        window=True),
    cfg("tr3d_s1", tconv3(9, 16, (6, 10, 20), 3, s=1, p=1), (2, 4, 16), 8, 16, (4, 1), 2, "Store"),
    # the shipped pipelines' convolutions with their fused epilogues, in a few tilings
    cfg("avg_a", AVG, (1, 4, 16), 8, 64, (4, 1), 2, "SigmoidSum", residue=1, bench_batch=128, kind="avgpool"),
    cfg("avg_b", AVG, (1, 4, 16), 4, 64, (4, 1), 3, "SigmoidSum", residue=1, bench_batch=128, kind="avgpool"),
    cfg("avg_c", AVG, (1, 4, 32), 8, 64, (4, 2), 2, "SigmoidSum", residue=8, bench_batch=128, kind="avgpool"),
    cfg("avg_d", AVG, (1, 8, 16), 4, 64, (4, 2), 2, "SigmoidSum", residue=1, bench_batch=128, kind="avgpool"),
    cfg("divmax_a", DIVMAX, (2, 8, 16), 8, 16, (8, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax"),
    cfg("divmax_b", DIVMAX, (2, 4, 16), 8, 16, (4, 1), 3, "MaxPool2Sum", bench_batch=128, kind="divmax"),
    cfg("divmax_c", DIVMAX, (2, 8, 32), 8, 16, (8, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax"),
    cfg("divmax_w4", DIVMAX, (2, 8, 16), 8, 16, (4, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", window=True),
    cfg("divmax_w2", DIVMAX, (2, 8, 16), 8, 16, (8, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", window=True),
    cfg("divmax_w4b", DIVMAX, (2, 16, 16), 8, 16, (8, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", window=True),
    cfg("rdivmax_w4", DIVMAX, (2, 8, 16), 8, 16, (4, 1), 2, "MaxPool2SumRegs", bench_batch=128, kind="divmax", window=True),
    cfg("rdivmax_w4b", DIVMAX, (2, 16, 16), 8, 16, (8, 1), 2, "MaxPool2SumRegs", bench_batch=128, kind="divmax",
        window=True),
    cfg("rdivmax_odd", conv3(8, 12, (9, 21, 37), 3), (2, 8, 16), 8, 16, (4, 1), 2, "MaxPool2SumRegs", batch=3,
        kind="divmax", window=True),
    cfg("sdivmax_odd", conv3(8, 12, (9, 21, 37), 3), (2, 8, 16), 8, 16, (4, 1), 2, "MaxPool2Sum", batch=3,
        kind="divmax", window=True),
    # the wgmma main loop (sm_90a)
    cfg("g2d_odd", conv3(13, 40, (37, 29), (3, 5), p=(1, 2), d=(2, 1)), (1, 8, 8), 8, 40, (4, 1), 2, "Store", batch=3,
        wgmma=True),
    cfg("g2d_s2", conv3(16, 24, (40, 41), (5, 3), s=2, p=(2, 1)), (1, 16, 8), 8, 24, (8, 1), 3, "Store", wgmma=True),
    cfg("g3d_x3", conv3(3, 16, (16, 32, 32), 3), (2, 8, 8), 8, 16, (4, 1), 2, "Store", mma="kTf32x3", wgmma=True),
    cfg("g1x_s3", conv3(8, 8, (9, 30, 50), (2, 3, 4), s=(1, 2, 3), p=1), (2, 8, 8), 16, 8, (8, 1), 2, "Store", batch=2,
        wgmma=True),
    cfg("gtr3d_s2", tconv3(16, 24, (5, 7, 9), 3, s=2, p=1, op=1), (1, 8, 8), 8, 24, (4, 1), 2, "Store", wgmma=True),
    cfg("g2d_cl", conv3(16, 32, (20, 23), 3, p=1), (1, 8, 8), 8, 32, (4, 1), 2, "Store", channels_last=True, wgmma=True),
    cfg("gavg_a", AVG, (1, 8, 8), 8, 64, (4, 1), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True),
    cfg("gavg_b", AVG, (1, 16, 8), 8, 64, (8, 1), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True),
    cfg("gavg_c", AVG, (1, 8, 8), 8, 64, (4, 2), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True),
    cfg("gavg_d", AVG, (1, 16, 8), 8, 64, (8, 2), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True),
    # the wgmma loop with several teams per CTA (sharing the resident weights)
    cfg("tavg_a", AVG, (1, 8, 8), 8, 64, (4, 1), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True, teams=3),
    cfg("tavg_b", AVG, (1, 8, 8), 8, 64, (4, 1), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True, teams=2),
    cfg("tavg_e", AVG, (1, 8, 8), 8, 64, (4, 2), 2, "SigmoidSum", bench_batch=128, kind="avgpool", wgmma=True, teams=2),
    # a written output on the wgmma loop: a staged tile vs stores from the accumulators
    cfg("savg_old", AVG, (1, 16, 8), 8, 64, (8, 2), 2, "Store", bench_batch=128, wgmma=True),
    cfg("savg_staged", AVG, (1, 8, 8), 8, 64, (4, 1), 2, "Store", bench_batch=128, wgmma=True, teams=2),
    cfg("savg_regs2", AVG, (1, 8, 8), 8, 64, (4, 1), 2, "StoreRegs", bench_batch=128, wgmma=True, teams=2),
    cfg("savg_regs3", AVG, (1, 8, 8), 8, 64, (4, 1), 2, "StoreRegs", bench_batch=128, wgmma=True, teams=3),
    cfg("tdivmax_a", DIVMAX, (2, 8, 8), 8, 16, (4, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True,
        teams=3),
    cfg("tdivmax_b", DIVMAX, (2, 8, 8), 8, 16, (4, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True,
        teams=6),
    cfg("tm2d_odd", conv3(13, 40, (37, 29), (3, 5), p=(1, 2), d=(2, 1)), (1, 8, 8), 8, 40, (4, 1), 2, "Store", batch=3,
        wgmma=True, teams=3),
    cfg("tm1x_s3", conv3(20, 8, (9, 30, 50), (2, 3, 4), s=(1, 2, 3), p=1), (2, 8, 8), 8, 8, (4, 1), 2, "Store", batch=2,
        wgmma=True, teams=2),
    cfg("tm3d_x3", conv3(3, 16, (16, 32, 32), 3), (2, 8, 8), 8, 16, (4, 1), 2, "Store", mma="kTf32x3", wgmma=True, teams=2),
    cfg("g2d_n2", conv3(16, 48, (21, 19), 3, p=1), (1, 8, 8), 8, 48, (4, 2), 2, "Store", batch=2, wgmma=True),
    cfg("gdivmax_a", DIVMAX, (2, 8, 8), 8, 16, (4, 1), 3, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True),
    cfg("gdivmax_b", DIVMAX, (2, 8, 8), 8, 16, (8, 1), 3, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True),
    cfg("gdivmax_c", DIVMAX, (2, 16, 8), 8, 16, (8, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True),
    cfg("gdivmax_e", DIVMAX, (2, 8, 8), 8, 16, (4, 2), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True),
    cfg("gdivmax_d", DIVMAX, (4, 8, 8), 8, 16, (4, 1), 2, "MaxPool2Sum", bench_batch=128, kind="divmax", wgmma=True),
    cfg("inst_stats", INST, (2, 8, 16), 4, 16, (8, 1), 3, "NormStats", mma="kTf32x3", bench_batch=128, kind="inst"),
    cfg("inst_apply", INST, (2, 8, 16), 4, 16, (8, 1), 3, "NormApplyMax", mma="kTf32x3", bench_batch=128, kind="inst"),
    cfg("instw_stats", INST, (2, 8, 16), 4, 16, (8, 1), 3, "NormStats", mma="kTf32x3", bench_batch=128, kind="instw",
        window=True),
    cfg("instw_apply", INST, (2, 8, 16), 4, 16, (8, 1), 3, "NormApplyMax", mma="kTf32x3", bench_batch=128, kind="instw",
        window=True),
    # the direct loop (plain fp32 FMAs)
    cfg("d3d_odd", conv3(3, 20, (9, 13, 35), 3, p=1), (1, 8, 32), 3, 24, (2, 1), 2, "Store", direct=True),
    cfg("d2d_s2", conv3(5, 16, (40, 41), (5, 3), s=2, p=(2, 1)), (1, 8, 32), 5, 16, (2, 2), 2, "Store", batch=3,
        direct=True),
    cfg("d2d_dil_cl", conv3(12, 8, (20, 23), 3, p=2, d=2), (1, 4, 16), 8, 8, (1, 1), 3, "Store", channels_last=True,
        direct=True),
    cfg("dtr3d_s2", tconv3(6, 16, (5, 7, 9), 3, s=2, p=1, op=1), (2, 4, 16), 6, 16, (2, 1), 2, "Store", direct=True),
    cfg("d1d", conv3(7, 12, (101,), 7, s=3, p=3), (1, 1, 64), 4, 16, (1, 1), 2, "Store", batch=3, direct=True),
    cfg("davg", AVG, (1, 4, 32), 8, 64, (1, 4), 2, "SigmoidSum", bench_batch=128, kind="avgpool", direct=True),
    cfg("winst_store", INST, (2, 8, 16), 4, 16, (8, 1), 2, "Store", mma="kTf32x3", window=True, bench_batch=128),
    cfg("dinst_store", INST, (2, 16, 32), 3, 16, (4, 1), 2, "Store", bench_batch=128, direct=True),
    cfg("dinst_store8", INST, (2, 16, 32), 3, 16, (8, 1), 2, "Store", bench_batch=128, direct=True),
    cfg("dinst_store_t1", INST, (1, 32, 32), 3, 16, (4, 1), 2, "Store", bench_batch=128, direct=True),
    cfg("dinst_stats", INST, (2, 16, 32), 3, 16, (4, 1), 2, "NormStats", bench_batch=128, kind="dinst", direct=True),
    cfg("dinst_apply", INST, (2, 16, 32), 3, 16, (4, 1), 2, "NormApplyMax", bench_batch=128, kind="dinst", direct=True),
]


def problem_struct(c, ph, name) -> str:
    p = c["prob"]
    t = c["tile"]
    lines = [f"struct {name} {{"]
    put = lambda n, v: lines.append(f"  static constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = {str(v).lower() if isinstance(v, bool) else v};")  # noqa: E731
    put("kCin", p["cin"]); put("kCout", p["cout"])
    stride = (1, 1, 1) if p["transposed"] else p["s"]
    dil = (1, 1, 1) if p["transposed"] else p["d"]
    for pre, vals in (("kIn", p["ins"]), ("kOut", ph["out"]), ("kK", ph["k"]), ("kS", stride), ("kP", ph["p"]),
                      ("kD", dil), ("kOutStride", ph["os"]), ("kOutResidue", ph["orr"]), ("kFull", p["full"]),
                      ("kWK", p["wk"]), ("kWStart", ph["ws"]), ("kWStep", ph["wst"])):
        for ax, v in zip("DHW", vals):
            put(pre + ax, v)
    put("kWeightTransposed", p["transposed"]); put("kWFlip", p["transposed"])
    put("kChannelsLast", c["channels_last"])
    for ax, v in zip("DHW", t):
        put("kT" + ax, v)
    put("kCI", c["ci"]); put("kBN", c["bn"]); put("kWarpsM", c["warps"][0]); put("kWarpsN", c["warps"][1])
    put("kStages", c["stages"]); put("kPlaneResidue", c["residue"]); put("kTeams", c["teams"])
    lines.append(f"  static constexpr kgen::conv_gemm::Loop kLoop = kgen::conv_gemm::Loop::{c['loop']};")
    lines.append(f"  static constexpr kgen::conv_gemm::Mma kMma = kgen::conv_gemm::Mma::{c['mma']};")
    lines.append("};")
    return "\n".join(lines)


def gen_source() -> str:
    out = ['#include "epilogues.cuh"', "using namespace kgen::conv_gemm;", ""]
    for c in CONFIGS:
        n, e = c["name"], c["epilogue"]
        phases = c["prob"]["phases"]
        names = [f"P_{n}" if len(phases) == 1 else f"P_{n}_ph{i}" for i in range(len(phases))]
        for ph, pn in zip(phases, names):
            out.append(problem_struct(c, ph, pn))
        packed = " + ".join(f"Geometry<{pn}>::kPackedFloats" for pn in names)
        out.append(f'extern "C" long long {n}_packed() {{ return {packed}; }}')
        out.append(f'extern "C" int {n}_tiles() {{ return Geometry<{names[0]}>::kTilesPerSample; }}')
        out.append(f'extern "C" int {n}_smem() {{ return smem_bytes<{names[0]}, lab::{e}>(); }}')
        out.append(f'extern "C" int {n}_run(const float* x, const float* w, float* packed, lab::{e}::Params* ep, int batch, cudaStream_t s) {{')
        if len(names) == 1:
            out.append(f"  return launch<{names[0]}, lab::{e}>(x, w, packed, *ep, batch, s);")
        else:
            out.append(f"  PackedPhases<{len(names)}> pp;")
            out.append("  float* at = packed;")
            for i, pn in enumerate(names):
                out.append(f"  pack_weights<{pn}>(w, at, s); pp.w[{i}] = at; at += Geometry<{pn}>::kPackedFloats;")
            out.append(f"  return run_phases<lab::{e}, {', '.join(names)}>(x, pp, *ep, batch, s);")
        out.append("}")
        out.append("")
    out.append('extern "C" int sum_rows(const float* partial, int cols, float scale, const float* off, int off_n, float* out, int rows, cudaStream_t s) {')
    out.append("  lab::sum_rows<<<(rows + 127) / 128, 128, 0, s>>>(partial, cols, scale, off, off_n, out, rows); return cudaGetLastError();")
    out.append("}")
    out.append('extern "C" int merge_stats(const float* partial, int tiles, float eps, float* stats, int rows, cudaStream_t s) {')
    out.append("  lab::merge_stats<<<(rows + 127) / 128, 128, 0, s>>>(partial, tiles, eps, stats, rows); return cudaGetLastError();")
    out.append("}")
    return "\n".join(out) + "\n"


def build():
    BUILD.mkdir(exist_ok=True)
    src = BUILD / "lab_gen.cu"
    src.write_text(gen_source())
    cmd = ["nvcc", "-O3", "-std=c++17", "-lineinfo", "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
           "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT / 'templates'}", f"-I{HERE}", str(src),
           "-o", str(BUILD / "liblab.so")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (BUILD / "ptxas.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stdout + proc.stderr)
        sys.exit(1)
    sys.path.insert(0, str(ROOT))
    from kgen.build import parse_ptxas, demangle
    for k in parse_ptxas(proc.stdout + proc.stderr):
        name = demangle(k.name)
        if "conv_kernel" in name:
            short = name.split("P_")[1].split(",")[0] if "P_" in name else name[:40]
            print(f"{short:24s} regs {k.registers:4d} stack {k.stack} spills {k.spill_stores}/{k.spill_loads}")
    if shutil.which("cuobjdump"):
        with open(BUILD / "sass.txt", "w") as fh:
            subprocess.run(["cuobjdump", "-sass", str(BUILD / "liblab.so")], stdout=fh)


# ------------------------------------------------------------------ run (GPU)


class P2(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p)]


class P3(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p)]


class PApply(ctypes.Structure):
    _fields_ = [("bias", ctypes.c_void_p), ("mult", ctypes.c_void_p), ("stats", ctypes.c_void_p),
                ("lo", ctypes.c_float), ("hi", ctypes.c_float), ("out", ctypes.c_void_p)]


def run(only=None, check_only=False, profile=False):
    import torch
    import torch.nn.functional as F

    lib = ctypes.CDLL(str(BUILD / "liblab.so"))
    torch.backends.cudnn.allow_tf32 = True
    dev = "cuda"
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    ptr = lambda t: ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)  # noqa: E731
    results = []

    def timeit(fn, reps=30):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        return ts[len(ts) // 2]

    for c in CONFIGS:
        if only and c["name"] not in only:
            continue
        n, p = c["name"], c["prob"]
        rank = p["rank"]
        conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
        sp = lambda t: t[3 - rank:]  # noqa: E731
        g = torch.Generator().manual_seed(0)
        wshape = ((p["cin"], p["cout"]) if p["transposed"] else (p["cout"], p["cin"])) + sp(p["wk"])
        w = torch.randn(wshape, generator=g) / math.sqrt(p["cin"] * math.prod(p["wk"]))
        bias = torch.randn(p["cout"], generator=g)
        extra = torch.randn(p["cout"], generator=g)
        w, bias, extra = w.to(dev), bias.to(dev), extra.to(dev)
        packed = torch.empty(lib[f"{n}_packed"](), device=dev)
        tiles = lib[f"{n}_tiles"]()
        fn = lib[f"{n}_run"]
        row = dict(name=n, smem=lib[f"{n}_smem"]())

        def make_x(batch, seed=1, nan=False):
            gg = torch.Generator().manual_seed(seed)
            x = torch.randn((batch, p["cin"]) + sp(p["ins"]), generator=gg)
            if nan:
                x.view(-1)[torch.randint(0, x.numel(), (3,), generator=gg)] = float("nan")
            x = x.to(dev)
            if c["channels_last"]:
                x = x.contiguous(memory_format=torch.channels_last if rank == 2 else torch.channels_last_3d)
            return x

        def ref_conv(x):
            return conv(x.double(), w.double(), bias.double(), sp(p["s"]), sp(p["p"]), sp(p["d"]))

        def kgen_forward(x):
            batch = x.shape[0]
            e = c["epilogue"]
            if e in ("Store", "StoreRegs"):
                out = torch.full((batch, p["cout"]) + sp(p["full"]), float("nan"), device=dev)
                par = P2(ptr(bias), ptr(out))
                rc = fn(ptr(x), ptr(w), ptr(packed), ctypes.byref(par), batch, stream())
                assert rc == 0, rc
                return out
            if e in ("SigmoidSum", "MaxPool2Sum", "MaxPool2SumRegs"):
                wk = w
                partial = torch.empty(batch * tiles, device=dev)
                out = torch.empty(batch, device=dev)
                par = P2(ptr(bias), ptr(partial))
                assert fn(ptr(x), ptr(wk), ptr(packed), ctypes.byref(par), batch, stream()) == 0
                if c["kind"] == "avgpool":
                    assert lib.sum_rows(ptr(partial), tiles, ctypes.c_float(1.0), ctypes.c_void_p(0), 0, ptr(out), batch, stream()) == 0
                else:
                    count = math.prod(o // 2 for o in p["out"])
                    assert lib.sum_rows(ptr(partial), tiles, ctypes.c_float(1.0 / count), ptr(extra), p["cout"], ptr(out), batch, stream()) == 0
                return out
            if e in ("NormStats", "NormApplyMax"):
                partial = torch.empty(batch * p["cout"] * tiles * 3, device=dev)
                stats = torch.empty(batch * p["cout"] * 2, device=dev)
                out = torch.full((batch,) + sp(p["out"]), float("nan"), device=dev)
                fs, fa = lib[f"{c['kind']}_stats_run"], lib[f"{c['kind']}_apply_run"]
                par = P3(ptr(bias), ptr(extra), ptr(partial))
                assert fs(ptr(x), ptr(w), ptr(packed), ctypes.byref(par), batch, stream()) == 0
                assert lib.merge_stats(ptr(partial), tiles, ctypes.c_float(1e-5), ptr(stats), batch * p["cout"], stream()) == 0
                pa = PApply(ptr(bias), ptr(extra), ptr(stats), -1.0, 1.0, ptr(out))
                assert fa(ptr(x), ptr(w), ptr(packed), ctypes.byref(pa), batch, stream()) == 0
                return out
            raise ValueError(e)

        def ref_forward(x, dtype=torch.float64):
            e = c["epilogue"]
            xx, ww, bb, ee = x.to(dtype), w.to(dtype), bias.to(dtype), extra.to(dtype)
            if p["transposed"]:
                tconv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[rank - 1]
                y = tconv(xx, ww, bb, p["ts"], p["tp"], p["top"])
            else:
                y = conv(xx, ww, bb, sp(p["s"]), sp(p["p"]), sp(p["d"]))
            if e in ("Store", "StoreRegs"):
                return y
            if e == "SigmoidSum":
                return torch.sigmoid(y).sum(dim=tuple(range(1, y.dim())))
            if e in ("MaxPool2Sum", "MaxPool2SumRegs"):
                y = F.max_pool3d(y, 2) / 2
                return (y.mean(dim=(2, 3, 4), keepdim=True) + ee.view(-1, 1, 1, 1)).sum(dim=(1, 2, 3, 4))
            y = y * ee.view(-1, 1, 1, 1)
            y = F.instance_norm(y, eps=1e-5)
            y = torch.clamp(y, -1, 1) * ee.view(-1, 1, 1, 1)
            return torch.amax(y, dim=1)

        if profile:  # one call at the bench batch, for ncu
            x = make_x(c["bench_batch"] or c["batch"], 5)
            kgen_forward(x)
            torch.cuda.synchronize()
            continue
        errs = []
        for seed, nan in ((1, False), (2, False), (3, True)):
            x = make_x(c["batch"], seed, nan)
            got = kgen_forward(x).double().cpu()
            ref = ref_forward(x).cpu()
            eag = ref_forward(x, torch.float32).double().cpu()
            if not torch.equal(torch.isnan(got), torch.isnan(ref)):
                errs.append(f"NaN mask differs (seed {seed}: {int(torch.isnan(got).sum())} vs {int(torch.isnan(ref).sum())})")
                continue
            fin = torch.isfinite(ref)
            rel = float((got[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-30))
            rel_e = float((eag[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-30))
            mx = float((got[fin] - ref[fin]).abs().max()) if fin.any() else 0.0
            row.setdefault("rel", []).append(rel)
            row.setdefault("rel_eager", []).append(rel_e)
            row.setdefault("maxabs", []).append(mx)
            tol = {"kTf32x3": 2e-5, "kFp32": 1e-5}.get(c["mma"], 5e-3)
            if rel > tol:
                errs.append(f"seed {seed}: rel {rel:.2e} > {tol}")
            close = torch.allclose(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
            row.setdefault("allclose_1e-4", []).append(bool(close))
        row["errors"] = errs
        if c["bench_batch"] and not check_only:
            x = make_x(c["bench_batch"], 5)
            row["kgen_ms"] = timeit(lambda: kgen_forward(x))
            with torch.no_grad():
                row["eager_ms"] = timeit(lambda: ref_forward(x, torch.float32))
                mod = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
                row["cudnn_conv_ms"] = timeit(lambda: mod(x, w, bias, sp(p["s"]), sp(p["p"]), sp(p["d"])))
            flops = 2 * c["bench_batch"] * p["cout"] * p["cin"] * math.prod(p["k"]) * math.prod(p["out"])
            row["tflops"] = flops / row["kgen_ms"] / 1e9 * (2 if c["epilogue"].startswith("Norm") else 1)
            row["x_gbps"] = x.numel() * 4 / row["kgen_ms"] / 1e6
        results.append(row)
        print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "lab.json").write_text(json.dumps(results, indent=1))
    print()
    print(f"{'config':24s} {'rel err':>9s} {'eager rel':>9s} {'allclose':>8s} {'kgen ms':>8s} {'eager ms':>8s} {'cudnn ms':>8s} {'TFLOP/s':>8s} {'x GB/s':>7s} errors")
    for r in results:
        print(f"{r['name']:24s} {max(r.get('rel', [math.nan])):9.2e} {max(r.get('rel_eager', [math.nan])):9.2e} "
              f"{str(all(r.get('allclose_1e-4', [False]))):>8s} {r.get('kgen_ms', math.nan):8.3f} {r.get('eager_ms', math.nan):8.3f} "
              f"{r.get('cudnn_conv_ms', math.nan):8.3f} {r.get('tflops', math.nan):8.1f} {r.get('x_gbps', math.nan):7.0f} {'; '.join(r['errors'])}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "build"
    if what == "build":
        build()
    elif what == "source":
        print(gen_source())
    else:
        run(only=sys.argv[2:] or None, check_only=what == "check", profile=what == "profile")
