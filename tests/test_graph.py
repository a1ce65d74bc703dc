"""The IR as a dataflow graph: branches (two chains from one value), joins (a residual add of two
branches, an elementwise op reading another branch's value), concatenation of branches, and several
outputs (spec `outputs:`). For each: the plan's stages and which values are tensors, and the
float64 run against a hand-written torch function; a few are built and validated on the CPU, and
a model returning two tensors is imported."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_report_passed, pipeline_of, render_specs
from kgen.errors import SpecError
from kgen.ir import Capture
from kgen.plan import make_plan
from kgen.reference import ReferenceModel
from kgen.spec import parse_spec, spec_from_data, spec_to_data
from kgen.target import DEFAULT

BRANCHES = """
name: g_branches
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - conv2d: {out_channels: 4, kernel_size: 3, padding: 1, as: c}
  - relu
  - max_pool2d: {kernel_size: 2, as: p}
  - sigmoid: {from: c}
  - avg_pool2d: {kernel_size: 2, as: q}
outputs: [p, q]
"""


def branches(x, t):
    c = F.conv2d(x, t["conv.weight"], t["conv.bias"], padding=1)
    return F.max_pool2d(torch.relu(c), 2), F.avg_pool2d(torch.sigmoid(c), 2)


JOIN = """
name: g_join
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - conv2d: {out_channels: 4, kernel_size: 3, padding: 1, as: c}
  - relu
  - conv2d: {out_channels: 4, kernel_size: 3, padding: 1, name: conv2, as: b}
  - tanh: {from: c}
  - mul: {tensor: b}
  - add: {tensor: c}
  - relu
"""


def join(x, t):
    c = F.conv2d(x, t["conv.weight"], t["conv.bias"], padding=1)
    b = F.conv2d(torch.relu(c), t["conv2.weight"], t["conv2.bias"], padding=1)
    return torch.relu(torch.tanh(c) * b + c)


CAT = """
name: g_cat
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - relu: {as: r}
  - max_pool2d: {kernel_size: 2, as: p}
  - avg_pool2d: {kernel_size: 2, from: r}
  - cat: {tensors: [p], dim: 1}
  - mul: {scalar: 0.5}
"""


def cat(x, t):
    r = torch.relu(x)
    return torch.cat([F.avg_pool2d(r, 2), F.max_pool2d(r, 2)], 1) * 0.5


TWO = """
name: g_two
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - relu: {as: h}
  - max_pool2d: {kernel_size: 2}
  - mul: {scalar: 2.0, as: y}
outputs: [y, h]
"""


def two(x, t):
    h = torch.relu(x)
    return F.max_pool2d(h, 2) * 2.0, h


READ_LATER = """
name: g_read_later
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - tanh: {as: h}
  - sigmoid
  - mul: {tensor: h, as: y}
outputs: [h, y]
"""


def read_later(x, t):
    h = torch.tanh(x)
    return h, torch.sigmoid(h) * h


# a generated convolution takes the bias + relu stage as its epilogue: r is that fused stage's output
EPILOGUE = """
name: g_epilogue
input: {shape: [N, 3, 8, 8], example: {N: 2}}
ops:
  - conv2d: {out_channels: 8, kernel_size: 3}
  - relu: {as: r}
  - max_pool2d: {kernel_size: 2, as: y}
outputs: [y, r]
"""


def epilogue(x, t):
    r = torch.relu(F.conv2d(x, t["conv.weight"], t["conv.bias"]))
    return F.max_pool2d(r, 2), r


# the convolution's own output is an output: no epilogue may take the stage after it
CONV_OUT = """
name: g_conv_out
input: {shape: [N, 3, 8, 8], example: {N: 2}}
ops:
  - conv2d: {out_channels: 8, kernel_size: 3, as: c}
  - relu: {as: r}
  - max_pool2d: {kernel_size: 2}
  - sum: {dim: 1, as: y}
outputs: [y, r, c]
"""


def conv_out(x, t):
    c = F.conv2d(x, t["conv.weight"], t["conv.bias"])
    r = torch.relu(c)
    return F.max_pool2d(r, 2).sum(1), r, c


def _plan(text):
    return make_plan(pipeline_of(text), target=DEFAULT)


def _stages(plan):
    """(family, op descriptions) per stage, and the stage each absorbed one runs in."""
    return [(s.family.name, [o.describe() for o in s.ops]) for s in plan.stages]


CASES = {"branches": (BRANCHES, branches), "join": (JOIN, join), "cat": (CAT, cat), "two": (TWO, two),
         "read_later": (READ_LATER, read_later), "epilogue": (EPILOGUE, epilogue), "conv_out": (CONV_OUT, conv_out)}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_run_is_the_hand_written_function(name):
    text, fn = CASES[name]
    pipe = pipeline_of(text)
    torch.manual_seed(0)
    ref = ReferenceModel(pipe).double()
    x = torch.randn(pipe.input.concrete(3), dtype=torch.float64)
    x[0, 0, 0, :2] = torch.tensor([float("nan"), float("inf")])  # non-finite values reach the same places
    got, want = ref(x), fn(x, ref.tensors())
    got, want = (v if isinstance(v, tuple) else (v,) for v in (got, want))
    assert len(got) == len(want) == len(pipe.output_types)
    for g, w, t in zip(got, want, pipe.output_types):
        assert tuple(g.shape) == tuple(w.shape) == t.concrete(3)
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_branches_plan():
    plan = _plan(BRANCHES)
    assert [f for f, _ in _stages(plan)] in (["conv_gemm", "pool_reduce", "pool_reduce"], ["conv_aten", "pool_reduce", "pool_reduce"])
    # c is read by both branches: the convolution's output, no epilogue, no bias moved out of it
    assert plan.value_exprs["c"] == "t0" and plan.stages[1].absorbed_by is None
    assert plan.stages[2].source == "t0"  # the second chain starts again from c
    assert plan.output_exprs() == ["t1", "t2"]


def test_join_plan_reads_both_branches_as_tensors():
    plan = _plan(JOIN)
    stages = _stages(plan)
    assert stages[-1] == ("pool_reduce", ["tanh", "mul(x, b)", "add(x, c)", "relu"])
    assert plan.stage_values(plan.stages[-1]) == ["c", "b"]
    assert plan.value_exprs["c"] == "t0" and plan.value_exprs["b"] == "t2"
    assert plan.stages[-1].source == "t0" and plan.output_exprs() == [f"t{len(stages) - 1}"]


def test_cat_of_branches_plan():
    plan = _plan(CAT)
    assert _stages(plan) == [("pool_reduce", ["relu", "as r"]), ("pool_reduce", ["max_pool2d(k=2)", "as p"]),
                             ("pool_reduce", ["avg_pool2d(k=2)"]), ("aten", ["cat([x, p], dim=1)"]), ("pool_reduce", ["mul(0.5)"])]
    assert plan.value_exprs == {"x": "x", "r": "t0", "p": "t1"} and plan.stages[2].source == "t0"


def test_an_intermediate_output_ends_its_stage():
    plan = _plan(TWO)
    assert _stages(plan) == [("pool_reduce", ["relu", "as h"]), ("pool_reduce", ["max_pool2d(k=2)", "mul(2)", "as y"])]
    assert plan.output_exprs() == ["t1", "t0"]
    # without `outputs:`, nothing reads h: one stage, h stays in a register
    alone = _plan(TWO.replace("outputs: [y, h]\n", ""))
    assert len(alone.stages) == 1 and alone.output_exprs() == ["t0"]


def test_an_output_read_in_its_own_run_is_still_written():
    plan = _plan(READ_LATER)
    assert _stages(plan) == [("pool_reduce", ["tanh", "as h"]), ("pool_reduce", ["sigmoid", "mul(x, h)", "as y"])]
    assert plan.stage_values(plan.stages[1]) == ["h"] and plan.output_exprs() == ["t0", "t1"]
    alone = _plan(READ_LATER.replace("outputs: [h, y]\n", ""))
    assert len(alone.stages) == 1 and plan.stage_values(alone.stages[0]) == []  # a register


def test_an_output_of_an_absorbed_stage_is_that_stages_tensor():
    plan = _plan(EPILOGUE)
    conv, act, pool = plan.stages
    assert [o.describe() for o in act.ops] == ["add(conv.bias per channel)", "relu", "as r"]
    if conv.family.name == "conv_gemm":
        assert act.absorbed_by is conv  # the fused convolution writes r
    assert pool.absorbed_by is None and plan.output_exprs() == ["t2", "t1"]


def test_an_output_the_next_stage_reads_keeps_the_epilogue_out():
    plan = _plan(CONV_OUT)
    conv = plan.stages[0]
    assert not any(isinstance(o, Capture) for o in conv.ops)
    assert all(s.absorbed_by is None for s in plan.stages) and getattr(conv, "epilogue", None) is None
    assert "bias added by the next stage" not in conv.ops[0].describe()  # c is the convolution with its bias
    assert plan.output_exprs() == ["t2", "t1", "t0"]


def test_the_eager_plan_returns_each_output():
    plan = make_plan(pipeline_of(TWO), target=DEFAULT, choices={"pipeline": "eager"})
    assert plan.eager and plan.output_exprs() == ["t0", "v_h.contiguous()"]


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize("outputs, key, message", [
    ("[y, zz]", "outputs[1]", "unknown value 'zz'"),
    ("[y, x]", "outputs[1]", "'x' is an input"),
    ("[y, h, y]", "outputs[2]", "listed twice"),
    ("[h]", "outputs", "the last op's result (ops[2].mul) is not an output"),
    ("[]", "outputs", "non-empty list"),
    ("y", "outputs", "non-empty list"),
])
def test_outputs_errors_name_the_key(outputs, key, message):
    text = TWO.replace("outputs: [y, h]", f"outputs: {outputs}")
    with pytest.raises(SpecError) as e:
        pipeline_of(text, "g.yaml")
    assert e.value.key == key and message in e.value.message, str(e.value)


def test_spec_data_has_outputs_only_when_given():
    spec = parse_spec(TWO)
    data = spec_to_data(spec)
    assert data["outputs"] == ["y", "h"] and spec_from_data(data).outputs == ("y", "h")
    assert "outputs" not in spec_to_data(parse_spec(JOIN))
    one = pipeline_of(TWO.replace("outputs: [y, h]", "outputs: [y]"))
    assert not one.several_outputs and one.output_types == (one.output,)


# ---------------------------------------------------------------- built and validated


@pytest.fixture(scope="module")
def built_graphs(tmp_path_factory):
    from kgen.build import build_modules

    root = tmp_path_factory.mktemp("graph")
    rendered = render_specs(root, {"g_branches": BRANCHES, "g_read_later": READ_LATER, "g_epilogue": EPILOGUE})
    build_modules([d for _, d in rendered.values()], "cpu")
    return rendered


@pytest.mark.parametrize("name", ["g_branches", "g_read_later", "g_epilogue"])
def test_builds_and_validates_every_output(built_graphs, name):
    from kgen.validate import validate

    spec, module_dir = built_graphs[name]
    report = validate(spec, module_dir, "cpu")
    assert_report_passed(report, name)
    pipe = pipeline_of(spec.read_text())
    for n in pipe.outputs:  # each output is its own case
        assert any(c.case.endswith(f": output {n}") for c in report.cases), n


def test_the_model_returns_a_tuple_and_its_gradients_take_each_output(built_graphs):
    from kgen.validate import import_module_dir

    spec, module_dir = built_graphs["g_epilogue"]
    mod = import_module_dir(module_dir)
    torch.manual_seed(0)
    model = mod.Model()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    y, r = model(x)
    assert set(mod.OUTPUT_SHAPES) == {"y", "r"} and tuple(y.shape) == (2, 8, 3, 3) and tuple(r.shape) == (2, 8, 6, 6)
    t = dict(model.named_parameters())
    want_y, want_r = epilogue(x, t)
    torch.testing.assert_close((y, r), (want_y, want_r))
    gy, gr = torch.randn_like(y), torch.randn_like(r)
    got = torch.autograd.grad((y, r), (x, t["conv.weight"]), (gy, gr))
    want = torch.autograd.grad((want_y, want_r), (x, t["conv.weight"]), (gy, gr))
    torch.testing.assert_close(got, want)
    y, r = model(x)  # one output unused
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x), torch.autograd.grad(epilogue(x, t)[0].sum(), x))
    with torch.no_grad():  # the fake implementation: the shapes of both, under torch.compile
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        shapes = [tuple(v.shape) for v in compiled(x.detach()[:1])]
    assert shapes == [(1, 8, 3, 3), (1, 8, 6, 6)]


# ---------------------------------------------------------------- import


TWO_OUT_MODEL = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        y = nn.functional.max_pool2d(h, 2) * 2.0
        return y, h


def get_inputs():
    return [torch.randn(2, 3, 8, 8)]


def get_init_inputs():
    return []
'''


def test_import_maps_a_returned_tuple_to_outputs(tmp_path):
    import importlib.util

    from kgen.importer import import_model
    from kgen.ir import load_pipeline

    src = tmp_path / "two_out.py"
    src.write_text(textwrap.dedent(TWO_OUT_MODEL))
    # a tuple; a list; with a value computed after the outputs that nothing returns (tracing drops it)
    for ret in ("return y, h", "return [h, y]", "z = y + 1\n        return h, y"):
        src.write_text(textwrap.dedent(TWO_OUT_MODEL).replace("return y, h", ret))
        pipe = load_pipeline(import_model(str(src), name="imp_two", out_dir=tmp_path / "specs"))
        assert pipe.several_outputs and len(pipe.outputs) == 2
        assert [tuple(t.shape[1:]) for t in pipe.output_types] == ([(4, 3, 3), (4, 6, 6)] if ret == "return y, h" else [(4, 6, 6), (4, 3, 3)])
        loader = importlib.util.spec_from_file_location("two_out_model", src)
        m = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(m)
        torch.manual_seed(0)
        original = m.Model()
        torch.manual_seed(0)
        ref = ReferenceModel(pipe)
        x = torch.randn(2, 3, 8, 8)
        torch.testing.assert_close(tuple(ref(x)), tuple(original(x)), rtol=0, atol=0)


def test_import_refuses_an_input_returned_unchanged(tmp_path):
    from kgen.importer import ImportFailed, import_model

    src = tmp_path / "passthrough.py"
    src.write_text(textwrap.dedent(TWO_OUT_MODEL).replace("return y, h", "return y, x"))
    with pytest.raises(ImportFailed, match="result 1 is an input returned unchanged"):
        import_model(str(src), name="imp_bad", out_dir=tmp_path / "specs")
