"""The fused families in bfloat16 and float16 (issue 44, milestone 1): pool_reduce, norm, softmax and
layer_norm read and write 16-bit tensors, compute in float32 and round each store to nearest even
(CPU build here; the CUDA build compiles the same stage math). Each spec validates in every dtype it
lists (the float64 reference on the rounded inputs, KernelBench's 1e-2 check against eager in the
same dtype, NaN and inf, per-stage adversarial values) and its 16-bit plans use the family, not eager."""
import ctypes
import shutil
import subprocess

import pytest
import torch

from conftest import ROOT, assert_report_passed, pipeline_of, render_specs

DTYPES_16 = ("bfloat16", "float16")

SPECS = {
    # a convolution (conv_gemm in 16 bits too: single TF32 products, exact for 16-bit operands; on the CPU ATen's
    # convolution in the dtype, its bias too), then a pool and a channel reduction
    "hf_conv_pool": ("""
name: hf_conv_pool
input:
  shape: [N, 3, 11, 9]
  dtype: [float32, bfloat16, float16]
  example: {N: 3}
ops:
  - conv2d: {out_channels: 7, kernel_size: 3}
  - relu
  - max_pool2d: {kernel_size: 2}
  - sum: {dim: 1}
""", ["conv_gemm", "pool_reduce"]),
    # an average pool with padding, a parameter, an activation: no reduction
    "hf_avg_pool": ("""
name: hf_avg_pool
input:
  shape: [N, 5, 9, 7]
  dtype: [bfloat16, float16]
  example: {N: 3}
params:
  bias: {shape: [5, 1, 1], init: randn}
ops:
  - avg_pool2d: {kernel_size: 3, stride: 2, padding: 1}
  - add: {param: bias}
  - sigmoid
""", ["pool_reduce"]),
    "hf_group_norm": ("""
name: hf_group_norm
input:
  shape: [N, 4, 24, 25]
  dtype: [bfloat16, float16]
  example: {N: 3}
ops:
  - relu
  - group_norm: {num_groups: 2}
  - mul: {scalar: 2.0}
""", ["norm"]),
    # a GEMM row's groups (3 of 16 channels): the layer_norm family's rows, 2 lanes of one 16-byte vector each
    "hf_group_rows": ("""
name: hf_group_rows
input: {shape: [N, 48], dtype: [bfloat16, float16], example: {N: 5}}
ops: [sigmoid, {group_norm: {num_groups: 3}}, {add: {scalar: 0.5}}]
""", ["layer_norm"]),
    "hf_softmax": ("""
name: hf_softmax
input:
  shape: [N, 13, 5]
  dtype: [bfloat16, float16]
  example: {N: 1}
ops:
  - mul: {scalar: 3.0}
  - softmax: {dim: 1}
""", ["softmax"]),
    "hf_layer_norm": ("""
name: hf_layer_norm
input:
  shape: [N, 5, 37]
  dtype: [bfloat16, float16]
  example: {N: 3}
ops:
  - layer_norm: {normalized_shape: [37]}
  - tanh
""", ["layer_norm"]),
}


def _families(text, dtype):
    from kgen.plan import choose_plans

    sel = choose_plans(pipeline_of(text))
    (v,) = [v for v in sel.variants if v.dtype == dtype]
    return v.plan


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_16_bit_plans_use_the_family(name, dtype):
    text, families = SPECS[name]
    plan = _families(text, dtype)
    assert not plan.eager
    assert [s.family.name for s in plan.stages] == families


def test_layer_norm_16_bit_loads_are_16_bytes():
    text = SPECS["hf_layer_norm"][0].replace("[N, 5, 37]", "[N, 3, 256]").replace("[37]", "[256]")
    plan = _families(text, "bfloat16")
    (st,) = plan.stages
    assert st.schedule.vector == 8 and st.value_bytes == 2  # 8 values of 2 bytes a load
    assert _families(text.replace("[bfloat16, float16]", "float32"), "float32").stages[0].schedule.vector == 4


@pytest.fixture(scope="module")
def hf_modules(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    root = tmp_path_factory.mktemp("half")
    rendered = render_specs(root, {n: t for n, (t, _) in SPECS.items()})
    build_modules([d for _, d in rendered.values()], "cpu")
    return {n: (spec, d, import_module_dir(d)) for n, (spec, d) in rendered.items()}


@pytest.mark.parametrize("name", SPECS)
def test_validates_in_16_bits(hf_modules, name):
    """kgen validate's cases in each dtype: normal data at batch 2, 1 and 3, NaN, large values, ties,
    non-contiguous and channels_last inputs, Model().to(dtype), KernelBench's check against eager in the
    same dtype, and each 16-bit stage fed +-inf, NaN, ties, data far from zero and constants."""
    from kgen.validate import validate

    spec, d, _ = hf_modules[name]
    report = validate(spec, d, "cpu")
    assert_report_passed(report, name)
    for dtype in DTYPES_16:
        cases = [c.case for c in report.cases if c.dtype == dtype]
        assert any("vs eager" in c for c in cases) and any(c.startswith("stage ") for c in cases), (dtype, cases)


def test_writes_the_dtype_and_rounds_like_eager(hf_modules):
    """The softmax stage's output is 16-bit, and each value is the float64 softmax of x * 3 as eager
    materializes it (rounded to the dtype: a rounding point, kgen.plan.rounding_points) rounded to
    nearest even (within one rounding: the float32 arithmetic before the store)."""
    m = hf_modules["hf_softmax"][2]
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(3, 13, 5).to(dt)
        y = m.Model().to(dt)(x)
        assert y.dtype == dt
        exact = torch.softmax((x.double() * 3.0).to(dt).double(), 1)
        ulp = (exact.to(dt).double() - exact).abs()  # the rounding of the exact result
        assert bool(((y.double() - exact).abs() <= 2 * ulp + torch.finfo(dt).eps * exact.abs()).all())


def test_float16_overflow_is_inf_as_in_eager(hf_modules):
    """A channel sum beyond float16's range is +inf, as eager's float16 sum gives; NaN stays NaN."""
    m = hf_modules["hf_conv_pool"][2]
    torch.manual_seed(3)
    model = m.Model().half()
    with torch.no_grad():
        model.conv.weight.fill_(1.0)
        model.conv.bias.zero_()
    x = torch.full((2, 3, 11, 9), 400.0).half()  # 27 * 400 per conv output, 7 channels: 75600 > 65504
    x[1] = 1.0
    x[1, 0, 0, 0] = float("nan")
    y = model(x)
    want = torch.nn.functional.max_pool2d(torch.relu(torch.nn.functional.conv2d(x, model.conv.weight, model.conv.bias)), 2).sum(1)
    assert bool(torch.isposinf(y[0]).all()) and bool(torch.isposinf(want[0]).all())
    assert torch.equal(torch.isnan(y), torch.isnan(want)) and bool(torch.isnan(y[1, 0, 0]))
    finite = torch.isfinite(want)
    assert torch.allclose(y[finite].float(), want[finite].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_conversions_are_pytorchs(tmp_path):
    """kgen_math.h's C++ conversions (the CPU build's; CUDA uses the hardware's cvt.rn) against PyTorch's:
    every 16-bit pattern to float, and float to 16 bits (round to nearest even, ties, subnormals, the
    float16 overflow threshold 65520, NaN, +-inf, -0) on random bit patterns and dense ranges."""
    src = tmp_path / "conv.cpp"
    src.write_text(f'#include "{ROOT / "templates" / "kgen_math.h"}"\n' + """
extern "C" void convert(const float* x, long n, uint16_t* h, uint16_t* b, float* hf, float* bf, float* hr, float* hi,
                        float* br) {
  for (long i = 0; i < n; ++i) {
    h[i] = kgen::from_float<kgen::float16>(x[i]).bits;
    b[i] = kgen::from_float<kgen::bfloat16>(x[i]).bits;
    hr[i] = kgen::float16_rounded(x[i]);  // round_to's forms (32-bit registers only), the same in CUDA
    hi[i] = kgen::float16_rounded_integer(x[i]);
    br[i] = kgen::bfloat16_rounded(x[i]);
  }
  for (long i = 0; i < 65536; ++i) {
    hf[i] = kgen::to_float(kgen::float16{static_cast<uint16_t>(i)});
    bf[i] = kgen::to_float(kgen::bfloat16{static_cast<uint16_t>(i)});
  }
}
""")
    lib = tmp_path / "conv.so"
    subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    convert = ctypes.CDLL(str(lib)).convert
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31, (1 << 20,), dtype=torch.int64, generator=g).to(torch.int32)
    dense = torch.arange(0x33000000 - 4096, 0x47800000 + 4096, 61, dtype=torch.int64).to(torch.int32)  # float16's range
    every16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0, -65520.0,
                            2.0**-25, 1.5 * 2.0**-24, 2.5 * 2.0**-24, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11])
    x = torch.cat([random_bits.view(torch.float32), dense.view(torch.float32), -dense.view(torch.float32), special,
                   every16.view(torch.float16).float(), every16.view(torch.bfloat16).float()]).contiguous()
    h, b = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel(), dtype=torch.int16)
    hf, bf = torch.empty(65536), torch.empty(65536)
    hr, hi, br = torch.empty(x.numel()), torch.empty(x.numel()), torch.empty(x.numel())
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    convert(ptr(x), ctypes.c_long(x.numel()), ptr(h), ptr(b), ptr(hf), ptr(bf), ptr(hr), ptr(hi), ptr(br))

    def same(got, want):  # equal values, equal signs of zero, NaN where NaN
        got, want = got.double(), want.double()
        return bool((((got == want) & (got.signbit() == want.signbit())) | (got.isnan() & want.isnan())).all())

    assert same(h.view(torch.float16), x.half()) and same(b.view(torch.bfloat16), x.bfloat16())
    assert same(hr, x.half().float()) and same(hi, x.half().float()) and same(br, x.bfloat16().float())
    assert same(hf, every16.view(torch.float16).float()) and same(bf, every16.view(torch.bfloat16).float())


@pytest.mark.parametrize("norm", [{"layer_norm": {"normalized_shape": [64]}}, {"softmax": {"dim": 1}}])
def test_tiles_forms_take_16_byte_loads_in_16_bits(norm):
    """A layer norm over W, or a softmax over the channels, of a channels_last convolution output: the tiles
    forms read whole 16-byte vectors in 16 bits (8 values; 4 in float32)."""
    from conftest import CL_ATEN, spec_text

    text = spec_text([8, 4, 64], [{"conv2d": {"out_channels": 64, "kernel_size": 3, "padding": 1}}, norm], name="hf_tiles",
                     batch=5, plan=CL_ATEN)
    for dtype, vector in (("bfloat16", 8), ("float16", 8), ("float32", 4)):
        st = _families(text.replace("dtype: float32", f"dtype: {dtype}"), dtype).stages[-1]
        assert (st.schedule.form, st.schedule.vector) == ("tiles", vector), (dtype, st.schedule)
