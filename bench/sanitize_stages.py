"""Drive only kgen's own kernels, for compute-sanitizer (racecheck trips over
some of PyTorch's kernels on the H100, so nothing else may run on the GPU here).

Every stage with a generated kernel of every module under generated/ gets the
per-stage adversarial cases of `kgen validate`; inputs are built and checked on
the CPU (float64 reference), the GPU only runs the stage op and copies. A
module whose whole op runs on kgen's kernels (a generated convolution with its
epilogue fused in, no ATen convolution) also runs end to end, against the CPU
build of the same module: that covers the fused kernels; where its plan for
training mode differs (a batch norm's statistics: the batch_stats kernels) and
runs on kgen's kernels too, training mode as well, running statistics included.

    compute-sanitizer --tool racecheck --kernel-name kns=kgen_ python bench/sanitize_stages.py [ROOT]

ROOT: the folder of built modules (default generated/).
"""
import argparse
import sys
from pathlib import Path

import torch

from kgen.cli import _spec_of
from kgen.families.batch_stats import BatchStatsStage
from kgen.ir import load_pipeline
from kgen.plan import choose_plans
from kgen.validate import check_stages, import_module_dir, init_args, op_call


def kgen_kernels_only(plan) -> bool:
    """Whether the plan's op runs nothing on the GPU but kgen's kernels (and ATen's copies)."""
    return all(st.family.generates_kernel or (isinstance(st, BatchStatsStage) and st.kernel) for st in plan.stages)


def main(root="generated"):
    failed = 0
    for d in sorted(p for p in Path(root).iterdir() if (p / "binding.cpp").exists()):
        sel = choose_plans(load_pipeline(_spec_of(d)))
        torch.manual_seed(0)
        mod = import_module_dir(d)
        model = mod.Model(*init_args(mod))  # an imported spec's module takes its constructor's arguments
        for r in check_stages(sel, d.name, model, "cuda", reference_device="cpu"):
            failed += not r.passed
            print(f"{'ok  ' if r.passed else 'FAIL'} {d.name} {r.case} {r.problem}", flush=True)
        pipe = sel.pipeline
        dtype = sel.dtypes[0]  # the whole op in the module's first dtype (check_stages above checks every plan's stages)
        elem = getattr(torch, dtype)
        state = {n: t.detach().to(elem) if t.is_floating_point() else t.detach() for n, t in model.state_dict().items()}
        for training in (False, True) if pipe.training_dependent else (False,):
            plan = sel.variant_for(2, training, dtype).plan  # the plan the whole op runs at batch 2
            if not kgen_kernels_only(plan) or (training and plan is sel.variant_for(2, dtype=dtype).plan):
                continue
            x = torch.randn(pipe.input.concrete(2), dtype=elem)
            op = getattr(torch.ops.kgen, d.name)
            with torch.no_grad():
                ours, ours_stats = op_call(op, pipe, x.cuda(), {}, {n: t.cuda() for n, t in state.items()}, training)
                cpu, cpu_stats = op_call(op, pipe, x, {}, state, training)
            close = lambda a, b: torch.allclose(a.cpu(), b, rtol=1e-3, atol=1e-3 * float(b.abs().max()))  # noqa: E731
            ok = close(ours, cpu) and all(close(ours_stats[n], cpu_stats[n]) for n in cpu_stats)
            failed += not ok
            mode = " in training mode (running statistics too)" if training else ""
            print(f"{'ok  ' if ok else 'FAIL'} {d.name} whole op (fused kernels){mode} against its CPU build", flush=True)
    return failed


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default="generated", help="the folder of the built modules")
    sys.exit(1 if main(ap.parse_args().root) else 0)
