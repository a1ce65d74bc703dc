"""torch.autocast around a generated module: eager's dtypes (kgen.runtime.autocast_call), on the CPU build."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import render_specs
from kgen import runtime

CONV_POOL = """
name: NAME
input:
  shape: [N, 3, 10, 10]
  dtype: DTYPES
  example: {N: 2}
ops:
  - conv2d: {out_channels: 8, kernel_size: 3}
  - relu
  - max_pool2d: {kernel_size: 2}
"""

# a float32 parameter after the convolution: eager promotes the bfloat16 convolution's result back to float32
CONV_SHIFT = """
name: ac_conv_shift
input:
  shape: [N, 3, 10, 10]
  dtype: [float32, bfloat16]
  example: {N: 2}
params:
  shift: {shape: [8, 1, 1]}
ops:
  - conv2d: {out_channels: 8, kernel_size: 3}
  - add: {param: shift}
  - relu
"""


@pytest.fixture(scope="module")
def ac_modules(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    root = tmp_path_factory.mktemp("autocast")
    rendered = render_specs(root, {
        "ac_conv_pool": CONV_POOL.replace("NAME", "ac_conv_pool").replace("DTYPES", "[float32, bfloat16]"),
        "ac_conv_pool32": CONV_POOL.replace("NAME", "ac_conv_pool32").replace("DTYPES", "float32"),
        "ac_conv_shift": CONV_SHIFT,
    })
    build_modules([d for _, d in rendered.values()], "cpu")
    return {n: import_module_dir(d) for n, (_, d) in rendered.items()}


def _eager_conv_pool(model, x):
    return F.max_pool2d(torch.relu(F.conv2d(x, model.conv.weight, model.conv.bias)), 2)


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _close(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2), (got.float() - want.float()).abs().max()


def test_conv_pool_under_autocast_runs_the_bfloat16_plans(ac_modules):
    """Eager computes the whole chain in bfloat16 (the convolution cast, relu and the pool in what they
    get): the module casts x and its parameters and runs its bfloat16 plans."""
    m = ac_modules["ac_conv_pool"]
    torch.manual_seed(0)
    model = m.Model()
    x = torch.randn(3, 3, 10, 10)
    with _autocast(), warnings.catch_warnings():
        warnings.simplefilter("error")  # it has bfloat16 plans: no warning
        got = model(x)
        want = _eager_conv_pool(model, x)
        functional = m.forward(x, model.conv.weight, model.conv.bias)
    assert want.dtype == torch.bfloat16
    _close(got, want)
    # the bfloat16 plans' convolution is eager's own call on the same bfloat16 operands: the same bits
    assert torch.equal(got, want) and torch.equal(functional, got)
    assert model.conv.weight.dtype == torch.float32  # autocast casts copies, as eager's
    decided = [v for k, v in runtime._AUTOCAST.items() if k[0] == "kgen::ac_conv_pool"]
    assert decided and all(v == (torch.bfloat16, (torch.bfloat16,)) for v in decided)
    # outside autocast the float32 plans run, as before
    _close(model(x), _eager_conv_pool(model, x))


def test_gradients_under_autocast_reach_the_float32_parameters(ac_modules):
    m = ac_modules["ac_conv_pool"]
    torch.manual_seed(1)
    model = m.Model()
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    w, b = (p.detach().clone().requires_grad_() for p in (model.conv.weight, model.conv.bias))
    x2 = x.detach().clone().requires_grad_()
    with _autocast():
        y = model(x)
        want = F.max_pool2d(torch.relu(F.conv2d(x2, w, b)), 2)
    g = torch.randn(y.shape).bfloat16()
    y.backward(g)
    want.backward(g)
    for got, ref in ((x.grad, x2.grad), (model.conv.weight.grad, w.grad), (model.conv.bias.grad, b.grad)):
        assert got.dtype == ref.dtype == torch.float32
        assert torch.allclose(got, ref, atol=1e-2, rtol=1e-2)


def test_a_float32_module_under_autocast_returns_eagers_dtype_with_a_warning(ac_modules):
    """No bfloat16 plans: it computes float32 (more accurate than eager's bfloat16) and returns bfloat16 as
    eager does, warning with the spec edit that adds the dtype."""
    m = ac_modules["ac_conv_pool32"]
    torch.manual_seed(2)
    model = m.Model()
    x = torch.randn(2, 3, 10, 10)
    with _autocast(), pytest.warns(UserWarning, match=r"computes float32 and returns bfloat16 \(add bfloat16 to `dtype:`"):
        got = model(x)
    with _autocast():
        want = _eager_conv_pool(model, x)
    _close(got, want)
    exact = _eager_conv_pool(model.double(), x.double())
    assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max() + 1e-6


def test_mixed_dtypes_in_eager_compute_float32(ac_modules):
    """conv (bfloat16) + a float32 parameter (promoted to float32) + relu: eager returns float32; the module
    computes float32 throughout."""
    m = ac_modules["ac_conv_shift"]
    torch.manual_seed(3)
    model = m.Model()
    x = torch.randn(2, 3, 10, 10)
    with _autocast():
        got = model(x)
        want = torch.relu(F.conv2d(x, model.conv.weight, model.conv.bias) + model.shift)
    assert want.dtype == torch.float32
    _close(got, want)
    exact = torch.relu(F.conv2d(x.double(), model.conv.weight.double(), model.conv.bias.double()) + model.shift.double())
    assert torch.allclose(got.double(), exact, atol=1e-5)  # float32's accuracy, not bfloat16's


def test_autocast_for_another_device_changes_nothing(ac_modules):
    m = ac_modules["ac_conv_pool"]
    model = m.Model()
    x = torch.randn(2, 3, 10, 10)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False), torch.autocast("cpu", enabled=False):
        assert model(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bfloat16 model under autocast: bfloat16 throughout
        y = model.to(torch.bfloat16)(x.bfloat16())
    assert y.dtype == torch.bfloat16


def test_torch_compile_fullgraph_under_autocast(ac_modules):
    """The decision is a constant at trace time (torch.compiler.assume_constant_result): no graph break."""
    m = ac_modules["ac_conv_pool"]
    for k in [k for k in runtime._AUTOCAST if k[0] == "kgen::ac_conv_pool"]:
        del runtime._AUTOCAST[k]  # decided while tracing
    torch.manual_seed(4)
    model = m.Model()
    x = torch.randn(2, 3, 10, 10)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with _autocast():
        got = compiled(x)
        want = _eager_conv_pool(model, x)
    _close(got, want)
