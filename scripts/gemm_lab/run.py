#!/usr/bin/env python3
"""Split-TF32 GEMM lab: build, check against float64, time against cuBLAS fp32 (F.linear).

  python3 run.py            # smoke checks (in a subprocess, so a hung/trapped kernel can't take
                            # the timing run down), then the full table
  python3 run.py --smoke    # only the small-shape correctness checks of every variant
  python3 run.py --quick    # small shapes only in the timing table

Writes results to $OUT (or ./build) as gemm_lab.json and gemm_lab.log.
"""
import ctypes
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "build")
LIB = os.path.join(BUILD, "libg3.so")
SRC = [os.path.join(HERE, f) for f in ("gemm3xtf32.cu", "wgmma_tf32.h")]
OUTDIR = os.environ.get("OUT") or BUILD
NVCC = ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
        "-shared", "-Xcompiler", "-fPIC", "-o", LIB, SRC[0]]

LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def build():
    os.makedirs(BUILD, exist_ok=True)
    if os.path.exists(LIB) and all(os.path.getmtime(LIB) >= os.path.getmtime(s) for s in SRC):
        return "prebuilt"
    r = subprocess.run(NVCC, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("nvcc failed:\n" + r.stderr)
    return "built: " + " | ".join(l for l in r.stderr.splitlines() if "Used" in l or "spill" in l)


def load():
    lib = ctypes.CDLL(LIB)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.g3_last_error.restype = ctypes.c_char_p
    lib.g3_variant_name.restype = ctypes.c_char_p
    lib.g3_variant_name.argtypes = [I]
    lib.g3_split.argtypes = [P, P, P, I, I, I, P]
    lib.g3_gemm.argtypes = [I, P, P, P, P, P, P, I, I, I, P]
    return lib


class G3:
    def __init__(self):
        import torch
        self.torch = torch
        self.lib = load()
        self.nv = self.lib.g3_num_variants()
        self.names = [self.lib.g3_variant_name(i).decode() for i in range(self.nv)]

    def check(self, rc):
        if rc != 0:
            raise RuntimeError(self.lib.g3_last_error().decode())

    def stream(self):
        return ctypes.c_void_p(self.torch.cuda.current_stream().cuda_stream)

    def split(self, x, hi=None, lo=None):
        torch = self.torch
        rows, K = x.shape
        Kp = (K + 3) // 4 * 4
        if hi is None:
            hi = torch.empty(rows, Kp, device=x.device, dtype=torch.float32)
            lo = torch.empty(rows, Kp, device=x.device, dtype=torch.float32)
        self.check(self.lib.g3_split(x.data_ptr(), hi.data_ptr(), lo.data_ptr(), rows, K, Kp,
                                     self.stream()))
        return hi, lo

    def gemm(self, v, ahi, alo, bhi, blo, bias, out):
        M, Kp = ahi.shape
        N = bhi.shape[0]
        self.check(self.lib.g3_gemm(v, ahi.data_ptr(), alo.data_ptr(), bhi.data_ptr(),
                                    blo.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                    out.data_ptr(), M, N, Kp, self.stream()))
        return out

    def linear(self, v, x, wsplit, bias, ws=None, out=None):
        """the per-call path: split the activation, then the GEMM"""
        torch = self.torch
        ahi, alo = self.split(x, *(ws or (None, None)))
        if out is None:
            out = torch.empty(x.shape[0], wsplit[0].shape[0], device=x.device, dtype=torch.float32)
        return self.gemm(v, ahi, alo, wsplit[0], wsplit[1], bias, out)


def ref64(x, W, b, block=4096):
    """float64 reference on the GPU, blocked over N (and M) to bound memory"""
    import torch
    M, K = x.shape
    N = W.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=torch.float64)
    mb = max(1, min(M, (1 << 28) // max(K, 1)))
    for n0 in range(0, N, block):
        w64 = W[n0:n0 + block].double()
        for m0 in range(0, M, mb):
            out[m0:m0 + mb, n0:n0 + block] = x[m0:m0 + mb].double() @ w64.T
        del w64
    if b is not None:
        out += b.double()
    return out


def max_err(y, ref):
    import torch
    e = 0.0
    nonfinite = 0
    M = y.shape[0]
    step = max(1, (1 << 27) // max(y.shape[1], 1))
    for m0 in range(0, M, step):
        d = y[m0:m0 + step].double() - ref[m0:m0 + step]
        nonfinite += int((~torch.isfinite(d)).sum())
        e = max(e, float(d.abs().max()))
    return e, nonfinite


def bench(fn, reps=25, warm=3):
    import torch
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    return ts[len(ts) // 2], ts[0], ts[-1]


def make_inputs(M, N, K, kind, gen):
    import torch
    dev = "cuda"
    x = torch.randn(M, K, device=dev, generator=gen)
    W = torch.randn(N, K, device=dev, generator=gen)
    b = torch.randn(N, device=dev, generator=gen)
    if kind == "x1e3":
        x *= 1e3
        W *= 1e3
        b *= 1e3
    elif kind == "mixed":
        # per-element magnitudes spread over 10^-4 .. 10^4, per row/column scales too
        x *= torch.pow(10.0, torch.randint(-4, 5, (M, K), device=dev, generator=gen).float())
        W *= torch.pow(10.0, torch.randint(-2, 3, (N, 1), device=dev, generator=gen).float())
    return x, W, b


def smoke(variants=None):
    """small/odd shapes, every variant: poisoned output, fresh inputs, vs float64"""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    g = G3()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    shapes = [(128, 256, 32), (100, 200, 300), (1, 7, 5), (257, 513, 37), (300, 1000, 4096),
              (129, 384, 1030)]
    variants = range(g.nv) if variants is None else variants
    for v in variants:
        print(f"SMOKE_START {v}", flush=True)
        worst = 0.0
        ok = True
        for (M, N, K) in shapes:
            x, W, b = make_inputs(M, N, K, "randn", gen)
            ws = g.split(W)
            out = torch.full((M, N), float("nan"), device="cuda")
            g.linear(v, x, ws, b, out=out)
            torch.cuda.synchronize()
            ref = ref64(x, W, b)
            e, nf = max_err(out, ref)
            ec, _ = max_err(torch.nn.functional.linear(x, W, b), ref)
            r = e / max(ec, 1e-30)
            good = nf == 0 and (e <= 2.0 * ec or e <= 1e-6 * float(ref.abs().max()))
            if not g.names[v].startswith("3x"):
                good = nf == 0 and e <= 1e-2 * float(ref.abs().max())  # plain tf32: sanity only
            ok &= good
            worst = max(worst, r)
            print(f"  v{v} {g.names[v]:<48s} M={M:<4d} N={N:<5d} K={K:<5d} err={e:.3e} "
                  f"cublas={ec:.3e} ratio={r:.2f} nonfinite={nf} {'ok' if good else 'FAIL'}",
                  flush=True)
        print(f"SMOKE_DONE {v} {'PASS' if ok else 'FAIL'} worst_ratio={worst:.2f}", flush=True)


def run_smoke_subprocess(nv):
    """each crash (trap / hang) eliminates the variant that was running"""
    remaining = list(range(nv))
    status = {}
    text = []
    while remaining:
        cmd = [sys.executable, os.path.abspath(__file__), "--smoke",
               ",".join(str(v) for v in remaining)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
        text.append(out)
        started = None
        for line in out.splitlines():
            if line.startswith("SMOKE_START"):
                started = int(line.split()[1])
            elif line.startswith("SMOKE_DONE"):
                v = int(line.split()[1])
                status[v] = line.split()[2]
                remaining.remove(v)
                started = None
        if started is not None:
            status[started] = f"CRASH(rc={rc})"
            remaining.remove(started)
        elif rc != 0 and remaining:
            for v in remaining:
                status[v] = f"CRASH(rc={rc}, before start)"
            break
    return status, "\n".join(text)


def main():
    import torch
    quick = "--quick" in sys.argv
    t0 = time.time()
    log("build:", build())
    g = G3()
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cuda "
        f"{torch.version.cuda}")
    status, text = run_smoke_subprocess(g.nv)
    for line in text.splitlines():
        if line.strip():
            LOG.append(line)
    for line in text.splitlines():
        if "FAIL" in line or "CRASH" in line or "Error" in line or "error" in line:
            print(line, flush=True)
    for v in range(g.nv):
        log(f"smoke v{v} {g.names[v]}: {status.get(v)}")
    # time every variant that ran (an inaccurate one still tells what accuracy costs);
    # the table's "best" only counts variants within 2x of cuBLAS's error on that case
    good = [v for v in range(g.nv) if status.get(v) in ("PASS", "FAIL")]
    if not good:
        log("no variant ran; stopping")
        dump()
        return

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device="cuda")
    gen.manual_seed(42)
    cases = [(1024, 8192, 8192, "randn"), (16384, 4096, 4096, "randn"),
             (32768, 4096, 1024, "randn"), (128, 32768, 32768, "randn"),
             (1024, 8192, 2048, "randn"), (1024, 8192, 2048, "x1e3"), (1024, 8192, 2048, "mixed")]
    if quick:
        cases = [(1024, 8192, 2048, "randn"), (1024, 8192, 2048, "mixed")]
    results = []
    for (M, N, K, kind) in cases:
        x, W, b = make_inputs(M, N, K, kind, gen)
        flop = 2.0 * M * N * K
        Kp = (K + 3) // 4 * 4
        ws = (torch.empty(N, Kp, device="cuda"), torch.empty(N, Kp, device="cuda"))
        t_w = bench(lambda: g.split(W, *ws), reps=10, warm=2)[0]
        act = (torch.empty(M, Kp, device="cuda"), torch.empty(M, Kp, device="cuda"))
        t_a = bench(lambda: g.split(x, *act), reps=20)[0]
        ref = ref64(x, W, b)
        refmax = float(ref.abs().max())
        # cuBLAS fp32
        yc = torch.nn.functional.linear(x, W, b)
        ec, _ = max_err(yc, ref)
        del yc
        t_c = bench(lambda: torch.nn.functional.linear(x, W, b))[0]
        row = dict(M=M, N=N, K=K, kind=kind, refmax=refmax, cublas_ms=t_c,
                   cublas_tflops=flop / t_c / 1e9, cublas_err=ec, wsplit_ms=t_w, asplit_ms=t_a,
                   variants={})
        out = torch.empty(M, N, device="cuda")
        for v in good:
            out.fill_(float("nan"))
            g.linear(v, x, ws, b, ws=act, out=out)
            torch.cuda.synchronize()
            e, nf = max_err(out, ref)
            t_all = bench(lambda: g.linear(v, x, ws, b, ws=act, out=out))[0]
            t_g = bench(lambda: g.gemm(v, act[0], act[1], ws[0], ws[1], b, out))[0]
            row["variants"][g.names[v]] = dict(ms=t_all, gemm_ms=t_g, tflops=flop / t_all / 1e9,
                                               err=e, nonfinite=nf, err_ratio=e / max(ec, 1e-30),
                                               speedup=t_c / t_all)
            log(f"  {M}x{N}x{K} {kind:6s} v{v} {g.names[v]:<48s} {t_all:8.3f} ms "
                f"(gemm {t_g:.3f}) {flop / t_all / 1e9:6.1f} TF/s err {e:.3e} "
                f"ratio {e / max(ec, 1e-30):.2f} nonfinite {nf}")
        log(f"  {M}x{N}x{K} {kind:6s} cuBLAS fp32 {t_c:.3f} ms {flop / t_c / 1e9:.1f} TF/s "
            f"err {ec:.3e} |ref|max {refmax:.3e}  wsplit {t_w:.3f} ms asplit {t_a:.3f} ms")
        results.append(row)
        del x, W, b, ws, act, ref, out
        torch.cuda.empty_cache()

    # table: best accurate (3x) variant per case
    log("")
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    hdr = (f"{'M':>6} {'N':>6} {'K':>6} {'input':6} | {'cuBLAS ms':>9} {'TF/s':>5} {'err':>9} | "
           f"{'3xTF32 ms':>9} {'gemm':>7} {'TF/s':>5} {'err':>9} {'err/cub':>7} | {'speedup':>7} "
           f"| {'wsplit':>7} {'best variant'}")
    log(hdr)
    for r in results:
        acc = {k: v for k, v in r["variants"].items()
               if k.startswith("3x") and v["err_ratio"] <= 2.0 and v["nonfinite"] == 0}
        if not acc:
            log(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['kind']:6} | no 3x variant within 2x "
                f"of cuBLAS's error")
            continue
        name, bv = min(acc.items(), key=lambda kv: kv[1]["ms"])
        log(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['kind']:6} | {r['cublas_ms']:9.3f} "
            f"{r['cublas_tflops']:5.1f} {r['cublas_err']:9.2e} | {bv['ms']:9.3f} {bv['gemm_ms']:7.3f} "
            f"{bv['tflops']:5.1f} {bv['err']:9.2e} {bv['err_ratio']:7.2f} | {bv['speedup']:6.2f}x "
            f"| {r['wsplit_ms']:7.3f} {name}")
    log("")
    log("per variant: worst err/cuBLAS over the cases, geomean speedup vs cuBLAS")
    for v in good:
        n = g.names[v]
        rs = [r["variants"][n] for r in results if n in r["variants"]]
        if rs:
            import math
            gm = math.exp(sum(math.log(x["speedup"]) for x in rs) / len(rs))
            log(f"  v{v} {n:<48s} worst ratio {max(x['err_ratio'] for x in rs):7.2f}  "
                f"geomean speedup {gm:5.2f}x  smoke {status.get(v)}")
    log(f"total {time.time() - t0:.0f} s")
    dump(results)


def dump(results=None):
    os.makedirs(OUTDIR, exist_ok=True)
    with open(os.path.join(OUTDIR, "gemm_lab.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    if results is not None:
        with open(os.path.join(OUTDIR, "gemm_lab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        i = sys.argv.index("--smoke")
        vs = None
        if i + 1 < len(sys.argv) and not sys.argv[i + 1].startswith("-"):
            vs = [int(t) for t in sys.argv[i + 1].split(",")]
        smoke(vs)
    else:
        main()
