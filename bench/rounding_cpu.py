"""Which rounding points of a 16-bit plan matter: small specs shaped like the shipped ones, built for the
CPU with eager's rounding points (`intermediates: eager`, the default: each op's output rounded to the
dtype inside the fused stage, kgen.plan.rounding_points) and without them (`intermediates: float32`),
in bfloat16 and float16, on random normal inputs and parameters (several seeds). Prints, per spec,
dtype and form, the largest max abs error over the seeds against eager PyTorch in the same dtype (CPU)
and against float64 (on the same rounded inputs and parameters), eager's own error against float64,
and how many seeds pass KernelBench's 16-bit check (allclose against eager at atol = rtol = 1e-2).

    PYTHONPATH=. python3 bench/rounding_cpu.py [--seeds 5] [--batch 4]

No GPU: the CPU's eager convolutions in 16 bits are not cuDNN's (oneDNN/ATen's accumulate in fp32 and
round once, as cuDNN's do, but in another order), so these numbers show where the rounding points matter,
not what an H200 measures.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kgen.build import build_modules  # noqa: E402
from kgen.ir import load_pipeline  # noqa: E402
from kgen.reference import ReferenceModel  # noqa: E402
from kgen.render import render_spec, write_rendered  # noqa: E402
from kgen.validate import import_module_dir  # noqa: E402

# name -> (input shape after the batch, params, ops): shaped like relu_group_norm, instnorm_clamp_max, a
# convolution before a softmax, a linear layer before a layer norm, and a mean far from zero before a norm
CASES = {
    "conv_relu_group_norm": ("[N, 8, 12, 12]", "", """
  - conv2d: {out_channels: 16, kernel_size: 3}
  - relu
  - group_norm: {num_groups: 4}"""),
    "conv_instnorm_clamp_max": ("[N, 3, 6, 10, 10]", "params:\n  multiplier: {shape: [16, 1, 1, 1], init: randn}\n", """
  - conv3d: {out_channels: 16, kernel_size: 3}
  - mul: {param: multiplier}
  - instance_norm
  - clamp: {min: -1.0, max: 1.0}
  - mul: {param: multiplier}
  - max: {dim: 1}"""),
    "conv_softmax": ("[N, 8, 10, 10]", "", """
  - conv2d: {out_channels: 16, kernel_size: 3}
  - softmax: {dim: 1}"""),
    "conv_scale_softmax": ("[N, 8, 10, 10]", "", """
  - conv2d: {out_channels: 16, kernel_size: 3}
  - mul: {scalar: 4.0}
  - softmax: {dim: 1}"""),
    "linear_layer_norm": ("[N, 6, 64]", "", """
  - linear: {out_features: 96}
  - layer_norm: {normalized_shape: [96]}"""),
    "shift_group_norm": ("[N, 8, 12, 12]", "", """
  - add: {scalar: 6.0}
  - group_norm: {num_groups: 4}"""),
    "shift_relu_group_norm": ("[N, 8, 12, 12]", "", """
  - add: {scalar: 6.0}
  - relu
  - group_norm: {num_groups: 4}
  - sum: {dim: 1}"""),
}
FORMS = ("eager", "float32")  # the spec's `intermediates:`
DTYPES = (torch.bfloat16, torch.float16)
KB_TOL = 1e-2  # KernelBench's atol = rtol in 16 bits


def spec_text(name: str, form: str, batch: int) -> str:
    shape, params, ops = CASES[name]
    return (f"name: {name}_{form}\ninput:\n  shape: {shape}\n  dtype: [bfloat16, float16]\n  example: {{N: {batch}}}\n"
            f"{params}intermediates: {form}\nops:{ops}\n")


def build(root: Path, batch: int) -> dict:
    """(case, form) -> (pipeline, module), every module built for the CPU."""
    dirs = {}
    for name in CASES:
        for form in FORMS:
            spec = root / f"{name}_{form}.yaml"
            spec.write_text(spec_text(name, form, batch))
            write_rendered(render_spec(spec, root / "gen"), root / "gen")
            dirs[name, form] = (spec, root / "gen" / f"{name}_{form}")
    build_modules([d for _, d in dirs.values()], "cpu")
    return {k: (load_pipeline(str(spec)), import_module_dir(d)) for k, (spec, d) in dirs.items()}


def measure(pipe, module, dtype, seed: int, batch: int) -> tuple[float, float, float, bool]:
    """(max abs vs eager, vs float64, eager vs float64, KernelBench's check passes) for one seed."""
    torch.manual_seed(seed)
    ref = ReferenceModel(pipe).eval()
    x = torch.randn(batch, *pipe.input.shape[1:])
    eager = ref.to(dtype)
    model = module.Model().to(dtype)
    model.load_state_dict(eager.state_dict())
    xd = x.to(dtype)
    with torch.no_grad():
        y_eager = eager(xd).double()
        y = model(xd).double()
        y64 = ref.double()(xd.double())  # the same rounded inputs and parameters, exact arithmetic
    ok = torch.allclose(y, y_eager, atol=KB_TOL, rtol=KB_TOL)
    return ((y - y_eager).abs().max().item(), (y - y64).abs().max().item(), (y_eager - y64).abs().max().item(), ok)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mods = build(Path(tmp), args.batch)
        print("| spec | dtype | intermediates | max abs vs eager | max abs vs float64 | eager vs float64 | KernelBench 1e-2 vs eager |")
        print("|---|---|---|---|---|---|---|")
        for name in CASES:
            for dtype in DTYPES:
                for form in FORMS:
                    pipe, mod = mods[name, form]
                    rows = [measure(pipe, mod, dtype, s, args.batch) for s in range(args.seeds)]
                    worst = [max(r[i] for r in rows) for i in range(3)]
                    passed = sum(r[3] for r in rows)
                    print(f"| {name} | {str(dtype).removeprefix('torch.')} | {form} | {worst[0]:.2e} | {worst[1]:.2e} | "
                          f"{worst[2]:.2e} | {passed}/{len(rows)} |")


if __name__ == "__main__":
    main()
