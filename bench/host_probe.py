"""The host's share of a call of generated modules, for the GPU machine:

    PYTHONPATH=. python bench/host_probe.py instnorm_clamp_max div_max_gap_bias_sum
    PYTHONPATH=. python bench/host_probe.py /tmp/gen_old/instnorm_clamp_max   (a module folder: an A/B copy)

Per module, in us: the median host time of `model(x)` at batch 1 (the GPU far from the bottleneck),
of the module's `forward(x, *params)` and of its op called below the autograd key (where the module's
parameters are all its op's arguments after the inputs), of a `torch.add` and an empty_like (the host's own speed), one call with the queue drained before it at the
example batch (what `kgen bench` counts: kgen.bench.time_call), and the time per call back to back
(the GPU's own time); eager's (the reference model in float32) beside kgen's. Models and inputs as `kgen bench` makes them (kgen.bench.models_and_inputs).
"""
import argparse
import time
from pathlib import Path

import torch

from kgen.bench import models_and_inputs, time_in_blocks
from kgen.cli import _spec_of
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
    d = Path(name) if "/" in name else Path("generated") / name
    _, _, model, ref, inputs = models_and_inputs(d, _spec_of(d))
    mod = import_module_dir(d)
    first = [t[:1].clone() for t in inputs]
    named = dict(model.named_parameters())
    params = [named[k] for k in mod.PARAMETERS] if set(named) == set(mod.PARAMETERS) else None

    def below():
        with torch._C._AutoDispatchBelowAutograd():
            return mod._OP(*first, params)  # the op takes the parameters as a list

    with torch.no_grad():
        parts = {}
        if params is not None:
            parts = {"forward(x1, *p)": host_us(lambda: mod.forward(*first, *params)), "op below autograd": host_us(below)}
        return {
            "model(x1)": host_us(lambda: model(*first)),
            "eager ref(x1)": host_us(lambda: ref(*first)),
            **parts,
            "add(x1, x1)": host_us(lambda: torch.add(first[0], first[0])),
            "empty_like(x1)": host_us(lambda: torch.empty_like(first[0])),
            "drained model(x)": time_in_blocks({"call": lambda: model(*inputs)}, 60, block=1)["call"] * 1e3,
            "drained model(x), blocks as kgen bench": time_in_blocks({"call": lambda: model(*inputs)}, 60)["call"] * 1e3,
            "back-to-back model(x)": back_to_back_us(lambda: model(*inputs)),
            "drained eager ref(x)": time_in_blocks({"call": lambda: ref(*inputs)}, 60, block=1)["call"] * 1e3,
            "back-to-back eager ref(x)": back_to_back_us(lambda: ref(*inputs)),
        }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="+", help="module names under generated/, or module folders")
    for name in ap.parse_args().modules:
        print(name, " ".join(f"{k}={v:.1f}" for k, v in probe(name).items()), flush=True)
