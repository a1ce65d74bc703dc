"""Lab driver (GPU machine) for kernel.cu: instnorm's 3 -> 16 convolution as 3D Winograd F(2,3) in fp32, with
the bias and the max over the channels; checked against float64 (random normal, uniform, ties, large values,
inf / NaN) and eager, timed beside the shipped instnorm_clamp_max module. Compare with
scripts/inst_mma_lab/run_wg32.py (the same work on wgmma, and kgen's FP32 direct loop for it).

    PYTHONPATH=. python scripts/inst_wino_lab/run.py
    LAB_CPT=8 LAB_BY=4 LAB_CI_UNROLL=1 LAB_MINB=3 PYTHONPATH=. python scripts/inst_wino_lab/run.py   # kernel.cu's knobs

The transform matrices are checked first in float64 on the CPU (an emulation of the kernel's algebra).
Results: notes/perf.md (stop 28).
"""
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import torch

from scripts.host_probe import back_to_back_us

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "inst_mma_lab"))
from lab_checks import check_conv_chanmax, print_shipped_time  # noqa: E402 (the instnorm labs' shared check)
BT = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=torch.float64)
G = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float64)
AT = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=torch.float64)


def transformed_weights(w: torch.Tensor) -> torch.Tensor:
    """U = G g G^T in 3D from float64, laid out [pz][py][cin][px][co] as the kernel reads it."""
    U = torch.einsum("ai,bj,ck,oeijk->abeco", G, G, G, w.double().cpu())  # [pz][py][cin][px][co]
    return U.float().contiguous()


def emulate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's algebra in float64 (conv3d without bias), for blocks of 2 x 2 x 2 outputs."""
    x, U = x.double(), torch.einsum("ai,bj,ck,oeijk->oeabc", G, G, G, w.double())
    n, _, d, h, wd = x.shape
    od, oh, ow = d - 2, h - 2, wd - 2
    tiles = x.unfold(2, 4, 2).unfold(3, 4, 2).unfold(4, 4, 2)  # [n, cin, bz, by, bx, 4, 4, 4]
    V = torch.einsum("ai,bj,ck,nezyxijk->nezyxabc", BT, BT, BT, tiles)
    M = torch.einsum("oeabc,nezyxabc->nozyxabc", U, V)
    Y = torch.einsum("ia,jb,kc,nozyxabc->nozyxijk", AT, AT, AT, M)  # [n, co, bz, by, bx, 2, 2, 2]
    return Y.permute(0, 1, 2, 5, 3, 6, 4, 7).reshape(n, -1, od, oh, ow)


xs, ws = torch.randn(2, 3, 16, 32, 32, dtype=torch.float64), torch.randn(16, 3, 3, 3, 3, dtype=torch.float64)
err = (emulate(xs, ws) - torch.nn.functional.conv3d(xs, ws)).abs().max().item()
print(f"float64 emulation of the transforms against conv3d: max |diff| {err:.2e}")
assert err < 1e-10

KNOBS = {k: os.environ.get(k, d) for k, d in [("LAB_CPT", "16"), ("LAB_BY", "8"), ("LAB_CI_UNROLL", "1"), ("LAB_MINB", "2")]}
TAG = " ".join(f"{k[4:]}={v}" for k, v in KNOBS.items())
so = HERE / "build" / ("libwino_" + "_".join(KNOBS.values()) + ".so")
so.parent.mkdir(exist_ok=True)
r = subprocess.run(["nvcc", "-O3", "-std=c++17", *[f"-D{k}={v}" for k, v in KNOBS.items()], "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                    "-Xptxas", "-v", "-o", str(so), str(HERE / "kernel.cu")], capture_output=True, text=True)
print("\n".join(l for l in r.stderr.splitlines() if "Used" in l or "spill" in l or "error" in l))
r.check_returncode()
lib = ctypes.CDLL(str(so))


def lab(x, U, bias):
    out = torch.empty(x.shape[0], 14, 30, 30, device="cuda")
    err = lib.lab_run(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(U.data_ptr()), ctypes.c_void_p(bias.data_ptr()),
                      ctypes.c_void_p(out.data_ptr()), x.shape[0], ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert err == 0, err
    return out


torch.manual_seed(0)
w = torch.randn(16, 3, 3, 3, 3, device="cuda") * 0.2
b = torch.randn(16, device="cuda")
U = transformed_weights(w).cuda()
check_conv_chanmax(lambda x: lab(x, U, b), w, b, eager_fp32=True)

x = torch.randn(128, 3, 16, 32, 32, device="cuda")
for _ in range(3):
    print(f"wino {TAG} conv+bias+chanmax: back-to-back {back_to_back_us(lambda: lab(x, U, b)):.1f} us")
if os.environ.get("LAB_SHIPPED", "1") == "0":
    raise SystemExit
print_shipped_time(x)
