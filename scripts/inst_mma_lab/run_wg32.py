"""Lab driver (GPU machine) for kernel_wg32.cu: instnorm's 3 -> 16 convolution on wgmma (N = 32, split TF32)
with the bias and the max over channels; checked against float64 (random normal, large values, inf / NaN),
timed beside cuDNN's fp32 convolution, kgen's FP32 direct loop for the same conv + max (a spec rendered here),
and the shipped instnorm_clamp_max module.

    PYTHONPATH=. python scripts/inst_mma_lab/run_wg32.py
    LAB_T=2 LAB_MINB=4 PYTHONPATH=. python scripts/inst_mma_lab/run_wg32.py   # m-tiles per warpgroup, CTAs per SM
    LAB_SYNC_BOX=1 ...                                                         # the box loaded synchronously

Results: notes/perf.md (stop 27).
"""
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lab_checks import check_conv_chanmax, print_shipped_time
from scripts.host_probe import back_to_back_us

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
T, MINB, SYNC = os.environ.get("LAB_T", "4"), os.environ.get("LAB_MINB", "3"), os.environ.get("LAB_SYNC_BOX", "0")
so = HERE / "build" / f"libwg32_t{T}_mb{MINB}_s{SYNC}.so"
so.parent.mkdir(exist_ok=True)
r = subprocess.run(["nvcc", "-O3", "-std=c++17", f"-DLAB_T={T}", f"-DLAB_MINB={MINB}", f"-DLAB_SYNC_BOX={SYNC}", "-gencode=arch=compute_90a,code=sm_90a",
                    "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v", "-o", str(so), str(HERE / "kernel_wg32.cu")],
                   capture_output=True, text=True)
print("\n".join(l for l in r.stderr.splitlines() if "Used" in l or "spill" in l or "error" in l or "C7519" in l)[-1500:])
r.check_returncode()
lib = ctypes.CDLL(str(so))

K, STEPS = 112, 14


def pack(w: torch.Tensor) -> torch.Tensor:
    """B[k][n] (k = (cin, kd' 0..3, kh, kw), n = (plane, channel)) as [hi | lo][step][n-tile][k quad][8 n][4 k]."""
    w = w.float().cpu()
    B = torch.zeros(K, 32)
    for k in range(108):
        kw, kh, kdp, cin = k % 3, k // 3 % 3, k // 9 % 4, k // 36
        for n in range(32):
            p, co = n // 16, n % 16
            kd = kdp - p
            if 0 <= kd <= 2:
                B[k, n] = w[co, cin, kd, kh, kw]
    hi = (B.view(torch.int32) + 0x1000).bitwise_and(-8192).view(torch.float32)  # round half away, as cvt.rna
    lo = B - hi

    def layout(M):
        # [step s][n-tile j][quad q][nn][kk] = M[8s + 4q + kk][8j + nn]
        return M.view(STEPS, 2, 4, 4, 8).permute(0, 3, 1, 4, 2).contiguous().view(-1)

    return torch.cat([layout(hi), layout(lo)]).cuda()


def lab(x, packed, bias):
    out = torch.empty(x.shape[0], 14, 30, 30, device="cuda")
    err = lib.lab_run(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(bias.data_ptr()),
                      ctypes.c_void_p(out.data_ptr()), x.shape[0], ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert err == 0, err
    return out


def median_us(fn, n=40):
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(n):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    t.sort()
    return t[len(t) // 2] * 1e3


torch.manual_seed(0)
w = torch.randn(16, 3, 3, 3, 3, device="cuda") * 0.2
b = torch.randn(16, device="cuda")
P = pack(w)
check_conv_chanmax(lambda x: lab(x, P, b), w, b)

x = torch.randn(128, 3, 16, 32, 32, device="cuda")
print(f"wg32 T={T} minb={MINB} sync_box={SYNC}: conv+bias+chanmax: event {median_us(lambda: lab(x, P, b)):.1f} us, "
      f"back-to-back {back_to_back_us(lambda: lab(x, P, b)):.1f} us")
torch.backends.cudnn.allow_tf32 = False
print(f"cudnn fp32 conv alone: back-to-back {back_to_back_us(lambda: torch.nn.functional.conv3d(x, w, b)):.1f} us")
sys.path.insert(0, str(ROOT))
env = dict(os.environ, PYTHONPATH=str(ROOT), KGEN_TARGET="default")
with tempfile.TemporaryDirectory() as tmp:  # kgen's FP32 direct loop for the same conv + max
    spec = Path(tmp) / "specs" / "lab_conv_max_ieee.yaml"
    spec.parent.mkdir()
    spec.write_text("name: lab_conv_max_ieee\ninput:\n  shape: [N, 3, 16, 32, 32]\n  dtype: float32\n  example: {N: 128}\n"
                    "ops:\n  - conv3d: {out_channels: 16, kernel_size: 3}\n  - max: {dim: 1}\nprecision: ieee\nplan: {conv: gemm}\n")
    gen = Path(tmp) / "generated"
    for cmd in (["render", "--out", str(gen), str(spec)], ["build", "--out", str(gen), "lab_conv_max_ieee"]):
        proc = subprocess.run([sys.executable, "-m", "kgen", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            print("kgen", cmd[0], "failed:", proc.stderr[-800:])
            break
    else:
        from kgen.validate import import_module_dir
        mod = import_module_dir(gen / "lab_conv_max_ieee")
        model = mod.Model().cuda()
        with torch.no_grad():
            model.conv.weight.copy_(w); model.conv.bias.copy_(b)
            d = (model(x) - lab(x, P, b)).abs().max().item()
            print(f"kgen direct loop (ieee) conv+bias+chanmax: back-to-back {back_to_back_us(lambda: model(x)):.1f} us, "
                  f"event {median_us(lambda: model(x)):.1f} us; max |lab - it| {d:.2e}")
print_shipped_time(x)
