"""Drive only kgen's own kernels, for compute-sanitizer (racecheck trips over
some of PyTorch's kernels on the H100, so nothing else may run on the GPU here).

Every stage with a generated kernel of every module under generated/ gets the
per-stage adversarial cases of `kgen validate`; inputs are built and checked on
the CPU (float64 reference), the GPU only runs the stage op and copies. A
module whose whole op runs on kgen's kernels (a generated convolution with its
epilogue fused in, no ATen convolution) also runs end to end, against the CPU
build of the same module: that covers the fused kernels.

    compute-sanitizer --tool racecheck --kernel-name kns=kgen_ python scripts/sanitize_stages.py [ROOT]

ROOT: the folder of built modules (default generated/).
"""
import sys
from pathlib import Path

import torch

from kgen.cli import _spec_of
from kgen.ir import load_pipeline
from kgen.plan import choose_plans
from kgen.validate import check_stages, import_module_dir


def main(root="generated"):
    failed = 0
    for d in sorted(p for p in Path(root).iterdir() if (p / "binding.cpp").exists()):
        sel = choose_plans(load_pipeline(_spec_of(d)))
        torch.manual_seed(0)
        model = import_module_dir(d).Model()
        for r in check_stages(sel, d.name, model, "cuda", reference_device="cpu"):
            failed += not r.passed
            print(f"{'ok  ' if r.passed else 'FAIL'} {d.name} {r.case} {r.problem}", flush=True)
        plan = sel.variant_for(2).plan  # the plan the whole op runs at batch 2
        if all(st.family.generates_kernel for st in plan.stages):
            x = torch.randn(plan.pipeline.input.concrete(2))
            op = getattr(torch.ops.kgen, d.name)
            named = dict(model.named_parameters())  # in the op's argument order, not the Model's creation order
            params = [named[a.name].detach() for a in sel.pipeline.tensor_args()]
            with torch.no_grad():
                ours = op(x.cuda(), *[p.cuda() for p in params]).cpu()
                cpu = op(x, *params)
            ok = torch.allclose(ours, cpu, rtol=1e-3, atol=1e-3 * float(cpu.abs().max()))
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {d.name} whole op (fused kernels) against its CPU build", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(*sys.argv[1:2]) else 0)
