"""Values in the IR (kgen/values.py): where a named result lives (a register of one stage, or a
tensor a stage ends with), how `from:` starts a stage, what the reference computes for a DAG, and
that rewrites leave values alone. Planning and rendering only; test_import.py builds."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_report_passed, fake_tuning, pipeline_of, write_spec
from kgen.ir import Capture, Elementwise
from kgen.plan import make_plan
from kgen.render import render_plan
from kgen.rewrites import apply_rewrites
from kgen.target import DEFAULT

SWISH = """
name: swish
input: {shape: [N, 16]}
ops:
  - linear: {out_features: 8, as: h}
  - sigmoid
  - mul: {tensor: h}
  - mul: {scalar: 2.0}
"""

RESIDUAL = """
name: residual
input: {shape: [N, 3, 6, 6]}
ops:
  - conv2d: {out_channels: 4, kernel_size: 3, as: c}
  - group_norm: {num_groups: 2}
  - tanh
  - add: {tensor: c}
  - relu: {as: r}
  - max_pool2d: {kernel_size: 2}
  - sum: {dim: 1}
"""

DAG = """
name: dag
inputs:
  x: {shape: [N, 4, 5]}
  y: {shape: [N, 4, 5]}
example: {N: 3}
params:
  w: {shape: [5]}
ops:
  - relu: {as: r}
  - mean: {dim: 2, keepdim: true, as: m}
  - sub: {from: r, tensor: m}
  - div: {tensor: y, reverse: true}
  - mul: {param: w}
  - maximum: {tensor: r, as: z}
  - softmax: {dim: 1}
  - sub: {tensor: z, reverse: true}
"""


def _plan(text):
    return make_plan(pipeline_of(text), target=DEFAULT)


def test_a_value_read_in_its_own_run_stays_in_a_register(tmp_path):
    plan = _plan(SWISH)
    assert [s.family.name for s in plan.stages] == ["linear_gemm", "pool_reduce"]
    assert plan.stages[1].absorbed_by is plan.stages[0]  # a register value does not keep the epilogue out
    (mul,) = [o for o in plan.stages[1].ops if isinstance(o, Elementwise) and o.tensor == "h"]
    assert mul.register and plan.stage_values(plan.stages[1]) == []
    stages_h = render_plan(plan, tmp_path).files["swish/stages.h"]
    assert "const float val_h = v;" in stages_h and "v = kgen::mul(v, val_h);" in stages_h and "a.h" not in stages_h


def test_a_value_read_across_a_stage_is_that_stages_tensor(tmp_path):
    plan = _plan(RESIDUAL)
    kinds = [s.family.name for s in plan.stages]
    assert kinds[0] in ("conv_gemm", "conv_aten") and kinds[1:] == ["norm", "pool_reduce"], kinds
    norm = plan.stages[1]
    # the conv's output is the value: no bias deferred into the norm stage, no copy stage
    assert plan.stage_values(norm) == ["c"] and plan.value_exprs["c"] == "t0"
    # r is read by no one: it stays where it is (end of the norm stage, no cut)
    binding = render_plan(plan, tmp_path).files["residual/binding.cpp"]
    assert "stage1({t0}, group_norm_weight, group_norm_bias, t0);" in binding


def test_from_starts_a_stage_on_the_value_and_the_reference_is_the_dag():
    pipe = pipeline_of(DAG)
    plan = make_plan(pipe, target=DEFAULT)
    sources = [s.source for s in plan.stages]
    assert sources[0] == "x"
    starts = [s for s in plan.stages if s.ops[0].src == "r"]
    assert len(starts) == 1 and starts[0].source == plan.value_exprs["r"]
    g = torch.Generator().manual_seed(0)  # its own generator: the data must not depend on the tests run before
    x, y = torch.randn(2, 4, 5, dtype=torch.float64, generator=g), torch.rand(2, 4, 5, dtype=torch.float64, generator=g) + 0.5
    x[..., 0] = x[..., 0].abs() + 0.1  # no row of relu(x) all zero (r - its mean would divide y by 0)
    w = torch.randn(5, dtype=torch.float64, generator=g)
    r = torch.relu(x)
    z = torch.maximum(y / (r - r.mean(dim=2, keepdim=True)) * w, r)
    want = z - torch.softmax(z, dim=1)
    torch.testing.assert_close(pipe.run(x, {"w": w}, inputs={"y": y}), want)
    assert [o.name for o in pipe.ops if isinstance(o, Capture)] == ["r", "m", "z"]


def test_rewrites_leave_values_alone():
    through_max = """
name: t
input: {shape: [N, 3, 8, 8]}
ops:
  - conv2d: {out_channels: 4, kernel_size: 3}
  - mul: {scalar: 2.0, as: s}
  - max_pool2d: {kernel_size: 2}
  - sum: {dim: 1}
"""
    _, decisions = apply_rewrites(pipeline_of(through_max))
    assert not any(d.fired for d in decisions if d.rewrite == "scalar_through_max")
    algebra = """
name: t
inputs:
  x: {shape: [N, 4, 6]}
  y: {shape: [N, 4, 1]}
ops:
  - mean: {dim: 2, keepdim: true}
  - add: {tensor: y}
  - sum: {dim: 1}
"""
    _, decisions = apply_rewrites(pipeline_of(algebra))
    (d,) = [d for d in decisions if d.rewrite == "reduction_algebra"]
    assert not d.fired and "reads or names a value" in d.reason
    named_conv = """
name: t
input: {shape: [N, 3, 8, 8]}
ops:
  - conv_transpose2d: {out_channels: 4, kernel_size: 3, stride: 2, as: c}
  - relu
  - add: {tensor: c}
"""
    _, decisions = apply_rewrites(pipeline_of(named_conv))
    (d,) = [d for d in decisions if d.rewrite == "subpixel_conv_transpose"]
    assert not d.fired and "named value 'c'" in d.reason


@pytest.mark.parametrize("reverse, want", [(False, lambda x: x - 1.5), (True, lambda x: 1.5 - x)])
def test_reverse_puts_the_operand_first(reverse, want, tmp_path):
    text = f"name: t\ninput: {{shape: [N, 4]}}\nops:\n  - sub: {{scalar: 1.5, reverse: {str(reverse).lower()}}}\n"
    pipe = pipeline_of(text)
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(pipe.run(x, {}), want(x))
    stages_h = render_plan(make_plan(pipe, target=DEFAULT), tmp_path).files["t/stages.h"]
    assert ("v = kgen::sub(1.5f, v);" if reverse else "v = kgen::sub(v, 1.5f);") in stages_h


def test_batch_norm_reference_is_nn_batch_norm_in_both_modes():
    text = "name: t\ninput: {shape: [N, 4, 3]}\nops:\n  - batch_norm: {momentum: null, name: bn}\n  - gelu\n"
    pipe = pipeline_of(text)
    bn = torch.nn.BatchNorm1d(4, momentum=None).double()
    tensors = {f"bn.{k}": v.clone() for k, v in bn.state_dict().items()}
    for training in (True, True, False):
        x = torch.randn(5, 4, 3, dtype=torch.float64)
        bn.train(training)
        with torch.no_grad():
            torch.testing.assert_close(pipe.run(x, tensors, training=training), F.gelu(bn(x)))
    for k, v in bn.state_dict().items():
        torch.testing.assert_close(tensors[f"bn.{k}"].to(v.dtype), v)
    assert int(tensors["bn.num_batches_tracked"]) == 2


@pytest.fixture(scope="module")
def eager_plans(tmp_path_factory):
    """SWISH, RESIDUAL and DAG, each rendered with a tuning file that picks its eager plan and built for the
    CPU, all together: name -> (spec, module directory)."""
    from kgen import tune, tunefile
    from kgen.build import build_modules
    from kgen.plan import EAGER as EAGER_PIPELINE, PIPELINE
    from kgen.render import render_spec, write_rendered

    root = tmp_path_factory.mktemp("eager_plans")
    out, built = root / "gen", {}
    for text in (SWISH, RESIDUAL, DAG):
        name = pipeline_of(text).name
        spec = write_spec(root, text, f"{name}.yaml")
        t = fake_tuning(spec, [], lambda choices: choices.get(PIPELINE) == EAGER_PIPELINE, root / "tune" / name)
        tunefile.write_entry(spec, tune.entry(t, 30, DEFAULT.name))  # a tuning file that picks the eager plan
        write_rendered(render_spec(spec, out), out)
        built[name] = (spec, out / name)
    build_modules([d for _, d in built.values()])  # (the default variant, as `kgen build`)
    return built


@pytest.mark.parametrize("text", [SWISH, RESIDUAL, DAG], ids=["swish", "residual", "dag"])
def test_a_pipeline_with_values_or_several_inputs_has_an_eager_candidate(text, eager_plans):
    """The eager family names values (`as:` -> v_NAME), reads them as operands, as `from:` starts
    and reversed (`reverse: true`), and takes the other inputs: such pipelines have an eager
    candidate (so `kgen tune` can fall back to eager PyTorch's kernels), and its plan validates
    on the CPU build."""
    from kgen.families import EAGER
    from kgen.plan import PIPELINE
    from kgen.validate import validate

    pipe = pipeline_of(text)
    assert EAGER.whole(pipe) is not None and PIPELINE in make_plan(pipe, target=DEFAULT).options
    spec, module_dir = eager_plans[pipe.name]
    binding = (module_dir / "binding.cpp").read_text()
    assert "const at::Tensor v_" in binding  # a named value
    report = validate(spec, module_dir, "cpu")
    assert_report_passed(report)


def test_a_stage_that_starts_from_another_value_is_no_epilogue(tmp_path):
    """A convolution followed by a stage that starts from another input (`from: y`) of the
    same shape: the stage reads y, so it is not fused into the convolution as its epilogue
    (it was, and the module computed on the convolution's output); the CPU build validates."""
    from kgen.build import build_module
    from kgen.render import write_rendered
    from kgen.validate import validate

    text = """
name: other_source
inputs:
  x: {shape: [N, 4, 8, 8]}
  y: {shape: [N, 4, 8, 8]}
example: {N: 2}
ops:
  - conv2d: {out_channels: 4, kernel_size: 1}
  - relu: {from: y}
  - sum: {dim: [1, 2, 3]}
"""
    plan = _plan(text)
    assert [s.family.name for s in plan.stages][1:] == ["pool_reduce"] and plan.stages[1].source == "y"
    assert all(s.absorbed_by is None for s in plan.stages)
    spec = tmp_path / "other_source.yaml"
    spec.write_text(text)
    out = tmp_path / "gen"
    write_rendered(render_plan(make_plan(pipeline_of(text, str(spec)), target=DEFAULT), out), out)
    build_module(out / "other_source", "cpu")
    report = validate(spec, out / "other_source", "cpu", stages=False)
    assert_report_passed(report)


def test_tune_measures_a_pipeline_with_several_inputs(tmp_path):
    """`kgen tune` gives every input of a multi-input spec (the dag's y too) to eager PyTorch and to
    each candidate it times (on the CPU here: the flow)."""
    from kgen import tune
    from kgen.build import build_modules

    spec = write_spec(tmp_path, DAG, "dag.yaml")
    t = tune.prepare(spec, [], 2, tmp_path / "tune")  # the model's best and the eager plan
    build_modules([m.module for m in t.measured], "cpu")
    tune.measure(t, 20, device="cpu")
    assert all(0 < v < float("inf") for v in t.eager_pytorch_ms.values())
    for m in t.measured:
        assert not m.problem and all(0 < m.ms[b] < float("inf") for b in t.batches), (m.problem, m.ms)
