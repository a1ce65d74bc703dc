"""Times spec variants' CUDA modules (kgen only, and eager beside each) at their example batch:
for an A/B of what a stage's ops cost inside a fused kernel (e.g. a conv_gemm epilogue with and
without its transcendental op). Builds every spec at once, then times them in turns (kgen.bench's
blocks, medians).

    PYTHONPATH=. python scripts/conv_lab/time_specs.py SPEC... [--reps 20] [--profile]

--profile also prints each module's kernels (torch.profiler, CUDA time per call); --once runs each
module once, untimed (under ncu: `ncu -k regex:conv_kernel python scripts/conv_lab/time_specs.py --once ...`).
"""
import argparse
import tempfile
from pathlib import Path

import torch

from kgen.bench import models_and_inputs, time_in_blocks
from kgen.build import build_modules
from kgen.render import render_spec, write_rendered


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+", type=Path)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="time_specs_"))
    dirs = []
    for spec in args.specs:
        rendered = render_spec(spec, root)
        write_rendered(rendered, root)
        dirs.append(root / rendered.name)
    build_modules(dirs, "cuda")
    for spec, d in zip(args.specs, dirs):
        _, batch, model, ref, inputs = models_and_inputs(d, spec)
        if args.once:
            with torch.no_grad():
                model(*inputs)
            torch.cuda.synchronize()
            continue
        with torch.no_grad():
            t = time_in_blocks({"kgen": lambda: model(*inputs), "eager": lambda: ref(*inputs)}, args.reps)
        print(f"{spec.stem}: batch {batch}, kgen {t['kgen']:.3f} ms, eager {t['eager']:.3f} ms", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    model(*inputs)
                torch.cuda.synchronize()
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
                print(f"    {e.device_time_total / 5 / 1e3:8.3f} ms/call  {e.key[:110]}")
        del model, ref, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
