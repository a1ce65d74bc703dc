"""The op table (kgen/ops.py) is the only list of ops: spec loading, the IR, the
reference model, the planner and rendering all take every entry, and a new
elementwise entry (plus its kgen_math.h function) needs nothing else."""
import math
import re

import pytest
import torch

from conftest import assert_report_passed, pipeline_of, spec_text, with_param, write_spec
from kgen.cexpr import cfloat
from kgen.errors import SpecError
from kgen.ir import Elementwise
from kgen.ops import FUSED, INTERNAL, OPS, ElementwiseOp, elementwise_ops, spec_op_names
from kgen.plan import make_plan
from kgen.reference import ReferenceModel
from kgen.render import TEMPLATES, render_plan
from kgen.spec import parse_spec
from kgen.target import DEFAULT

ELEMENTWISE = elementwise_ops()
MATH = (TEMPLATES / "kgen_math.h").read_text()


def _use(entry: ElementwiseOp, **fields):
    """The entry as a spec op: a bare name, or name: {fields}."""
    args = dict(entry.example, **fields)
    return {entry.name: args} if args else entry.name


def _math_functions() -> set[str]:
    return set(re.findall(r"KGEN_HD float (\w+)\(", MATH))


def test_the_table_has_the_ops_the_spec_loader_knows():
    with pytest.raises(SpecError) as e:
        parse_spec(spec_text([2, 4], ["no_such_op"]), "t.yaml")
    listed = str(e.value).split("known ops: ")[1].split(", ")
    assert listed == spec_op_names() == sorted(set(OPS) - set(INTERNAL))
    assert {e.name for e in ELEMENTWISE} >= {"relu", "sigmoid", "clamp", "add", "sub", "mul", "div"}


@pytest.mark.parametrize("entry", ELEMENTWISE, ids=lambda e: e.name)
def test_every_elementwise_entry_goes_through_every_layer(entry, tmp_path):
    assert entry.families and set(entry.families) <= set(FUSED)
    assert entry.c_fn.startswith("kgen::") and entry.c_fn[len("kgen::"):] in _math_functions(), entry.c_fn
    text = spec_text([3, 4, 5], [_use(entry), {"sum": {"dim": [1, 2]}}], name="one_op")
    spec = parse_spec(text, "t.yaml")
    assert set(spec.ops[0].args) == set(entry.fields)  # every field, defaults filled in
    pipe = pipeline_of(text)
    op = pipe.ops[0]
    assert isinstance(op, Elementwise) and op.fn == entry.name and entry.name in op.describe()
    # the reference is the entry's torch function
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    with torch.no_grad():
        got = ReferenceModel(pipe)(x)
    consts = [entry.example.get(f) for f, _ in entry.consts]
    operand = [x if entry.example.get("tensor") == "x" else entry.example["scalar"]] if entry.operand else []
    torch.testing.assert_close(got, entry.torch_fn(x, *operand, *consts).sum(dim=(1, 2)), equal_nan=True)  # log: NaN below 0
    # the planner puts it in a family the entry lists; rendering calls its C function
    plan = make_plan(pipe, target=DEFAULT)
    assert plan.stages[0].family.name in entry.families
    stages_h = render_plan(plan, tmp_path).files["one_op/stages.h"]
    assert re.search(rf"v = {re.escape(entry.c_fn)}\(v[,)]", stages_h), entry.c_fn


@pytest.mark.parametrize("entry", [e for e in ELEMENTWISE if e.operand], ids=lambda e: e.name)
def test_operand_ops_take_a_broadcast_parameter(entry, tmp_path):
    text = spec_text([3, 4, 5], [with_param(entry), {"max": {"dim": 1}}], params={"p": {"shape": [3, 1, 5], "init": "ones"}})
    consts = [entry.example[f] for f, _ in entry.consts]
    pipe = pipeline_of(text)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    p = torch.rand(3, 1, 5, dtype=torch.float64) + 0.5
    torch.testing.assert_close(pipe.run(x, {"p": p}), entry.torch_fn(x, p, *consts).amax(dim=1))
    stages_h = render_plan(make_plan(pipe, target=DEFAULT), tmp_path).files["t/stages.h"]
    assert f"v = {entry.c_fn}(v, {''.join(cfloat(c) + ', ' for c in consts)}a.p[c * 5 + d1]);" in stages_h


def test_a_new_elementwise_entry_needs_nothing_else(monkeypatch, tmp_path):
    """What CONTRIBUTING.md promises: one table entry (+ its kgen_math.h function, not needed to render)."""
    square = ElementwiseOp("square", "elementwise", {}, FUSED, "x * x", torch_fn=torch.square, c_fn="kgen::square")
    monkeypatch.setitem(OPS, "square", square)
    text = spec_text([3, 6, 6], ["square", {"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], name="sq")
    pipe = pipeline_of(text)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ReferenceModel(pipe)(x), torch.nn.functional.max_pool2d(x * x, 2).sum(dim=1))
    files = render_plan(make_plan(pipe, target=DEFAULT), tmp_path).files
    assert "v = kgen::square(v);  // ops[0].square: square" in files["sq/stages.h"]
    with pytest.raises(SpecError, match="known ops:.*square"):
        parse_spec(spec_text([3, 6, 6], ["cube"]), "t.yaml")


def test_every_elementwise_op_in_one_module_builds_and_validates(tmp_path):
    """Each entry's C function against its torch function, end to end on the CPU build."""
    from kgen.build import build_module
    from kgen.render import render_spec, write_rendered
    from kgen.validate import validate

    ops = [_use(e) for e in ELEMENTWISE]
    ops += [with_param(e) for e in ELEMENTWISE if e.operand and e.name != "div"]
    ops += [{"mean": {"dim": [2, 3]}}]
    spec = write_spec(tmp_path, spec_text([3, 5, 6], ops, params={"p": {"shape": [3, 1, 1]}}, name="all_elementwise"))
    out = tmp_path / "gen"
    write_rendered(render_spec(spec, out), out)
    build_module(out / "all_elementwise", "cpu", quiet=True)
    report = validate(spec, out / "all_elementwise", "cpu")
    assert_report_passed(report)


MASKED_FILL_SPEC = """
name: NAME
inputs:
  x: {shape: [N, 3, 4, 5]}
  t: {shape: [N, 3, 4, 5]}
example: {N: 2}
params:
  m: {shape: [4, 5], init: randn}
ops:
  - masked_fill: {param: m, value: -.inf}
  - exp
  - masked_fill: {tensor: t, value: 2.5}
"""


def test_masked_fill_fills_where_its_mask_is_nonzero(tmp_path):
    """kgen's stage and the eager candidate (ATen's masked_fill) against torch's masked_fill in float64: a parameter
    mask of zeros and ones broadcast over the batch and channels, a value mask of zeros, other numbers and NaN (which
    fills, as NaN != 0); NaN and infinities in x kept where nothing fills them. Both validate as well."""
    from kgen import tune, tunefile
    from kgen.build import build_modules
    from kgen.plan import EAGER, PIPELINE
    from kgen.render import render_spec, write_rendered
    from kgen.validate import import_module_dir, validate

    from conftest import fake_tuning

    out = tmp_path / "gen"
    specs = {name: write_spec(tmp_path, MASKED_FILL_SPEC.replace("NAME", name), f"{name}.yaml") for name in ("mfill", "mfill_eager")}
    tunefile.write_entry(specs["mfill_eager"], tune.entry(
        fake_tuning(specs["mfill_eager"], [], {2: lambda c: c.get(PIPELINE) == EAGER}, tmp_path / "tune"), 30, DEFAULT.name))
    for spec in specs.values():
        write_rendered(render_spec(spec, out), out)
    build_modules([out / name for name in specs], "cpu")
    assert "kgen::masked_fill(v, -INFINITY, a.m[d0 * 5 + d1])" in (out / "mfill" / "stages.h").read_text()
    assert "at::masked_fill(Y, at::ne(t, 0), at::Scalar(2.5f))" in (out / "mfill_eager" / "binding.cpp").read_text()
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(4, 5, generator=g) < 0.5).double()
    x = torch.randn(3, 3, 4, 5, generator=g, dtype=torch.float64)
    x.view(-1)[::7], x.view(-1)[3::11], x.view(-1)[5::13] = math.nan, math.inf, -math.inf
    t = torch.randn(3, 3, 4, 5, generator=g, dtype=torch.float64)
    t.view(-1)[::3], t.view(-1)[1::17] = 0.0, math.nan
    want = x.masked_fill(mask != 0, -math.inf).exp().masked_fill(t != 0, 2.5)
    assert want.isnan().any() and (want == 0).any() and (want == 2.5).any()
    for name, spec in specs.items():
        model = import_module_dir(out / name).Model()
        with torch.no_grad():
            model.m.copy_(mask)
            got = model(x.float(), t.float())
        torch.testing.assert_close(got, want.float(), equal_nan=True, rtol=2e-6, atol=0)
        assert_report_passed(validate(spec, out / name, "cpu"))


@pytest.mark.parametrize("fields, words", [
    ({"value": 1.0}, "give exactly one of 'param' or 'tensor'"),
    ({"tensor": "x", "value": 1.0, "reverse": True}, "takes no reversed operand"),
    ({"tensor": "x"}, "missing required field"),
    ({"tensor": "x", "value": math.nan}, "expected a finite number"),
    ({"scalar": 1.0, "value": 1.0}, "unknown key"),
])
def test_masked_fill_spec_errors_name_the_key(fields, words):
    with pytest.raises(SpecError, match=re.escape(words)):
        parse_spec(spec_text([3, 4, 5], [{"masked_fill": fields}]), "t.yaml")


def test_masked_fill_magnitudes_bound_the_values():
    """validate.run_with_magnitude (the size rounding errors scale with) through masked_fill: the fill value's size
    where filled (0 for an infinity, which is compared as a non-finite value), x's elsewhere; finite and at least
    |value| wherever the value is finite (a magnitude of -inf fed into exp made the tolerance NaN)."""
    from kgen.validate import run_with_magnitude

    pipe = pipeline_of(MASKED_FILL_SPEC.replace("NAME", "mfill"))
    g = torch.Generator().manual_seed(5)
    x, t = (torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    t.view(-1)[::3] = 0.0
    mask = (torch.rand(4, 5, generator=g) < 0.5).double()
    v, m = run_with_magnitude(pipe.ops, x, {"m": mask}, inputs={"t": t})
    assert torch.isfinite(m).all() and (m >= v.abs()).all()
    assert (m[t != 0] == 2.5).all() and (m[t == 0] >= 0).all()
