"""Validation's error measure (the magnitude reference) and its check of Model as a user calls it."""
import math
import types

import pytest
import torch

from conftest import HAS_CUDA, assert_report_passed, write_spec
from kgen.build import build_module
from kgen.ir import build_pipeline
from kgen.reference import add_members
from kgen.render import render_spec, write_rendered
from kgen.spec import parse_spec
from kgen.validate import TOLERANCES, CaseResult, Report, check_model, compare, run_with_magnitude, validate

# The mean over all non-batch dims of a GroupNorm output is exactly 0 (weight 1,
# bias 0): the float64 reference is rounding noise, the kernel's error ~1e-9.
# Its names shadow Python builtins, which is allowed (not reserved).
GN_MEAN = """
name: gn_mean
input: {shape: [N, 8, 6, 6]}
params:
  input: {shape: [8, 1, 1]}
ops:
  - add: {param: input}
  - group_norm: {num_groups: 2, name: min}
  - mean: {dim: [1, 2, 3]}
"""


@pytest.fixture(scope="module")
def gn_mean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gn_mean")
    spec = write_spec(tmp, GN_MEAN, "gn_mean.yaml")
    write_rendered(render_spec(spec, tmp / "gen"), tmp / "gen")
    build_module(tmp / "gen" / "gn_mean", quiet=True)
    return spec, tmp / "gen" / "gn_mean"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
def test_cancelling_reduction_validates_and_real_errors_still_fail(gn_mean, device):
    report = validate(*gn_mean, device)
    assert_report_passed(report, rel_l2=True)
    assert any(c.case.startswith("Model()") for c in report.cases)
    # the same measure on this pipeline: an error of 1e-3 of the normalized values fails
    pipe = build_pipeline(parse_spec(GN_MEAN))
    x = torch.randn(3, 8, 6, 6, dtype=torch.float64)
    tensors = {"input": torch.randn(8, 1, 1, dtype=torch.float64),
               "min.weight": torch.ones(8, dtype=torch.float64), "min.bias": torch.zeros(8, dtype=torch.float64)}
    ref, magnitude = run_with_magnitude(pipe.ops, x, tensors)
    assert float(ref.abs().max()) < 1e-12 < 0.1 < float(magnitude.min())
    assert compare("exact", ref.float(), ref, TOLERANCES["ieee"], magnitude=magnitude).passed
    assert not compare("off", (ref + 1e-3 * magnitude).float(), ref, TOLERANCES["ieee"], magnitude=magnitude).passed


MAGNITUDE_CASES = [
    ("[N, 3, 6, 6]", "", ["conv2d: {out_channels: 4, kernel_size: 3}", "sum: {dim: [1, 2, 3]}"]),
    ("[N, 3, 6, 6]", "b: {shape: [3, 1, 1]}", ["sub: {param: b}", "relu", "avg_pool2d: {kernel_size: 2}", "max: {dim: 1}"]),
    ("[N, 4, 5]", "", ["group_norm: {num_groups: 2}", "sigmoid", "mul: {scalar: -2.0}", "clamp: {min: -1.5}", "mean: {dim: 2}"]),
    ("[N, 4, 5, 3]", "s: {shape: [4, 1, 1]}", ["instance_norm: {affine: true}", "div: {param: s}", "add: {scalar: -0.5}"]),
]


@pytest.mark.parametrize("shape, params, ops", MAGNITUDE_CASES)
def test_magnitude_reference_bounds_the_reference(shape, params, ops):
    text = f"name: t\ninput: {{shape: {shape}}}\nparams: {{{params}}}\nops:\n" + "".join(f"  - {o}\n" for o in ops)
    pipe = build_pipeline(parse_spec(text))
    torch.manual_seed(0)
    model = torch.nn.Module()
    add_members(model, pipe)
    tensors = {k: v.detach().double() for k, v in model.named_parameters()}
    x = torch.randn(pipe.input.concrete(2), dtype=torch.float64)
    ref, magnitude = run_with_magnitude(pipe.ops, x, tensors)
    assert torch.equal(ref, pipe.run(x, tensors))
    assert bool((magnitude >= ref.abs() * (1 - 1e-12)).all())


def test_compare_is_never_stricter_than_the_reference_itself():
    ref = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    out = (ref * (1 + 3e-6)).float()
    assert compare("plain", out, ref, TOLERANCES["ieee"]).passed
    assert compare("tiny magnitude", out, ref, TOLERANCES["ieee"], magnitude=torch.zeros(3)).passed


# ---- Model as a user calls it

PIPE = build_pipeline(parse_spec(
    "name: t\ninput: {shape: [N, 3, 6, 6]}\nparams: {scale: {shape: [4, 1, 1]}}\n"
    "ops:\n  - conv2d: {out_channels: 4, kernel_size: 3}\n  - mul: {param: scale}\n  - sum: {dim: [2, 3]}\n"
))


def _module(breaks=None):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            add_members(self, PIPE)
            if breaks == "training":  # what a parameter named `training` does
                self.training = torch.nn.Parameter(torch.zeros(1))
            if breaks == "extra_key":
                self.extra = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            y = PIPE.run(x, dict(self.named_parameters()))
            return y * 1.01 if breaks == "wrong" else y

    return types.SimpleNamespace(Model=Model)


@pytest.mark.parametrize("breaks, problem", [
    (None, ""),
    ("training", "raised TypeError"),
    ("extra_key", "state_dict keys or shapes differ"),
    ("wrong", "above the allowed rel L2"),
])
def test_validation_uses_model_as_a_user_would(breaks, problem):
    torch.manual_seed(0)
    validated = _module().Model()
    names = [a.name for a in PIPE.tensor_args()]
    op = lambda x, params: PIPE.run(x, dict(zip(names, params)))  # noqa: E731 - stands in for the validated op
    result = check_model(_module(breaks), validated, PIPE, "cpu", op, TOLERANCES["ieee"])
    assert result.passed == (breaks is None)
    assert problem in result.problem


def test_where_float32_and_float64_differ_in_kind_either_is_the_reference():
    """Where PyTorch's float32 result is of another kind (finite, NaN, +inf, -inf) than the
    float64 reference (float32 overflow, an underflow to -0 before a log, the CPU's float32
    gelu(inf) = NaN), kgen may give either, judged against the one of its kind; elsewhere,
    and when it matches neither, it fails."""
    inf, nan = math.inf, math.nan
    tol = TOLERANCES["ieee"]
    f32 = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    f64 = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # float64 finite, float32 overflowed (and NaN after it): float32's answer or float64's
    assert compare("overflow", f32(1.0, inf, nan), f64(1.0, 1e300, 2.0), tol, f32(1.0, inf, nan)).passed
    assert compare("overflow, float64's", f32(1.0, inf, 2.0), f64(1.0, 1e300, 2.0), tol, f32(1.0, inf, nan)).passed
    assert not compare("overflow, neither", f32(1.0, inf, 5.0), f64(1.0, 1e300, 2.0), tol, f32(1.0, inf, nan)).passed
    assert not compare("overflow, other kind", f32(1.0, inf, -inf), f64(1.0, 1e300, 2.0), tol, f32(1.0, inf, nan)).passed
    # float64 NaN, float32 -inf (log of -0)
    assert compare("underflow", f32(2.0, -inf), f64(2.0, nan), tol, f32(2.0, -inf)).passed
    assert not compare("underflow, +inf", f32(2.0, inf), f64(2.0, nan), tol, f32(2.0, -inf)).passed
    # float64 inf, float32 NaN
    assert compare("quirk", f32(3.0, inf), f64(3.0, inf), tol, f32(3.0, nan)).passed
    # where float32 and float64 agree, kgen must too
    assert not compare("agreeing", f32(3.0, nan), f64(3.0, inf), tol, f32(3.0, inf)).passed


def test_assert_report_passed_fails_on_a_failing_case_and_on_no_cases():
    """conftest's assert_report_passed, the tests' check of a validate() report: it passes only a
    report with cases, all passed, and names each failing case with its problem."""
    ref = torch.linspace(-1.0, 1.0, 64, dtype=torch.float64)
    good = compare("normal 0", ref.float(), ref, TOLERANCES["ieee"])
    off = compare("normal 1", (ref + 0.5).float(), ref, TOLERANCES["ieee"])
    raised = CaseResult("Model()", math.inf, math.inf, False, "raised RuntimeError: boom")
    assert good.passed and not off.passed

    report = Report("mod", "cpu", "ieee")
    report.cases.append(good)
    assert report.passed
    assert_report_passed(report, "spec x")

    report.cases += [off, raised]
    assert not report.passed
    with pytest.raises(AssertionError) as failed:
        assert_report_passed(report, "spec x at batch 3")
    message = str(failed.value)
    assert message.startswith("spec x at batch 3\n2 of 3 cases of mod on cpu failed:"), message
    assert f"normal 1: {off.problem}" in message and "Model(): raised RuntimeError: boom" in message
    assert "normal 0" not in message and "rel L2 inf" not in message
    with pytest.raises(AssertionError, match="rel L2 inf, raised RuntimeError: boom"):
        assert_report_passed(report, rel_l2=True)

    empty = Report("mod", "cpu", "ieee")
    assert not empty.passed
    with pytest.raises(AssertionError, match="spec x\nvalidating mod on cpu gave no cases"):
        assert_report_passed(empty, "spec x")


def test_compare_finds_non_finite_values_on_either_side():
    """An all-finite pair skips the per-kind masks; a NaN or an infinity on either side alone still fails."""
    torch.manual_seed(0)
    r = torch.randn(1000, dtype=torch.float64)
    assert compare("finite", r.float(), r, (1e-5, 1e-5)).passed
    for value, what in ((math.nan, "NaN"), (math.inf, "+inf"), (-math.inf, "-inf")):
        o = r.float().clone()
        o[3] = value
        res = compare("ours", o, r, (1e-5, 1e-5))
        assert not res.passed and res.problem.startswith(f"{what} at 1 places the reference has none"), res.problem
        ref = r.clone()
        ref[5] = value
        res = compare("reference", r.float(), ref, (1e-5, 1e-5))
        assert not res.passed and res.problem.startswith(f"{what} at 0 places") and "missing at 1" in res.problem, res.problem


def test_a_16_bit_case_passes_against_eager_only_where_kgen_is_as_accurate():
    """KernelBench's 16-bit check (allclose to eager at 1e-2) is arbitrated by the float64 result rounded to the
    dtype: a note (the case passes) where kgen is within 1e-2 of it and eager is not, or where kgen's largest
    difference from it is no larger than eager's (with NaN and infinities where eager has them); nothing where kgen
    is the farther one."""
    import torch

    from kgen.validate import _eager_off_reference

    exact = torch.tensor([0.125, 0.5, 0.25], dtype=torch.float64)
    near = torch.tensor([0.1245, 0.5, 0.25], dtype=torch.float64)
    off = torch.tensor([0.16, 0.5, 0.25], dtype=torch.float64)
    note = _eager_off_reference(near, off, (exact, 1.0), torch.bfloat16)
    assert "eager is off the float64 result by 0.035" in note
    assert _eager_off_reference(off, near, (exact, 1.0), torch.bfloat16) == ""  # kgen off, eager close: a failure
    assert _eager_off_reference(off + 0.1, off, (exact, 1.0), torch.bfloat16) == ""  # both off, kgen farther
    note = _eager_off_reference(off, off + 0.1, (exact, 1.0), torch.bfloat16)  # both off, eager farther
    assert "as accurate as eager" in note and "eager by 0.135" in note
    nan_off = off.clone()
    nan_off[2] = float("nan")
    assert _eager_off_reference(nan_off, off + 0.1, (exact, 1.0), torch.bfloat16) == ""  # a NaN eager has not
    assert _eager_off_reference(near, off, None, torch.bfloat16) == ""  # no reference computed


LINEAR_RELU = """
name: linear_relu
input: {shape: [N, 48]}
ops:
  - linear: {out_features: 40}
  - relu
  - mul: {scalar: 0.5}
"""


def test_a_large_weight_stays_float32_in_every_reference(tmp_path, monkeypatch):
    """A parameter above validate.LARGE elements stays float32 in the float64 references, the end-to-end one's
    and each stage's (the reference converts it a block of rows at a time: 2_ShallowWideMLP's 8.6 GB of weights
    validated on a 23 GB machine only so); the module still validates."""
    import kgen.validate as validate_module

    spec = write_spec(tmp_path, LINEAR_RELU, "linear_relu.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    build_module(tmp_path / "gen" / "linear_relu", quiet=True)
    monkeypatch.setattr(validate_module, "LARGE", 100)  # the 40 x 48 weight is "large"
    seen = []
    real = validate_module.run_with_magnitude

    def recording(ops, x, tensors, *a, **k):
        seen.append({n: t.dtype for n, t in tensors.items() if n.endswith("weight")})
        return real(ops, x, tensors, *a, **k)

    monkeypatch.setattr(validate_module, "run_with_magnitude", recording)
    report = validate(spec, tmp_path / "gen" / "linear_relu", "cpu")
    assert_report_passed(report)
    assert any(c.case.startswith("stage") for c in report.cases)  # the stage cases ran too
    weights = [d for d in seen if d]
    assert weights and all(dt == torch.float32 for d in weights for dt in d.values()), seen


def test_eager_spread_counts_the_largest_of_eagers_errors():
    """compare: kgen's error may reach twice the largest error of eager's results on this input and on inputs
    within float32's rounding of it (``spread``), not only eager's on this one."""
    ref = torch.linspace(1, 2, 64, dtype=torch.float64)
    eager = (ref + 1e-3).float()  # eager's error here: 1e-3
    out = (ref + 3e-3).float()
    assert not compare("c", out, ref, TOLERANCES["ieee"], eager).passed
    far = (ref - 2e-3).float()  # eager on an input one unit in the last place away: 2e-3
    assert compare("c", out, ref, TOLERANCES["ieee"], eager, spread=(far,)).passed
    assert not compare("c", (ref + 5e-3).float(), ref, TOLERANCES["ieee"], eager, spread=(far,)).passed
    nan = far.clone()
    nan[0] = math.nan  # another kind of result somewhere: not counted
    assert not compare("c", out, ref, TOLERANCES["ieee"], eager, spread=(nan,)).passed


def test_eager_spread_moves_each_value_by_at_most_one_unit_from_the_starting_statistics():
    from kgen.validate import SPREAD_DRAWS, _eager_spread

    text = """
name: spread_bn
input: {shape: [N, 3, 4, 4], example: {N: 2}}
ops:
  - conv2d: {out_channels: 4, kernel_size: 3, padding: 1, name: conv}
  - batch_norm: {name: bn}
"""
    pipe = build_pipeline(parse_spec(text, "spread_bn.yaml"))
    torch.manual_seed(0)
    from kgen.reference import ReferenceModel

    reference = ReferenceModel(pipe)
    state = reference.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    x = torch.randn(2, 3, 4, 4)
    runs = _eager_spread(pipe, state, {k for k, _ in reference.named_buffers()}, x, {}, True)
    assert len(runs) == SPREAD_DRAWS + 1  # and x channels_last
    assert all(torch.equal(state[k], v) for k, v in before.items())  # the case's statistics untouched
    for y, st in runs:
        assert y.shape == (2, 4, 4, 4)
        assert not torch.equal(st["bn.running_mean"], before["bn.running_mean"])  # updated once, from the start
    with torch.no_grad():
        ref = torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, state["conv.weight"], state["conv.bias"], padding=1),
                                             before["bn.running_mean"].clone(), before["bn.running_var"].clone(), None, None, True)
    for y, _ in runs:  # every one near eager's on x: the inputs moved by at most a unit in the last place
        torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-5)
