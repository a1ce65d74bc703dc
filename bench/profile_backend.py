#!/usr/bin/env python3
"""Where a KernelBench problem's time goes under eager PyTorch, torch.compile (inductor) and
torch.compile(backend="kgen"): per form, the time of a call (CUDA events, mean of 10 after WARMUP_CALLS calls)
and its kernels and ranges by device time (torch.profiler over 5 calls; kgen's ops launch one by one, so each
stage's range ``kgen::<module> stage N (family)`` shows beside its kernels; a range's time includes its
kernels'). Then the backend's partitions. For a GPU machine, KernelBench's folder from ``fetch`` (never copied
into this project):

    PYTHONPATH=. python3 bench/profile_backend.py --kernelbench KB/KernelBench --level 3 --problems 6,17
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timeline import call_timeline  # noqa: E402
from kernelbench_backend import INIT_SEED, compiled_copy, load_problem, problem_file, problem_numbers  # noqa: E402

CALLS_TIMED, CALLS_PROFILED = 10, 5
WARMUP_CALLS = 40  # (the backend measures its partitions' forms, then each graph's, in their first calls: ~25)


def profile_form(name: str, fn, xs, rows_shown: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kgen.bench import time_call
    from kgen.runtime import launches_one_by_one

    t = time.time()
    for _ in range(WARMUP_CALLS):
        fn(*xs)
    torch.cuda.synchronize()
    first = time.time() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS_TIMED):
        fn(*xs)
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof, launches_one_by_one():
        for _ in range(CALLS_PROFILED):
            fn(*xs)
        torch.cuda.synchronize()
    rows = sorted((k for k in prof.key_averages() if k.self_device_time_total > 0), key=lambda k: -k.self_device_time_total)
    drained = statistics.median(time_call(lambda: fn(*xs)) for _ in range(CALLS_TIMED))
    print(f"-- {name}: {start.elapsed_time(end) / CALLS_TIMED:.3f} ms a call back to back, {drained:.3f} ms with the "
          f"queue drained before it (as KernelBench times it; the first {WARMUP_CALLS} calls {first:.1f} s)", flush=True)
    for k in rows[:rows_shown]:
        print(f"   {k.self_device_time_total / CALLS_PROFILED / 1e3:8.3f} ms {k.count // CALLS_PROFILED:4d}x  {k.key[:140]}")


def replay_ab(fn, xs, rounds: int = 5) -> None:
    """``fn``'s median ms with the generated ops' CUDA-graph replay on and off, in turns of 10 calls."""
    import os

    from kgen.bench import time_call

    times = {"on": [], "off": []}
    for _ in range(rounds):
        for mode, env in (("on", "1"), ("off", "0")):
            os.environ["KGEN_CUDA_GRAPHS"] = env
            for _ in range(3):  # (a replay captures at a signature's second call)
                fn(*xs)
            times[mode] += [time_call(lambda: fn(*xs)) for _ in range(10)]
    os.environ.pop("KGEN_CUDA_GRAPHS")
    print("-- kgen, the queue drained before each call: replay on "
          + ", off ".join(f"{statistics.median(t):.3f} ms" for t in times.values()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernelbench", type=Path, required=True, help="KernelBench's KernelBench/ folder (level1..3 inside)")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--problems", required=True, help="problem numbers: 6,17 or 1-5")
    ap.add_argument("--skip-inductor", action="store_true", help="only eager and the backend")
    ap.add_argument("--rows", type=int, default=14, help="kernels and ranges shown per form, by device time")
    ap.add_argument("--grad", action="store_true", help="autograd on (default: under torch.no_grad(), as KernelBench)")
    ap.add_argument("--timeline", action="store_true",
                    help="also each form's timeline of a call with the queue drained before it (bench/gpu_timeline.py): "
                         "when the host issues each kernel, the GPU's idle gaps")
    ap.add_argument("--host", action="store_true", help="with --timeline: the host's own events too")
    ap.add_argument("--replay-ab", action="store_true",
                    help="also the backend's form with its ops' CUDA-graph replay on and off (KGEN_CUDA_GRAPHS, read "
                         "at each call), in turns, the queue drained before each call")
    args = ap.parse_args()

    import torch

    from kgen import backend

    if not torch.cuda.is_available():
        sys.exit("profile_backend.py: needs a CUDA GPU")
    for n in problem_numbers(args.problems):
        path = problem_file(args.kernelbench, args.level, n)
        mod = load_problem(path, None)
        torch.manual_seed(INIT_SEED)
        model = mod.Model(*mod.get_init_inputs()).cuda().train()  # as KernelBench's evaluator runs it
        xs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
        forms = {"eager": model}
        if not args.skip_inductor:
            forms["inductor"] = compiled_copy(model)
        before, graphs_before = len(backend.PARTITIONS), len(backend.GRAPHS)
        forms["kgen"] = compiled_copy(model, backend=backend.kgen_backend)
        print(f"==== level {args.level} {path.stem}", flush=True)
        with torch.set_grad_enabled(args.grad):
            for name, fn in forms.items():
                profile_form(name, fn, xs, args.rows)
            if args.replay_ab:
                replay_ab(forms["kgen"], xs)
            if args.timeline:
                for name, fn in forms.items():
                    call_timeline(f"{path.stem} {name}", lambda fn=fn: fn(*xs), calls=2, host=args.host)
        for p in backend.PARTITIONS[before:]:
            print(f"partition: {p}")
        for g in backend.GRAPHS[graphs_before:]:  # the form each graph runs (kgen's profile above is kgen's form)
            measured = g["measured"]() if g["measured"] else None
            print(f"graph {g['graph']}: runs {', '.join(measured.chosen()) if measured else 'kgen'}; "
                  f"{'replayable' if g['replay'] is None else 'not replayed: ' + g['replay']}")


if __name__ == "__main__":
    main()
