"""The command line: help that teaches, one-line errors, list and explain."""
import subprocess
import sys

import pytest

from conftest import ROOT, SHIPPED


def _kgen(*args):
    return subprocess.run([sys.executable, "-m", "kgen", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("command", ["render", "build", "validate", "bench", "explain", "list", "ptxas", "all", "ops"])
def test_help(command):
    proc = _kgen(command, "--help")
    assert proc.returncode == 0 and "Usage: " in proc.stdout and len(proc.stdout.splitlines()) > 5


def test_top_level_help_shows_a_session():
    out = _kgen("--help").stdout
    assert "kgen render specs/maxpool_sum.yaml" in out and "from generated import maxpool_sum" in out


def test_list_shows_the_shipped_specs_fresh():
    out = _kgen("list").stdout
    for name in SHIPPED:
        line = next(l for l in out.splitlines() if l.startswith(name + " "))
        assert line.rstrip().endswith("fresh")


def test_explain_shows_rewrites_stages_and_floor():
    out = _kgen("explain", "specs/maxpool_sum.yaml").stdout
    assert "fired    pool_composition" in out and "fired    subpixel_conv_transpose" in out
    assert "stage 1 pool_reduce" in out and "floor" in out and "without rewrites" in out
    off = _kgen("explain", "--no-rewrites", "specs/maxpool_sum.yaml").stdout
    assert "fired" not in off and "switched off" in off


def test_ops_lists_the_op_table():
    from kgen.ops import OPS

    out = _kgen("ops").stdout.splitlines()
    names = [line.split()[0] for line in out[2:]]
    assert names == list(OPS)
    clamp = next(line for line in out if line.startswith("clamp "))
    assert "min, max" in clamp and "pool_reduce, norm" in clamp
    assert "kernel_size*" in next(line for line in out if line.startswith("conv2d "))


def test_unknown_module_is_a_one_line_error():
    proc = _kgen("build", "no_such_module")
    assert proc.returncode == 1
    assert proc.stderr.startswith("kgen: error: no rendered module 'no_such_module'")
    assert "Traceback" not in proc.stderr
