"""Where the time goes in eager PyTorch, torch.compile and kgen on the same call: each one's
kernels (torch.profiler, device time per call), at the spec's example batch. For the GPU
machine, on specs `kgen import` wrote (built into --gen first if not built there):

    PYTHONPATH=. python bench/profile_vs_inductor.py build/kb2loss/specs/kb2_54_*.yaml
    PYTHONPATH=. python bench/profile_vs_inductor.py --training build/kernelbench3/specs/kb3_8_*.yaml
    PYTHONPATH=. python bench/profile_vs_inductor.py --dtype bfloat16 build/kernelbench/specs/kb2_1_*.yaml

--dtype bfloat16 (or float16): each spec copied with its input in that dtype (into --gen's `specs` folder, as
bench/kernelbench_gpu.py --dtype does), and the three models converted with .to(dtype).
"""
import argparse
import subprocess
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kgen.bench import models_and_inputs, time_in_blocks
from kgen.runtime import launches_one_by_one

CALLS = 5


def kernels(fn) -> tuple[float, list[tuple[str, float, int]]]:
    """(device ms per call, [(kernel, ms per call, launches per call)] by time)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / CALLS / 1e3, e.count // CALLS) for e in prof.key_averages()
            if e.self_cpu_time_total == 0 and e.self_device_time_total > 0 and not e.key.startswith("kgen::")]
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+", type=Path)
    ap.add_argument("--gen", type=Path, default=Path("build/profile"))
    ap.add_argument("--training", action="store_true", help="batch norm with batch statistics (KernelBench's mode)")
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    if args.dtype != "float32":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kernelbench_gpu import spec_in_dtype

        args.specs = [spec_in_dtype(s, args.dtype, args.gen / "specs") for s in args.specs]
    for spec in args.specs:
        name = spec.stem
        if not (args.gen / name).exists():
            subprocess.run([sys.executable, "-m", "kgen", "render", str(spec), "--out", str(args.gen)], check=True)
        subprocess.run([sys.executable, "-m", "kgen", "build", "--out", str(args.gen), name], check=True,
                       stdout=subprocess.DEVNULL)
        pipe, batch, model, ref, inputs = models_and_inputs(args.gen / name, spec, args.dtype)
        model.train(args.training)
        ref.train(args.training)
        compiled = torch.compile(ref)
        fns = {"eager": lambda: ref(*inputs), "torch.compile": lambda: compiled(*inputs), "kgen": lambda: model(*inputs)}
        with torch.no_grad():
            times = time_in_blocks(fns, 20)
            print(f"==== {name} ({args.dtype}, batch {batch}, {'training' if args.training else 'eval'} mode): " +
                  ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
            for label, fn in fns.items():
                with launches_one_by_one():  # kgen's kernels one by one, not as one graph launch
                    busy, rows = kernels(fn)
                print(f"  -- {label}: kernels {busy:.3f} ms per call, {sum(r[2] for r in rows)} launches")
                for key, ms, count in rows[:args.rows]:
                    print(f"     {ms:8.4f} ms  x{count:<3d} {key[:110]}")


if __name__ == "__main__":
    main()
