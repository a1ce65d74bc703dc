"""The shipped modules: render -> build -> validate, drop-in Model, errors, tracing."""
import math

import pytest
import torch

from conftest import DEVICES, ROOT, SHIPPED, assert_report_passed
from handwritten import MODELS
from kgen.ir import load_pipeline
from kgen.validate import compare, validate

SPEC = {n: ROOT / "specs" / f"{n}.yaml" for n in SHIPPED}


HANDWRITTEN = sorted(MODELS)  # shipped specs with a hand-written model to compare with


def test_every_handwritten_model_has_its_shipped_spec():
    assert set(HANDWRITTEN) <= set(SHIPPED)


HEAVY_ON_CPU = {"maxpool_sum", "relu_group_norm"}  # their full-size CPU validation takes 80-100 s


@pytest.mark.parametrize("name,device", [
    pytest.param(n, d, marks=[pytest.mark.slow] if d == "cpu" and n in HEAVY_ON_CPU else []) for n in SHIPPED for d in DEVICES])
def test_validates_against_float64_reference(name, device, built):
    report = validate(SPEC[name], built[name], device)
    assert_report_passed(report)
    labels = [c.case for c in report.cases]
    # both kinds of cases ran: end to end (normal and adversarial) and per stage
    assert any("NaN in the input" in s for s in labels) and any("odd batch" in s for s in labels)
    assert any(s.startswith("stage") and "inf" in s for s in labels)


@pytest.mark.parametrize("name", HANDWRITTEN)
def test_model_initializes_like_the_handwritten_model(name, modules):
    torch.manual_seed(7)
    hand = MODELS[name]()
    torch.manual_seed(7)
    ours = modules[name].Model()
    a, b = hand.state_dict(), ours.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", HANDWRITTEN)
def test_state_dict_round_trip_with_handwritten_model(name, modules):
    torch.manual_seed(1)
    hand = MODELS[name]()
    ours = modules[name].Model()
    ours.load_state_dict(hand.state_dict())  # hand-written -> kgen
    x = torch.randn(load_pipeline(SPEC[name]).input.concrete(1))
    with torch.no_grad():
        expected = hand.double()(x.double())
        got = ours(x)
    r = compare("round trip", got, expected, (1e-5, 1e-4))
    assert r.passed, r.problem
    torch.manual_seed(2)
    fresh = modules[name].Model()
    back = MODELS[name]()
    back.load_state_dict(fresh.state_dict())  # kgen -> hand-written
    for k, v in fresh.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


@pytest.mark.parametrize("name", SHIPPED)
def test_functional_forward_matches_model(name, modules):
    torch.manual_seed(3)
    model = modules[name].Model()
    x = torch.randn(load_pipeline(SPEC[name]).input.concrete(2))
    params = [p for _, p in model.named_parameters()]
    by_name = dict(model.named_parameters())
    ordered = [by_name[k] for k in modules[name].PARAMETERS]
    with torch.no_grad():
        assert torch.equal(modules[name].forward(x, *ordered), model(x))
    assert sorted(map(id, params)) == sorted(map(id, ordered))


def test_aten_convolution_weights_follow_the_weights(modules):
    """An ATen convolution stage keeps its flipped sub-pixel weights between calls
    (kgen::WeightCache, on the CPU as on the GPU): an in-place update, a new weight
    tensor and new data under the same tensor (`.data =`, as Module.to moves a
    parameter to another device, with its version counter unchanged) are seen, and
    an inference tensor is derived afresh each call."""
    from kgen.reference import ReferenceModel

    name = "relu_group_norm"
    pipe = load_pipeline(SPEC[name])
    torch.manual_seed(4)
    model, ref = modules[name].Model(), ReferenceModel(pipe)
    x = torch.randn(pipe.input.concrete(1))

    def check():
        ref.load_state_dict(model.state_dict())
        y = model(x)
        torch.testing.assert_close(y, ref(x), rtol=1e-4, atol=1e-4)
        return y

    with torch.no_grad():
        first = check()
        assert torch.equal(check(), first)  # the kept weights: the same result
        model.conv_transpose.weight.mul_(-0.5)  # in place: the version counter moves
        assert not torch.allclose(check(), first)
        model.conv_transpose.weight = torch.nn.Parameter(torch.randn_like(model.conv_transpose.weight) * 0.1)
        second = check()
        version = model.conv_transpose.weight._version
        model.conv_transpose.weight.data = torch.randn_like(model.conv_transpose.weight) * 0.1
        assert model.conv_transpose.weight._version == version
        assert not torch.allclose(check(), second)
    with torch.inference_mode():
        model.conv_transpose.weight = torch.nn.Parameter(torch.randn_like(model.conv_transpose.weight), requires_grad=False)
        assert model.conv_transpose.weight.is_inference()
        check()
        model.conv_transpose.weight.mul_(2.0)  # no version counter to see this by
        check()


def test_wrong_inputs_get_clear_errors(modules):
    m = modules["maxpool_sum"]
    model = m.Model()
    with pytest.raises(RuntimeError, match=r"x must have shape \[N, 32, 32, 32, 32\], got \[2, 32, 32, 32\]"):
        model(torch.randn(2, 32, 32, 32))
    with pytest.raises(RuntimeError, match=r"x must have shape \[N, 32, 32, 32, 32\], got \[1, 32, 31, 32, 32\]"):
        model(torch.randn(1, 32, 31, 32, 32))
    with pytest.raises(RuntimeError, match=r"x must be float32, bfloat16 or float16 \(this module: float32\), got float64"):
        model(torch.randn(1, 32, 32, 32, 32, dtype=torch.float64))
    w = model.conv_transpose.weight.detach()
    with pytest.raises(RuntimeError, match=r"params\[1\] \(conv_transpose.bias\) must have shape \[64\], got \[63\]"):
        m.forward(torch.randn(1, 32, 32, 32, 32), w, torch.zeros(63))


@pytest.mark.parametrize("name", SHIPPED)
def test_empty_batch(name, modules):
    pipe = load_pipeline(SPEC[name])
    y = modules[name].Model()(torch.randn(pipe.input.concrete(0)))
    assert tuple(y.shape) == pipe.output.concrete(0)


@pytest.mark.parametrize("name", ["div_max_gap_bias_sum", "instnorm_clamp_max"])
def test_torch_compile_fullgraph_traces_through_the_op(name, modules):
    torch.manual_seed(4)
    model = modules[name].Model()
    x = torch.randn(load_pipeline(SPEC[name]).input.concrete(2))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))


def test_compare_catches_unwritten_nan_and_inf_mismatches():
    ref = torch.tensor([1.0, float("nan"), float("inf"), 2.0], dtype=torch.float64)
    good = ref.float()
    assert compare("same", good, ref, (1e-5, 1e-4)).passed
    poisoned = good.clone()
    poisoned.view(torch.int32)[3] = 0x7FDEAD00
    assert "never written" in compare("poison", poisoned, ref, (1e-5, 1e-4)).problem
    wrong_inf = good.clone()
    wrong_inf[2] = -math.inf
    assert not compare("inf sign", wrong_inf, ref, (1e-5, 1e-4)).passed
    lost_nan = good.clone()
    lost_nan[1] = 0.0
    assert not compare("NaN", lost_nan, ref, (1e-5, 1e-4)).passed
    off = good.clone()
    off[0] = 1.001
    assert not compare("error", off, ref, (1e-5, 1e-4)).passed
