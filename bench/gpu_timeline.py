"""The timeline of one call of generated modules, as `kgen bench` times it (queue drained
before the call): when the host issues each kernel, where each kernel starts and ends
on the GPU, and the idle gaps between them (torch.profiler's trace). For the GPU machine:

    PYTHONPATH=. python bench/gpu_timeline.py relu_group_norm maxpool_sum
    PYTHONPATH=. python bench/gpu_timeline.py --host instnorm_clamp_max   # and the host's own events
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kgen.cli import _spec_of
from kgen.ir import load_pipeline
from kgen.runtime import launches_one_by_one
from kgen.validate import import_module_dir

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def timeline(name: str, calls: int = 3, host: bool = False) -> None:
    d = Path("generated") / name
    pipe = load_pipeline(_spec_of(d))
    model = import_module_dir(d).Model().cuda()
    x = torch.randn(pipe.input.concrete(pipe.example_batch()), device="cuda")
    with torch.no_grad():
        call_timeline(name, lambda: model(x), calls, host)


def call_timeline(name: str, fn, calls: int = 3, host: bool = False) -> None:
    """The timeline of ``calls`` calls of ``fn()``, each with the queue drained before it (as kgen bench and
    KernelBench time a call), printed under ``name``."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, launches_one_by_one():
        for i in range(calls):
            torch.cuda.synchronize()
            with record_function(f"timeline call {i}"):
                fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in spans if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = sorted((e for e in spans if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    for r in sorted((e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith("timeline call")),
                    key=lambda e: e["ts"]):
        start, end = r["ts"], r["ts"] + r["dur"]
        mine = [k for k in gpu if start <= launches.get(k.get("args", {}).get("correlation"), {"ts": -1})["ts"] <= end]
        print(f"== {name} {r['name'][9:]}: the host returns after {r['dur']:.1f} us; times in us from the call's start")
        print(f"  {'issued':>8}  {'starts':>8}  {'runs':>8}  {'idle before':>11}  kernel")
        last = start
        for k in mine:
            issued = launches[k["args"]["correlation"]]["ts"] - start
            print(f"  {issued:8.1f}  {k['ts'] - start:8.1f}  {k['dur']:8.1f}  {max(0.0, k['ts'] - last):11.1f}  {k['name'][:80]}")
            last = max(last, k["ts"] + k["dur"])
        if host:  # the host's own work in the call: every CPU-side event, in order, nested ones indented
            cpu = sorted((e for e in spans if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation", "python_function")
                          and start <= e["ts"] <= end and e is not r), key=lambda e: (e["ts"], -e["dur"]))
            stack = []
            for e in cpu:
                while stack and e["ts"] >= stack[-1]:
                    stack.pop()
                print(f"  host {e['ts'] - start:8.1f} +{e['dur']:7.1f}  {'  ' * len(stack)}{e['name'][:90]}")
                stack.append(e["ts"] + e["dur"])
        busy = sum(k["dur"] for k in mine)
        print(f"  GPU done {last - start:.1f} us after the call started; busy {busy:.1f} us, idle {last - start - busy:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--host", action="store_true", help="also list the host's events (ATen ops, CUDA runtime calls) of each call")
    args = ap.parse_args()
    for name in args.names:
        timeline(name, host=args.host)


if __name__ == "__main__":
    main()
