"""How much the order of calls moves the numbers of kgen bench (a measurement of the method,
for the GPU machine): each module timed (a) with eager / torch.compile / kgen taking turns
call by call (kgen bench before 1cc3a94); (b) as kgen bench does now, in blocks of
consecutive calls of each in turn, the first call of each block not counted; (c) kgen
alone. Medians of CUDA-event times, ms. With --probe: the kgen call after other work instead
(a kgen call, an eager call, a 4.8 GB memset, a 4 KB memset, the host asleep 12 ms, the GPU
spinning 12 ms), to tell what makes a call after eager slower.

    PYTHONPATH=. python bench/bench_order.py avgpool_sigmoid_sum maxpool_sum
"""
import argparse
import statistics
import time
from pathlib import Path

import torch

from kgen.bench import BLOCK, models_and_inputs, time_call, time_in_blocks, time_ms
from kgen.cli import _spec_of


def probe(name, model, ref, x, *others) -> None:
    big = torch.empty(int(1.2e9), device="cuda")  # 4.8 GB
    small = torch.empty(1024, device="cuda")
    before = {"kgen": lambda: model(x, *others), "eager": lambda: ref(x, *others), "memset 4.8 GB": big.zero_,
              "memset 4 KB": small.zero_, "host asleep 12 ms": lambda: time.sleep(0.012),
              "GPU spinning 12 ms": lambda: torch.cuda._sleep(int(12e-3 * 1.7e9))}
    with torch.no_grad():
        for _ in range(5):
            model(x, *others)
            ref(x, *others)
        for what, fn in before.items():
            times = []
            for _ in range(20):
                fn()
                torch.cuda.synchronize()
                times.append(time_call(lambda: model(x, *others)))
            print(f"{name:24s} kgen after {what:20s} {statistics.median(times):8.3f}", flush=True)
    del big


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--probe", action="store_true", help="time kgen after other kinds of work")
    args = ap.parse_args()
    print(f"{'module':24s} {'method':28s} {'eager':>8s} {'compile':>8s} {'kgen':>8s}")
    for name in args.names:
        d = Path("generated") / name
        pipe, batch, model, ref, (x, *others) = models_and_inputs(d, _spec_of(d))
        if args.probe:
            probe(name, model, ref, x, *others)
            continue
        with torch.no_grad():
            compiled = torch.compile(ref)
            fns = {"eager": lambda: ref(x, *others), "compile": lambda: compiled(x, *others),
                   "kgen": lambda: model(x, *others)}
            a = time_in_blocks(fns, args.reps, block=1)
            b = time_in_blocks(fns, args.reps)
            c = time_ms(fns["kgen"], args.reps)
        for method, t in ((f"in turns, call by call", a), (f"blocks of {BLOCK}, first not counted", b)):
            print(f"{name:24s} {method:28s} {t['eager']:8.3f} {t['compile']:8.3f} {t['kgen']:8.3f}", flush=True)
        print(f"{name:24s} {'kgen alone':28s} {'':8s} {'':8s} {c:8.3f}", flush=True)
        del compiled
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
