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
    return failed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
