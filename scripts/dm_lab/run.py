"""dm_lab driver (GPU machine): div_max_gap_bias_sum's pipeline as one wgmma kernel (kernel.cu), checked
against float64 on random and adversarial inputs, timed.

    PYTHONPATH=. python scripts/dm_lab/run.py                        # kernel.cu
    LAB_SRC=kernel_ws.cu PYTHONPATH=. python scripts/dm_lab/run.py   # the warp-specialized form
    LAB_SRC=kernel_cm.cu PYTHONPATH=. python scripts/dm_lab/run.py   # mma.sync, output channels as M

LAB_DEFS (macros, e.g. "LAB_NOLOAD"), LAB_TIME_ONLY=1, LAB_QUICK=1, LAB_NCU=1 (one call). Results: notes/perf.md, stop 25.
"""
import ctypes, os, subprocess, sys
from pathlib import Path
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
(HERE / "build").mkdir(exist_ok=True)
SRC = os.environ.get("LAB_SRC", "kernel.cu")  # kernel_ws.cu: the warp-specialized form
EXTRA = [f"-D{d}" for d in os.environ.get("LAB_DEFS", "").split()]
so = HERE / "build" / ("liblab_" + SRC.split(".")[0] + "".join("_" + d for d in os.environ.get("LAB_DEFS", "").split()) + ".so")
r = subprocess.run(["nvcc", "-O3", "-std=c++17", *EXTRA, "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                    "-Xptxas", "-v", "-I", str(ROOT / "templates" / "conv_gemm"), "-o", str(so), str(HERE / SRC)],
                   capture_output=True, text=True)
print(r.stderr[-700:]); r.check_returncode()
lib = ctypes.CDLL(str(so))
P_POOLED = 7 * 31 * 31


def tf32(t):
    b = t.contiguous().view(torch.int32)
    return ((b + 0x1000) & -8192).view(torch.float32)


def pack(w):
    """w [16, 8, 3, 3, 3] -> [9 (kh, kw)][2 quads][3 blocks: kd = 2, 1, 0][16 channels][4]."""
    out = torch.empty(9, 2, 3, 16, 4, device=w.device)
    for kh in range(3):
        for kw in range(3):
            for blk in range(3):
                tap = w[:, :, 2 - blk, kh, kw]  # [16 co, 8 ci]
                out[kh * 3 + kw, :, blk] = tap.reshape(16, 2, 4).permute(1, 0, 2)
    return tf32(out).contiguous()


def pack_ws(w):
    """w -> [9 (kh, kw)][2 quads][5 blocks: zero, kd = 2, 1, 0, zero][16 channels][4] (kernel_ws.cu)."""
    out = torch.zeros(9, 2, 5, 16, 4, device=w.device)
    for kh in range(3):
        for kw in range(3):
            for blk in range(1, 4):
                out[kh * 3 + kw, :, blk] = w[:, :, 3 - blk, kh, kw].reshape(16, 2, 4).permute(1, 0, 2)
    return tf32(out).contiguous()


def pack_cm(w):
    """w -> [27 taps][32 lanes][4]: lane 4 g + t's m16n8k8 A fragment (rows g, g + 8; columns t, t + 4) of the tap (kernel_cm.cu)."""
    taps = w.reshape(16, 8, 27).permute(2, 0, 1)  # [tap][co][ci]
    g, t = torch.arange(8).repeat_interleave(4), torch.arange(4).repeat(8)
    out = torch.stack([taps[:, g, t], taps[:, g + 8, t], taps[:, g, t + 4], taps[:, g + 8, t + 4]], dim=-1)
    return tf32(out).contiguous()


TILES = lib.lab_tiles_per_sample() if hasattr(lib, "lab_tiles_per_sample") else 56


def lab(x, packed, b, bias2):
    n = x.shape[0]
    partial = torch.empty(n * TILES, device="cuda")
    err = lib.lab_run(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(b.data_ptr()),
                      ctypes.c_void_p(partial.data_ptr()), n, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert err == 0, err
    return partial.view(n, TILES).sum(1) / P_POOLED + bias2.sum()


def reference(x, w, b, bias2):
    y = F.max_pool3d(F.conv3d(x, w, b) / 2.0, 2)
    return (y.mean(dim=(2, 3, 4)) + bias2.view(1, 16)).sum(1)


def median_ms(fn, n=30):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(n):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    t.sort(); return t[len(t) // 2]


torch.manual_seed(0)
conv = torch.nn.Conv3d(8, 16, 3).cuda()
w, b = conv.weight.detach(), conv.bias.detach()
bias2 = torch.randn(16, device="cuda")
P = {'kernel_ws.cu': pack_ws, 'kernel_cm.cu': pack_cm, 'kernel_cp.cu': pack_cm}.get(SRC, pack)(w)
ok = True
QUICK = os.environ.get("LAB_QUICK") == "1"
if os.environ.get("LAB_NCU") == "1":  # one call, for ncu
    x = torch.randn(128, 8, 16, 64, 64, device="cuda")
    lab(x, P, b, bias2); torch.cuda.synchronize(); sys.exit(0)
if os.environ.get("LAB_TIME_ONLY") == "1":
    x = torch.randn(128, 8, 16, 64, 64, device="cuda")
    ts = [median_ms(lambda: lab(x, P, b, bias2), 50) for _ in range(3)]
    print(f"{os.environ.get('LAB_DEFS', 'default')} batch 128: lab " + " / ".join(f"{t:.3f}" for t in ts) + " ms (medians of 50)")
    sys.exit(0)
cases = [(2, "randn"), (2, "nan_inf")] if QUICK else [(2, "randn"), (3, "rand"), (1, "big"), (2, "nan_inf"), (1, "ties"), (5, "randn")]
for batch, kind in cases:
    x = torch.randn(batch, 8, 16, 64, 64, device="cuda")
    if kind == "rand": x = torch.rand_like(x)
    if kind == "big": x = x * 1e30
    if kind == "ties": x = torch.ones_like(x)
    if kind == "nan_inf":
        x[0, 3, 5, 7, 9] = float("nan"); x[1, 0, 15, 0, 63] = float("inf"); x[1, 5, 0, 63, 0] = float("-inf")
    y = lab(x, P, b, bias2); torch.cuda.synchronize()
    ref = reference(x.double(), w.double(), b.double(), bias2.double())
    ref_tf32 = reference(tf32(x).double(), tf32(w).double(), b.double(), bias2.double())
    eager = reference(x, w, b, bias2)
    same_nan = torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    m = torch.isfinite(ref)
    scale = max(ref[m].abs().max().item(), 1e-30) if m.any() else 1.0
    err = (y.double() - ref)[m].abs().max().item() / scale if m.any() else 0.0
    err_k = (y.double() - ref_tf32)[m].abs().max().item() / scale if m.any() else 0.0
    err_e = (eager.double() - ref)[m].abs().max().item() / scale if m.any() else 0.0
    print(f"{kind:8s} batch {batch}: lab vs f64 {err:.2e}, lab vs TF32-operand exact {err_k:.2e}, eager vs f64 {err_e:.2e}; "
          f"nonfinite same: {same_nan} ({(~m).sum().item()} nonfinite)", flush=True)
    ok &= same_nan and err_k < 2e-5
if not QUICK:
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.rand(128, 8, 16, 64, 64, device="cuda")
        y, e = lab(x, P, b, bias2), reference(x, w, b, bias2)
        print(f"KernelBench-style seed {seed}: allclose {torch.allclose(y, e, atol=1e-4, rtol=1e-4)}, max abs diff {(y - e).abs().max().item():.2e}")
    x = torch.randn(128, 8, 16, 64, 64, device="cuda")
    t = median_ms(lambda: lab(x, P, b, bias2))
    t_conv = median_ms(lambda: F.conv3d(x, w, b))
    print(f"batch 128: lab {t:.3f} ms ({47.6 / t:.0f} TFLOP/s); cuDNN conv3d alone {t_conv:.3f} ms")
print("CHECK", "ok" if ok else "FAILED")
