"""The host's share of a call of generated modules, for the GPU machine:

    PYTHONPATH=. python scripts/host_probe.py instnorm_clamp_max div_max_gap_bias_sum

Per module: the median host time (us) of a call at batch 1 (the GPU far from the bottleneck) as
`model(x)`, as the op, as the op below the autograd key, under inference mode, and of an empty_like
(the host's own speed); CUDA events around one drained call at the example batch (what `kgen bench`
counts); and the time per call back to back (the GPU's own time).
"""
import sys
import time
from pathlib import Path

import torch

from kgen.cli import _spec_of
from kgen.ir import load_pipeline
from kgen.validate import import_module_dir


def host_us(fn, n: int = 200) -> float:
    """Median host time of fn() in us; the queue is drained every 8 calls so it never fills."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if i % 8 == 7:
            torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


def drained_call_us(fn, n: int = 60) -> float:
    """Median of CUDA events around one call with the queue drained before it (as kgen bench times)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2] * 1e3


def back_to_back_us(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def probe(name: str) -> dict:
    d = Path("generated") / name
    pipe = load_pipeline(_spec_of(d))
    mod = import_module_dir(d)
    model = mod.Model().cuda().eval()
    x = torch.randn(pipe.input.concrete(pipe.example_batch()), device="cuda")
    x1 = x[:1].clone()
    op = getattr(torch.ops.kgen, name)
    params = dict(model.state_dict(keep_vars=True))
    args = [params[n] for n in mod.PARAMETERS]  # the op's parameter arguments, in order

    def below_autograd(inp):
        with torch._C._AutoDispatchBelowAutograd():
            return op.default(inp, *args)

    r = {}
    with torch.no_grad():
        r["model(x1)"] = host_us(lambda: model(x1))
        r["op(x1)"] = host_us(lambda: op(x1, *args))
        r["below_autograd(x1)"] = host_us(lambda: below_autograd(x1))
        with torch.inference_mode():
            r["inference_mode op(x1)"] = host_us(lambda: op(x1, *args))
        r["empty_like(x1)"] = host_us(lambda: torch.empty_like(x1))
        r["drained model(x)"] = drained_call_us(lambda: model(x))
        r["drained below_autograd(x)"] = drained_call_us(lambda: below_autograd(x))
        r["back-to-back model(x)"] = back_to_back_us(lambda: model(x))
    return r


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(name, " ".join(f"{k}={v:.1f}" for k, v in probe(name).items()), flush=True)
