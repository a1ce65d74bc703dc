"""Per-kernel GPU time of generated modules (torch.profiler), and each fused
stage op timed alone on a full-size input. For the GPU machine:

    PYTHONPATH=. python bench/profile_stages.py maxpool_sum avgpool_sigmoid_sum
    PYTHONPATH=. python bench/profile_stages.py --norewrite relu_group_norm
    PYTHONPATH=. python bench/profile_stages.py --host maxpool_sum   # + the host side: where a call's time goes
    PYTHONPATH=. python bench/profile_stages.py --gen build/kernelbench/generated_gpu kb2_34_...   # modules built elsewhere
    PYTHONPATH=. python bench/profile_stages.py --gen build/dtypes/gen --dtype bfloat16 maxpool_sum_dt  # a 16-bit plan
"""
import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kgen.bench import time_ms
from kgen.runtime import launches_one_by_one
from kgen.cli import _spec_of
from kgen.ir import load_pipeline
from kgen.plan import choose_plans, stage_op_name
from kgen.spec import REWRITE_NAMES
from kgen.validate import import_module_dir, init_args, pack_buffer, stage_tensors_in
from kgen.variants import baseline_module


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--norewrite", action="store_true")
    ap.add_argument("--once", action="store_true", help="only run each stage op once (for ncu)")
    ap.add_argument("--host", action="store_true", help="also profile the CPU side (ops by self CPU time)")
    ap.add_argument("--gen", type=Path, default=Path("generated"), help="where the built modules are")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the plan of this dtype (the module must have one: bench/gpu_dtypes.sh builds them)")
    args = ap.parse_args()
    for name in args.names:
        module_dir = args.gen / name
        spec = _spec_of(module_dir)
        pipe = load_pipeline(spec)
        d = baseline_module(spec) if args.norewrite else module_dir
        sel = choose_plans(pipe, rewrites={n: False for n in REWRITE_NAMES} if args.norewrite else None)
        index = sel.variants.index(sel.variant_for(pipe.example_batch(), dtype=args.dtype))
        plan = sel.plans[index]
        op_of = lambda st: getattr(torch.ops.kgen, stage_op_name(d.name, index, len(sel.variants), st.index))  # noqa: E731
        mod = import_module_dir(d)
        torch.manual_seed(0)
        dtype = getattr(torch, args.dtype)
        model = mod.Model(*init_args(mod)).cuda().to(dtype)
        x = torch.randn(pipe.input.concrete(pipe.example_batch()), device="cuda", dtype=dtype)
        if args.once:
            stage_once(pipe, plan, op_of, model, args.dtype)
            continue
        with torch.no_grad():
            total = time_ms(lambda: model(x), 20)
            activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host else [])
            with profile(activities=activities) as prof, launches_one_by_one():  # each stage's range
                for _ in range(5):
                    model(x)
                torch.cuda.synchronize()
        events = prof.key_averages()
        # kernels (and memsets/copies): device time and no CPU time of their own; kgen's ranges are not kernels
        gpu_ms = sum(e.self_device_time_total for e in events
                     if e.self_cpu_time_total == 0 and not e.key.startswith("kgen::")) / 5 / 1e3
        print(f"==== {d.name} ({args.dtype}): {total:.3f} ms per call, GPU busy {gpu_ms:.3f} ms of it")
        print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
        if args.host:
            print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
            print(f"  host: {host_ms(lambda: model(x)):.3f} ms to issue one call (median, queue drained before each)")
        for st, call, tiles in stage_calls(pipe, plan, op_of, model, args.dtype):
            with torch.no_grad():
                ms = time_ms(call, 20)
            nbytes = x.element_size() * (sum(tl.numel() for tl in tiles) + st.out_type.sample_numel * pipe.example_batch())
            print(f"  stage {st.index} ({st.kind}) alone: {ms:.3f} ms, {nbytes / 1e6:.0f} MB -> {nbytes / ms / 1e9:.2f} TB/s")


def host_ms(fn, reps=20):
    """Median wall time of fn() returning, the GPU idle before each call: how long the
    host takes to issue a call's kernels (the GPU waits on it where this is longer
    than a kernel ahead in the queue)."""
    import statistics
    import time

    times = []
    with torch.no_grad():
        for _ in range(reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def stage_calls(pipe, plan, op_of, model, dtype: str):
    """(stage, a call of its op alone on a random full-size input, the packed input) per kernel stage of the
    ``dtype`` plan: the op takes (input tiles, the stage's tensors, the values it reads), as the module calls it."""
    batch = pipe.example_batch()
    with torch.no_grad():
        tensors = stage_tensors_in(plan, plan.pipeline.with_stage_tensors({n: p.detach() for n, p in model.state_dict().items()}), dtype)
    dtype = getattr(torch, dtype)
    for st in plan.kernel_stages():
        op = op_of(st)
        args = [tensors[a.name] for a in plan.stage_args(st)]
        values = [torch.randn(plan.pipeline.values[n].concrete(batch), device="cuda", dtype=dtype) for n in plan.stage_values(st)]
        tiles = pack_buffer(st.input, torch.randn(st.in_type.concrete(batch), device="cuda", dtype=dtype))
        yield st, (lambda op=op, tiles=tiles, args=args, values=values: op(tiles, args, values)), tiles


def stage_once(pipe, plan, op_of, model, dtype):
    for _, call, _ in stage_calls(pipe, plan, op_of, model, dtype):
        with torch.no_grad():
            call()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
