"""Every generated CUDA source compiles for sm_90a with no spills and no local memory.

Needs nvcc only (no GPU, no CUDA torch): CI compiles them on its CPU machine.
"""
import shutil

import pytest

from conftest import ROOT, SHIPPED
from kgen.build import cuda_home, demangle, ptxas_report

pytestmark = pytest.mark.skipif(cuda_home() is None and shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.mark.parametrize("name", SHIPPED)
def test_kernels_compile_without_spills(name):
    kernels = ptxas_report(ROOT / "generated" / name, "9.0a")
    assert kernels, "ptxas reported no kernels"
    bad = [f"{demangle(k.name)}: stack {k.stack}, spills {k.spill_stores}/{k.spill_loads}" for k in kernels if not k.clean]
    assert not bad, bad
    assert all(k.registers > 0 for k in kernels)
