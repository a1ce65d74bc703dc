"""conv_gemm's split-TF32 error as K grows (notes/next_kernelbench.md "after stop 34" item 2).

The window loop accumulates each tile's split products (a_lo b_hi + a b_lo + a b_hi) in the MMA's fp32
accumulators over the whole K. Hopper's tensor cores truncate that accumulation (notes/gemm_lab.md), so
the error may grow with K. For conv2d C -> 64, k3 (K = 9 C), this prints kgen's and eager's (cuDNN, TF32
off) max |error| against float64, relative to the output's largest |value|, on normal data and on positive
data (rand x, |randn| w: every accumulation has one sign, where truncation adds up).

    PYTHONPATH=. python scripts/conv_lab/k_error.py [--out DIR]
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

from kgen.build import build_modules
from kgen.render import render_spec, write_rendered
from kgen.validate import import_module_dir

CHANNELS = [8, 32, 128, 512, 1024]
SPEC = """name: kerr_{c}
input: {{shape: [N, {c}, 20, 20], dtype: float32, example: {{N: 4}}}}
ops:
  - conv2d: {{out_channels: 64, kernel_size: 3}}
plan: {{conv: gemm}}
precision: tf32x3
"""


def errors(model, x, w, b):
    with torch.no_grad():
        params = dict(model.named_parameters())
        # the generated module's parameters: the weight and bias of its only convolution
        (wname,) = [k for k, v in params.items() if v.dim() == 4]
        (bname,) = [k for k, v in params.items() if v.dim() == 1]
        params[wname].copy_(w)
        params[bname].copy_(b)
        got = model(x).double()
        ref = torch.nn.functional.conv2d(x.double(), w.double(), b.double())
        torch.backends.cudnn.allow_tf32 = False
        eager = torch.nn.functional.conv2d(x, w, b).double()
        torch.backends.cudnn.allow_tf32 = True
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() / scale, (eager - ref).abs().max().item() / scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (the CPU build is ATen's)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kerr_"))
    dirs = []
    for c in CHANNELS:
        spec = root / f"kerr_{c}.yaml"
        spec.write_text(SPEC.format(c=c))
        write_rendered(render_spec(spec, root / "gen"), root / "gen")
        dirs.append(root / "gen" / f"kerr_{c}")
    build_modules(dirs, args.device)
    dev = args.device
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for c, d in zip(CHANNELS, dirs):
        mod = import_module_dir(d)
        model = mod.Model(*mod.get_init_inputs()).to(dev) if hasattr(mod, "get_init_inputs") else mod.Model().to(dev)
        shape = (4, c, 20, 20)
        for data in ("normal", "positive"):
            if data == "normal":
                x = torch.randn(shape, device=dev, generator=g)
                w = torch.randn(64, c, 3, 3, device=dev, generator=g) / (9 * c) ** 0.5
            else:
                x = torch.rand(shape, device=dev, generator=g)
                w = torch.randn(64, c, 3, 3, device=dev, generator=g).abs() / (9 * c) ** 0.5
            b = torch.randn(64, device=dev, generator=g)
            k, e = errors(model, x, w, b)
            rows.append({"K": 9 * c, "data": data, "kgen": k, "eager": e, "ratio": k / e if e else float("inf")})
            print(f"K = {9 * c:5d} {data:8s} kgen {k:.2e}  eager {e:.2e}  kgen/eager {rows[-1]['ratio']:.2f}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "k_error.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
