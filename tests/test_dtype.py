"""bfloat16 and float16: the spec's dtype list, a plan per dtype, the op's dispatch and refusals,
Model().to(dtype), state_dict and autograd in 16 bits, validation per dtype (CPU build)."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, SPECS, assert_report_passed, pipeline_of, render_specs
from kgen.errors import SpecError
from kgen.spec import load_spec, parse_spec, spec_from_data, spec_to_data
from kgen.tunefile import spec_hash

BF16_SPEC = """
name: dt_conv_pool
input:
  shape: [N, 3, 10, 10]
  dtype: [float32, bfloat16]
  example: {N: 2}
ops:
  - conv2d: {out_channels: 8, kernel_size: 3}
  - relu
  - max_pool2d: {kernel_size: 2}
"""

# ATen-backed ops and a softmax: in 16 bits kgen's own stages (linear_aten, aten, softmax) compute it, not only the eager plan
ATEN_SPEC = """
name: dt_linear_bn
input:
  shape: [N, 16]
  dtype: [float32, float16, bfloat16]
  example: {N: 4}
ops:
  - linear: {out_features: 8}
  - batch_norm
  - softmax: {dim: 1}
"""


def _spec(text, path="t.yaml"):
    return parse_spec(text, path)


# ------------------------------------------------------------ the spec


def test_dtype_forms_and_round_trip():
    for given, want in (("float32", ("float32",)), ("bfloat16", ("bfloat16",)), ("[float32, float16]", ("float32", "float16"))):
        spec = _spec(BF16_SPEC.replace("[float32, bfloat16]", given))
        assert spec.dtypes == want
        again = spec_from_data(spec_to_data(spec))
        assert again.dtypes == want and spec_to_data(again) == spec_to_data(spec)
    data = spec_to_data(_spec(BF16_SPEC))
    assert data["input"]["dtype"] == ["float32", "bfloat16"]


def test_dtype_errors_name_the_key():
    with pytest.raises(SpecError, match=r"input\.dtype\[1\]: unsupported dtype 'float64'"):
        _spec(BF16_SPEC.replace("[float32, bfloat16]", "[float32, float64]"))
    with pytest.raises(SpecError, match=r"input\.dtype\[1\]: dtype float32 is listed twice"):
        _spec(BF16_SPEC.replace("[float32, bfloat16]", "[float32, float32]"))
    with pytest.raises(SpecError, match=r"input\.dtype: expected a dtype or a non-empty list"):
        _spec(BF16_SPEC.replace("[float32, bfloat16]", "[]"))
    two = """
name: two
inputs:
  x: {shape: [N, 4], dtype: bfloat16}
  y: {shape: [N, 4], dtype: float32}
ops:
  - add: {tensor: y}
"""
    with pytest.raises(SpecError, match=r"inputs\.y\.dtype: every input has the dtype of the first \(bfloat16\), got float32"):
        _spec(two)
    assert _spec(two.replace("dtype: float32", "dtype: bfloat16")).dtypes == ("bfloat16",)


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_float32_specs_keep_their_data_and_hash(path):
    """A float32 spec's data reads as before (a single "float32"): spec hashes, and so the
    committed tuning files, are unchanged; adding a dtype keeps the hash (the entries measure
    the float32 plans)."""
    spec = load_spec(path)
    data = spec_to_data(spec)
    assert spec.dtypes == ("float32",) and data["input"]["dtype"] == "float32"
    tune = path.with_name(path.stem + ".tune.json")
    pipe = pipeline_of(path.read_text(), str(path))
    if tune.exists():
        assert any(e["spec_hash"] == spec_hash(pipe) for e in json.loads(tune.read_text())["entries"])
    more = pipeline_of(path.read_text().replace("dtype: float32", "dtype: [float32, bfloat16]"), str(path))
    assert more.dtypes == ("float32", "bfloat16") and spec_hash(more) == spec_hash(pipe)


# ------------------------------------------------------------ the plans


def test_a_plan_per_dtype_and_16_bit_convolutions_are_generated():
    """The fused families and the generated convolution compute 16 bits (tests/test_half_families.py,
    tests/test_conv_gemm_half.py): a 16-bit convolution runs on single TF32 products (exact for 16-bit
    operands) and keeps its bias (added to its rounded output, as eager's)."""
    from kgen.explain import explain_text
    from kgen.plan import choose_plans

    pipe = pipeline_of(BF16_SPEC)
    sel = choose_plans(pipe)
    assert sel.dtypes == ["float32", "bfloat16"]
    (f32,) = [v for v in sel.variants if v.dtype == "float32"]
    (b16,) = [v for v in sel.variants if v.dtype == "bfloat16"]
    assert not f32.plan.eager and not b16.plan.eager
    assert [s.family.name for s in b16.plan.stages] == ["conv_gemm", "pool_reduce"]
    conv = b16.plan.stages[0]
    assert not conv.conv.bias_deferred and conv.schedule.mma == "tf32" and conv.schedule.input_bytes == 2
    text = explain_text(pipe, dtype="bfloat16")
    assert "tf32, exact for 16-bit operands" in text and "eager (the spec's ops through ATen)" in text


def test_16_bit_plans_of_aten_backed_stages():
    from kgen.plan import choose_plans

    sel = choose_plans(pipeline_of(ATEN_SPEC))
    families = lambda dtype: {v.mode: [s.family.name for s in v.plan.stages] for v in sel.variants if v.dtype == dtype}  # noqa: E731
    for dtype in ("float16", "bfloat16"):
        # batch norm's plans as in float32 (tests/test_half_batch_norm.py): eval mode's affine fuses into the softmax
        assert families(dtype) == families("float32") and families(dtype)["eval"] == ["linear_aten", "softmax"]
        (v,) = [v for v in sel.variants if v.dtype == dtype and v.mode == "eval"]
        assert all(not d.fired for d in v.plan.decisions)  # no other rewrite applies


# ------------------------------------------------------------ the module (CPU build)


@pytest.fixture(scope="module")
def dt_modules(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    root = tmp_path_factory.mktemp("dtype")
    rendered = render_specs(root, {"dt_conv_pool": BF16_SPEC, "dt_linear_bn": ATEN_SPEC})
    build_modules([d for _, d in rendered.values()], "cpu")
    return {n: (spec, d, import_module_dir(d)) for n, (spec, d) in rendered.items()}


def _eager_conv_pool(model, x):
    return F.max_pool2d(torch.relu(F.conv2d(x, model.conv.weight, model.conv.bias)), 2)


def test_validates_in_every_dtype(dt_modules):
    from kgen.validate import validate

    for name, (spec, d, _) in dt_modules.items():
        report = validate(spec, d, "cpu")
        assert_report_passed(report, name)
        dtypes = [dtype for dtype, r in report.by_dtype() if r.cases]
        assert dtypes == list(load_spec(spec).dtypes)
        assert any("vs eager" in c.case for c in report.cases if c.dtype != "float32")


def test_model_to_bfloat16_matches_eager(dt_modules):
    m = dt_modules["dt_conv_pool"][2]
    torch.manual_seed(0)
    model = m.Model().to(torch.bfloat16)
    x = torch.randn(3, 3, 10, 10).bfloat16()
    y = model(x)
    assert y.dtype == torch.bfloat16
    want = _eager_conv_pool(model, x)
    assert torch.allclose(y.float(), want.float(), atol=1e-2, rtol=1e-2)
    # the float32 plan still runs for float32 inputs, as before
    model32 = m.Model()
    x32 = torch.randn(2, 3, 10, 10)
    assert torch.allclose(model32(x32), _eager_conv_pool(model32, x32), atol=1e-5)


def test_mixed_dtypes_are_refused(dt_modules):
    m = dt_modules["dt_conv_pool"][2]
    x = torch.randn(2, 3, 10, 10)
    with pytest.raises(RuntimeError, match=r"params\[0\] \(conv\.weight\) is float32 but x is bfloat16: .*model\.to\(torch\.bfloat16\)"):
        m.Model()(x.bfloat16())
    with pytest.raises(RuntimeError, match=r"params\[0\] \(conv\.weight\) is bfloat16 but x is float32"):
        m.Model().to(torch.bfloat16)(x)


def test_a_dtype_not_rendered_is_refused_with_the_command(dt_modules):
    spec, _, m = dt_modules["dt_conv_pool"]
    x = torch.randn(2, 3, 10, 10)
    with pytest.raises(RuntimeError) as e:
        m.Model().half()(x.half())
    msg = str(e.value)
    assert "x is float16, but this module was rendered for float32, bfloat16 only" in msg
    assert "`dtype: [float32, bfloat16, float16]` under `input:`" in msg and "kgen all " in msg
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        m.Model().double()(x.double())


def test_float16_to_a_float32_module_is_refused_with_the_command(modules):
    m = modules["maxpool_sum"]
    model = m.Model().half()
    with pytest.raises(RuntimeError, match=r"x is float16, but this module was rendered for float32 only; to add float16, "
                                           r"write `dtype: \[float32, float16\]` under `input:` in specs/maxpool_sum\.yaml "
                                           r"and run `kgen all specs/maxpool_sum\.yaml`"):
        model(torch.randn(1, 32, 32, 32, 32).half())


def test_state_dict_in_16_bits_round_trips(dt_modules):
    m = dt_modules["dt_linear_bn"][2]
    torch.manual_seed(1)
    a = m.Model().to(torch.bfloat16)
    a.train()
    a(torch.randn(8, 16).bfloat16())  # running statistics updated, in bfloat16 as nn.BatchNorm keeps them
    sd = a.state_dict()
    assert sd["batch_norm.running_mean"].dtype == torch.bfloat16 and sd["batch_norm.num_batches_tracked"] == 1
    b = m.Model().to(torch.bfloat16)
    b.load_state_dict(sd)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in sd.items())
    x = torch.randn(5, 16).bfloat16()
    assert torch.equal(a.eval()(x), b.eval()(x))
    # and the same model in eager PyTorch (nn.Linear, nn.BatchNorm1d in bfloat16) computes the same
    ref = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8)).to(torch.bfloat16).eval()
    ref[0].load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith("linear.")})
    ref[1].load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith("batch_norm.")})
    assert torch.allclose(a(x).float(), torch.softmax(ref(x), 1).float(), atol=1e-2, rtol=1e-2)


def test_autograd_in_bfloat16_gives_eagers_gradients(dt_modules):
    m = dt_modules["dt_conv_pool"][2]
    torch.manual_seed(2)
    model = m.Model().to(torch.bfloat16)
    x = torch.randn(2, 3, 10, 10).bfloat16().requires_grad_()
    g = torch.randn(2, 8, 4, 4).bfloat16()
    model(x).backward(g)
    x2 = x.detach().clone().requires_grad_()
    w, b = (p.detach().clone().requires_grad_() for p in (model.conv.weight, model.conv.bias))
    F.max_pool2d(torch.relu(F.conv2d(x2, w, b)), 2).backward(g)
    assert x.grad.dtype == torch.bfloat16 and model.conv.weight.grad.dtype == torch.bfloat16
    for got, want in ((x.grad, x2.grad), (model.conv.weight.grad, w.grad), (model.conv.bias.grad, b.grad)):
        assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_fake_tensor_keeps_the_dtype(dt_modules):
    m = dt_modules["dt_conv_pool"][2]
    model = m.Model().to(torch.bfloat16)
    args = (torch.randn(2, 3, 10, 10).bfloat16(), [model.conv.weight.detach(), model.conv.bias.detach()])
    result = torch.library.opcheck(torch.ops.kgen.dt_conv_pool.default, args, test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_shipped_generated_files_for_float32_are_one_dtype_check(built):
    """The committed float32 modules: x's dtype check (float32 only) and the rest as before."""
    text = (ROOT / "generated" / "maxpool_sum" / "binding.cpp").read_text()
    assert 'kgen::check_dtype(kOp, x, {at::kFloat}, "float32", "specs/maxpool_sum.yaml", "`input:`");' in text
    assert "x.scalar_type() ==" not in text  # one dtype: no dispatch on it
