"""Drive only kgen's own kernels, for compute-sanitizer (racecheck trips over
some of PyTorch's kernels on the H100, so nothing else may run on the GPU here).

Every fused stage of every module under generated/ gets the per-stage
adversarial cases of `kgen validate`; inputs are built and checked on the CPU
(float64 reference), the GPU only runs the stage op and copies.

    compute-sanitizer --tool racecheck --kernel-name kns=kgen_ python scripts/sanitize_stages.py
"""
import sys
from pathlib import Path

import torch

from kgen.cli import _spec_of
from kgen.ir import load_pipeline
from kgen.plan import make_plan
from kgen.validate import TOLERANCES, compare, import_module_dir, pack_buffer, stage_cases


def main(root="generated"):
    failed = 0
    for d in sorted(p for p in Path(root).iterdir() if (p / "binding.cpp").exists()):
        pipe = load_pipeline(_spec_of(d))
        plan = make_plan(pipe)
        mod = import_module_dir(d)
        torch.manual_seed(0)
        model = mod.Model()
        named = {n: p.detach() for n, p in model.named_parameters()}
        for st in plan.fused_stages():
            op = getattr(torch.ops.kgen, f"{d.name}_stage{st.index}")
            names = [a.name for a in pipe.tensor_args() if a.name in st.tensor_names()]
            for label, x in stage_cases(st.in_type, "cpu"):
                tiles = [t.to("cuda") for t in pack_buffer(st.input, x)]
                out = op(tiles, *[named[n].to("cuda") for n in names]).cpu()
                ref, eager = x.double(), x
                for o in st.ops:
                    ref = o.run(ref, {n: p.double() for n, p in named.items()})
                    eager = o.run(eager, named)
                r = compare(label, out, ref, TOLERANCES["ieee"], eager)
                failed += not r.passed
                print(f"{'ok  ' if r.passed else 'FAIL'} {d.name} stage {st.index}: {label} {r.problem}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
