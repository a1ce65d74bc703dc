"""The command line: help that teaches, one-line errors, list and explain."""
import subprocess
import sys

import pytest
import torch

import kgen
from conftest import ROOT, SHIPPED, kgen_cli


def _kgen(*args):
    """``python -m kgen`` in a process of its own, in the repository (the entry point end to end)."""
    return subprocess.run([sys.executable, "-m", "kgen", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("command", ["render", "build", "validate", "bench", "explain", "list", "ptxas", "all", "ops"])
def test_help(command):
    proc = kgen_cli(command, "--help")
    assert proc.returncode == 0 and "Usage: " in proc.stdout and len(proc.stdout.splitlines()) > 5


def test_top_level_help_shows_a_session():
    out = kgen_cli("--help").stdout
    assert "kgen render specs/maxpool_sum.yaml" in out and "from generated import maxpool_sum" in out


def test_the_floor_counts_a_fused_epilogue_inside_its_convolutions_kernel():
    """A convolution that runs the next stage as its epilogue is one kernel for the floor: it reads
    x and the weights and writes only the epilogue's output (its own output is never written), and
    its FLOPs and bytes meet in one max(compute, memory)."""
    import math

    from kgen.explain import floor_ms, kernel_costs, plan_totals
    from kgen.ir import load_pipeline
    from kgen.plan import KGEN, PIPELINE, make_plan
    from kgen.target import DEFAULT

    pipe = load_pipeline(ROOT / "specs" / "div_max_gap_bias_sum.yaml")
    plan = make_plan(pipe, None, DEFAULT, {PIPELINE: KGEN, "conv": "gemm"})
    conv = plan.stages[0]
    assert conv.epilogue is plan.stages[1] and plan.stages[1].absorbed_by is conv
    batch = 4
    costs = kernel_costs(plan, batch)
    assert len(costs) == len([s for s in plan.stages if s.absorbed_by is None])
    x_floats = batch * 8 * 16 * 64 * 64
    weights = 16 * 8 * 27
    out_floats = batch  # the output is [N, 1, 1, 1]
    flops, nbytes = costs[0]
    assert nbytes == 4 * (x_floats + weights + out_floats)  # no 14 x 62 x 62 x 16 conv output
    assert plan_totals(plan, batch)[2] == sum(floor_ms(*c, DEFAULT)[0] for c in costs)
    assert floor_ms(flops, nbytes, DEFAULT)[1] == "compute" and math.isclose(
        floor_ms(flops, nbytes, DEFAULT)[0], flops / DEFAULT.tensor_flops * 1e3)


def test_the_fused_floor_is_the_lowest_over_kgens_candidates():
    """Bench's floor is the fully fused pipeline's: for instnorm_clamp_max the default candidate
    writes the convolution output for the norm stage, the fused-norm candidates never write it."""
    from kgen.explain import fused_floor_ms, plan_totals
    from kgen.ir import load_pipeline
    from kgen.plan import KGEN, PIPELINE, candidate_plans, make_plan
    from kgen.target import DEFAULT

    pipe = load_pipeline(ROOT / "specs" / "instnorm_clamp_max.yaml")
    batch = 8
    floors = {json_key(p.choices): plan_totals(p, batch)[2] for p in candidate_plans(pipe, DEFAULT, batch)
              if p.choices.get(PIPELINE, KGEN) == KGEN}
    default = plan_totals(make_plan(pipe, None, DEFAULT, {PIPELINE: KGEN}), batch)[2]
    fused = fused_floor_ms(pipe, batch, DEFAULT)
    assert fused == min(floors.values()) and fused < default / 3  # the 103 MB written and read twice, at batch 128
    best = min(floors, key=floors.get)
    assert "conv_gemm:recompute" in best or "conv_gemm:onepass" in best


def json_key(choices: dict) -> str:
    import json

    return json.dumps(choices, sort_keys=True)


def test_list_shows_the_shipped_specs_fresh():
    out = kgen_cli("list").stdout
    for name in SHIPPED:
        line = next(l for l in out.splitlines() if l.startswith(name + " "))
        assert line.rstrip().endswith("fresh")


def test_explain_shows_rewrites_stages_and_floor():
    out = kgen_cli("explain", "specs/maxpool_sum.yaml").stdout
    assert "fired    pool_composition" in out and "fired    subpixel_conv_transpose" in out
    assert "stage 1 pool_reduce" in out and "floor" in out and "without rewrites" in out
    assert "all 8 sub-pixel phases in one kernel" in out and "is its epilogue" in out  # how each stage runs
    assert "CUDA-graph replay without autograd (at batch 16): no: the host's dispatch the GPU waits for 0.008 ms (of 0.008 ms: 2 launches)" in out  # large tensors, 2 kernels
    off = kgen_cli("explain", "--no-rewrites", "specs/maxpool_sum.yaml").stdout
    assert "fired" not in off and "switched off" in off


def test_explain_forced_gemm_transposed_conv_reports_the_missing_baseline(tmp_path):
    # plan.conv: gemm on a transposed convolution: conv_gemm computes it only as sub-pixel phases, so the
    # plan without rewrites has no family; explain says so on that line and still shows the plan
    spec = tmp_path / "ct_gemm.yaml"
    spec.write_text(
        "name: ct_gemm\ninput: {shape: [N, 4, 6, 6, 6], dtype: float32, example: {N: 2}}\n"
        "ops:\n  - conv_transpose3d: {out_channels: 8, kernel_size: 3, stride: 2, padding: 1}\n"
        "  - sum: {dim: 1}\nplan: {conv: gemm}\n"
    )
    proc = kgen_cli("explain", str(spec))
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.strip().startswith("without rewrites"))
    assert "no plan" in line and "no family computes it here" in line
    assert "conv_gemm" in proc.stdout and "fired    subpixel_conv_transpose" in proc.stdout


def test_ops_lists_the_op_table():
    from kgen.ops import MADE_BY_REWRITES, OPS

    out = kgen_cli("ops").stdout.splitlines()
    names = [line.split()[0] for line in out[2:]]
    assert names == [n for n in OPS if n not in MADE_BY_REWRITES] and "batch_stats" in MADE_BY_REWRITES
    clamp = next(line for line in out if line.startswith("clamp "))
    assert "min, max" in clamp and "pool_reduce, norm" in clamp
    assert "kernel_size*" in next(line for line in out if line.startswith("conv2d "))


def test_unknown_module_is_a_one_line_error():
    proc = _kgen("build", "no_such_module")
    assert proc.returncode == 1
    assert proc.stderr.startswith("kgen: error: no rendered module 'no_such_module'")
    assert "Traceback" not in proc.stderr


def test_version():
    proc = kgen_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"kgen {kgen.__version__}"


def test_environment_variables_are_documented():
    out = kgen_cli("--help").stdout
    for var in ("KGEN_DEVICE", "TORCH_CUDA_ARCH_LIST", "KGEN_POISON_OUTPUTS", "KGEN_MAX_ELEMENTS"):
        assert var in out, var


def _one_line_error(proc, *contains):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("kgen: error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for c in contains:
        assert c in proc.stderr


@pytest.mark.parametrize("command", ["validate", "all"])
def test_unavailable_device_is_one_line(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    _one_line_error(kgen_cli(command, "--device", missing), f"--device {missing}")
    _one_line_error(kgen_cli(command, "--device", "nonsense"), "--device nonsense")


@pytest.mark.parametrize("batch", ["-5", "0"])
def test_non_positive_batch_is_one_line(batch):
    _one_line_error(kgen_cli("explain", "--batch", batch, ROOT / "specs/maxpool_sum.yaml"), f"--batch must be a positive integer, got {batch}")


@pytest.mark.parametrize("command", ["render", "all"])
def test_two_specs_with_one_name_are_an_error(tmp_path, command):
    text = (ROOT / "specs" / "instnorm_clamp_max.yaml").read_text()
    a, b = tmp_path / "a.yaml", tmp_path / "b dir" / "b.yaml"
    b.parent.mkdir()
    a.write_text(text)
    b.write_text(text.replace("kernel_size: 3", "kernel_size: 2"))
    out = tmp_path / "gen"
    args = [command, a, b, "--out", out] + (["--device", "cpu"] if command == "all" else [])
    _one_line_error(kgen_cli(*args), str(a), str(b), "both have name 'instnorm_clamp_max'")
    assert not out.exists()
