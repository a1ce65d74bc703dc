"""Lab driver (GPU machine): build a lab kernel, check it against float64, time it beside the shipped module.

    PYTHONPATH=. python scripts/inst_mma_lab/run.py                       # kernel.cu, tile (2, 16, 32)
    LAB_SRC=kernel_raw.cu PYTHONPATH=. python scripts/inst_mma_lab/run.py  # the raw-box form
    LAB_TH=8 LAB_MINB=3 LAB_GROUP=8 ...                                    # tile height, CTAs/SM, MMA groups

Results (H100, stop 22) are in notes/perf.md.
"""
import ctypes, subprocess, sys, time
from pathlib import Path
import torch

HERE = Path(__file__).resolve().parent
so = HERE / "build" / "liblab.so"
so.parent.mkdir(exist_ok=True)
import os
GROUP = os.environ.get("LAB_GROUP", "4")
so = so.with_name(f"liblab_{os.environ.get('LAB_SRC', 'kernel.cu')[:-3]}_g{GROUP}_th{os.environ.get('LAB_TH', 16)}_mb{os.environ.get('LAB_MINB', 3)}.so")
r = subprocess.run(["nvcc", "-O3", "-std=c++17", f"-DLAB_GROUP={GROUP}", f"-DLAB_TH={os.environ.get('LAB_TH', 16)}", f"-DLAB_MINB={os.environ.get('LAB_MINB', 3)}", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                    "-Xptxas", "-v", "-o", str(so), str(HERE / os.environ.get("LAB_SRC", "kernel.cu"))], capture_output=True, text=True)
print(r.stderr[-1500:]); r.check_returncode()
lib = ctypes.CDLL(str(so))

def pack(w):
    """[16, 3, 3, 3, 3] -> [11 steps][32 lanes][hi a0..a3, lo a0..a3] (channels as M, rows r = 4q + t)."""
    w = w.double().cpu()
    P = torch.zeros(11, 32, 8, dtype=torch.float32)
    def tap(c):
        return None if c >= 21 else (c // 3, c % 3)
    def split(v):
        v32 = torch.tensor([v], dtype=torch.float32)
        hi = (v32.view(torch.int32) & -8192).view(torch.float32)
        lo = v32 - hi
        if lo.item() == 0.0:
            lo = torch.tensor([1.17549435e-38 if v >= 0 else -1.17549435e-38], dtype=torch.float32)
        return hi.item(), lo.item()
    for s in range(11):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            vals = []
            for half in range(2):
                qk = tap(2 * s + half)
                for co in (g, g + 8):
                    if qk is None or 4 * qk[0] + t >= 27:
                        vals.append(None)
                    else:
                        r = 4 * qk[0] + t
                        vals.append(float(w[co, r // 9, r // 3 % 3, r % 3, qk[1]]))
            # order a0 (g, slot t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
            for i, v in enumerate(vals):
                hi, lo = (0.0, 0.0) if v is None else split(v)
                P[s, lane, i], P[s, lane, 4 + i] = hi, lo
    return P.cuda()

def lab(x, packed, bias):
    out = torch.empty(x.shape[0], 14, 30, 30, device="cuda")
    err = lib.lab_run(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(bias.data_ptr()),
                      ctypes.c_void_p(out.data_ptr()), x.shape[0], ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert err == 0, err
    return out

def median_ms(fn, n=40):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(n):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    t.sort(); return t[len(t) // 2]

def back_to_back_us(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1e6

torch.manual_seed(0)
w = torch.randn(16, 3, 3, 3, 3, device="cuda") * 0.2
b = torch.randn(16, device="cuda")
P = pack(w)
for batch, kind in [(3, "randn"), (2, "big"), (2, "inf"), (128, "randn")]:
    x = torch.randn(batch, 3, 16, 32, 32, device="cuda")
    if kind == "big": x = x * 1e30
    if kind == "inf": x[0, 1, 5, 7, 9] = float("inf"); x[1, 0, 3, 3, 3] = float("nan")
    y = lab(x, P, b); torch.cuda.synchronize()
    ref = torch.nn.functional.conv3d(x.double(), w.double(), b.double()).amax(1)
    if kind == "inf":  # amax propagates NaN; the lab's fmaxf does not: compare where ref is finite
        m = torch.isfinite(ref)
        print(kind, "finite-part max err", (y.double() - ref)[m].abs().max().item(), "nonfinite ref", (~m).sum().item(),
              "lab nonfinite there", (~torch.isfinite(y[~m])).sum().item())
        continue
    err = ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()
    print(f"{kind} batch {batch}: max rel err {err:.3e}")

x = torch.randn(128, 3, 16, 32, 32, device="cuda")
print(f"{os.environ.get('LAB_SRC', 'kernel.cu')} group {GROUP} th {os.environ.get('LAB_TH', 16)} minb {os.environ.get('LAB_MINB', 3)}: lab conv+bias+chanmax: event {median_ms(lambda: lab(x, P, b)) * 1e3:.1f} us, back-to-back {back_to_back_us(lambda: lab(x, P, b)):.1f} us")
torch.backends.cudnn.allow_tf32 = False
print(f"cudnn fp32 conv alone: back-to-back {back_to_back_us(lambda: torch.nn.functional.conv3d(x, w, b)):.1f} us")
sys.path.insert(0, ".")
try:
    from generated import instnorm_clamp_max as m
    model = m.Model().cuda()
    with torch.no_grad():
        print(f"shipped instnorm_clamp_max: back-to-back {back_to_back_us(lambda: model(x)):.1f} us, event {median_ms(lambda: model(x)) * 1e3:.1f} us")
except Exception as e:
    print("shipped module:", e)
