"""conv_gemm in bfloat16 and float16: the generated convolution with 16-bit loads and stores on single TF32
products (every 16-bit value is exact in TF32: one product of two is exact, fp32 accumulation), the
accumulators rounded to the dtype before the epilogue (eager's 16-bit convolution output), the conv's
bias (16-bit plans keep it in the convolution) added to that and rounded again. Plans and the cost model here; the CPU build (ATen's
convolution in the dtype, then the epilogue stage's C++) validated against float64 and eager; the GPU
tests (marked cuda) run each form of conftest.CONV16 on the device. tests/test_ptxas.py compiles them."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from conftest import CONV16, HAS_CUDA, assert_report_passed, pipeline_of, render_specs
from kgen.families import conv_gemm
from kgen.plan import choose_plans, tuned_candidates
from kgen.target import DEFAULT

DTYPES_16 = ("bfloat16", "float16")


def _plan(text, dtype):
    (v,) = [v for v in choose_plans(pipeline_of(text), DEFAULT).variants if v.dtype == dtype]
    return v.plan


def _epilogue_kind(st):
    if st.epilogue is None:
        return "store"
    f = st.fused
    return "registers" if f.registers else "elementwise" if f.elementwise else "staged"


@pytest.mark.parametrize("name", sorted(CONV16))
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_each_form_plans_in_16_bits(name, dtype):
    text, loop, epilogue = CONV16[name]
    plan = _plan(text, dtype)
    st = plan.stages[0]
    assert st.family is conv_gemm.FAMILY and st.dtype == dtype
    assert (st.schedule.loop, _epilogue_kind(st)) == (loop, epilogue)
    assert st.schedule.mma == "tf32" and st.schedule.input_bytes == 2 and "exact for 16-bit operands" in st.x3_reason
    assert st.ops[0] in st.rounded  # the convolution's output is a rounding point (eager's 16-bit tensor)
    # the bias: the convolution's own (16-bit plans do not defer it), added by the kernel to its rounded output
    assert st.conv.conv.bias and not st.conv.bias_deferred
    said = "\n".join(st.family.explain_lines(st))
    assert f"{dtype} input loaded as stored" in said and f"stored as {dtype}" in said and "+ its bias (rounded again)" in said
    assert plan.to_json()["stages"][0]["schedule"]["input_bytes"] == 2


def test_float32_plans_keep_their_schedule_keys():
    """float32 plans are as they were: no input_bytes in plan.json, split TF32 where the rules ask for it."""
    text = CONV16["c16_window_pool"][0].replace("dtype:\n  - bfloat16\n  - float16", "dtype: float32")
    plan = _plan(text, "float32")
    assert "input_bytes" not in plan.to_json()["stages"][0]["schedule"]
    assert plan.stages[0].schedule.input_bytes == 4


def test_16_bit_stages_share_the_float32_shared_memory():
    """The mma.sync loops' 16-bit stages: two stages of the values as stored (half the floats each) and one
    fp32 buffer they are converted into (conv_gemm.cuh kRawStage): as much as float32's two stages. The
    generated kernel asserts that the plan covers it (tests/test_ptxas.py compiles them)."""
    text, _, _ = CONV16["c16_store_bias"]
    st16 = _plan(text, "bfloat16").stages[0]
    sc32 = dataclasses.replace(st16.schedule, input_bytes=4)
    p = st16.problems[0]
    assert conv_gemm.ConvGemm.smem_bytes(p, st16.schedule, True) == conv_gemm.ConvGemm.smem_bytes(p, sc32, True)
    sc3 = dataclasses.replace(sc32, stages=3)  # (with three stages the 16-bit ones are smaller)
    assert (conv_gemm.ConvGemm.smem_bytes(p, dataclasses.replace(sc3, input_bytes=2), False)
            < conv_gemm.ConvGemm.smem_bytes(p, sc3, False))


def test_cost_counts_the_values_at_2_bytes_and_the_products_at_the_tf32_rate():
    text, _, _ = CONV16["c16_store_bias"]
    st = _plan(text, "bfloat16").stages[0]
    batch = 64
    half = st.family.work(st, batch, DEFAULT)
    st.dtype = "float32"  # the same stage, counted as float32
    full = st.family.work(st, batch, DEFAULT)
    st.dtype = "bfloat16"
    values = batch * (st.in_type.sample_numel + st.out_type.sample_numel)
    assert sum(w.bytes for w in full) - sum(w.bytes for w in half) == 2 * values  # the weights stay fp32 (packed)
    assert [w.flops for w in half] == [w.flops for w in full]
    assert [w.flop_rate for w in half] == [w.flop_rate for w in full]  # the TF32 rate (not the 16-bit tensor cores')
    assert max(w.flop_rate for w in half) <= DEFAULT.tensor_flops


def test_the_float32_only_forms_decline_16_bits():
    """phase_pool, pool_ring (their kernels have no 16-bit loads yet) and the norm epilogues (the direct loop)."""
    why = conv_gemm.FAMILY._fused_pool_epilogue(SimpleNamespace(dtype="bfloat16"))
    assert why == "float32 only: its kernel has no bfloat16 loads yet"
    from conftest import SPECS

    path = next(p for p in SPECS if p.stem == "div_max_gap_bias_sum")
    text = path.read_text().replace("dtype: float32", "dtype: [float32, bfloat16]")
    pipe = pipeline_of(text, str(path))
    f32 = {c for p in tuned_candidates(pipe, DEFAULT)[0] for s in p.stages for c in s.candidates}
    b16 = {c for p in tuned_candidates(dataclasses.replace(pipe, dtype="bfloat16"), DEFAULT)[0] for s in p.stages for c in s.candidates}
    assert "conv_gemm:pool_ring" in f32 and "conv_gemm:pool_ring" not in b16 and "conv_gemm" in b16
    # a norm after the convolution: the convolution is written (no recompute / onepass candidates)
    norm = CONV16["c16_store_bias"][0].replace("ops:\n", "ops:\n").replace(
        "- conv2d:\n    out_channels: 8\n    kernel_size: 3\n", "- conv2d:\n    out_channels: 8\n    kernel_size: 3\n- instance_norm: {}\n")
    plan = _plan(norm, "bfloat16")
    assert [s.family.name for s in plan.stages] == ["conv_gemm", "norm"] and plan.stages[0].fused_norm is None
    assert plan.stages[0].candidates == ("conv_gemm",)


# ------------------------------------------------------------ the CPU build

CPU_FORMS = ("c16_window_pool", "c16_store_bias")  # the bias in the next stage, and in the convolution's own store


@pytest.fixture(scope="module")
def c16_cpu(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    root = tmp_path_factory.mktemp("conv16")
    rendered = render_specs(root, {n: CONV16[n][0] for n in CPU_FORMS})
    build_modules([d for _, d in rendered.values()], "cpu")
    return {n: (spec, d, import_module_dir(d)) for n, (spec, d) in rendered.items()}


@pytest.mark.parametrize("name", CPU_FORMS)
def test_cpu_build_validates_in_16_bits(c16_cpu, name):
    """kgen validate in each dtype (CPU: ATen's convolution in the dtype, then the epilogue stage's C++): against
    float64 on the rounded inputs, KernelBench's 1e-2 against eager in the dtype, NaN, inf and ties per stage."""
    from kgen.validate import validate

    spec, d, _ = c16_cpu[name]
    report = validate(spec, d, "cpu")
    assert_report_passed(report, name)
    for dtype in DTYPES_16:
        cases = [c.case for c in report.cases if c.dtype == dtype]
        assert any("vs eager" in c for c in cases), (dtype, cases)


def _eager(name, model, x):
    F = torch.nn.functional
    if name == "c16_window_pool":
        return F.max_pool2d(torch.relu(F.conv2d(x, model.conv.weight, model.conv.bias, padding=1)), 2).sum(1)
    return F.conv2d(x, model.conv.weight, model.conv.bias)


@pytest.mark.parametrize("name", CPU_FORMS)
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_cpu_build_matches_eager_with_inf_and_nan(c16_cpu, name, dtype):
    m = c16_cpu[name][2]
    dt = getattr(torch, dtype)
    torch.manual_seed(4)
    model = m.Model().to(dt)
    shape = [3] + list(pipeline_of(CONV16[name][0]).input.shape[1:])
    x = torch.randn(shape).to(dt)
    x[0, 0, 2, 3], x[1, 1, 4, 5], x[2, 0, 0, 0] = float("inf"), -float("inf"), float("nan")
    got, want = model(x), _eager(name, model, x)
    assert got.dtype == dt and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2, equal_nan=True)


# ------------------------------------------------------------ the GPU (the integrator's machine)


@pytest.fixture(scope="module")
def c16_cuda(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    root = tmp_path_factory.mktemp("conv16_cuda")
    rendered = render_specs(root, {n: t for n, (t, _, _) in CONV16.items()})
    build_modules([d for _, d in rendered.values()], "cuda")
    return {n: (spec, d, import_module_dir(d)) for n, (spec, d) in rendered.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(CONV16))
def test_cuda_validates_each_form_in_16_bits(c16_cuda, name):
    """Each form (window loop with a staged pool epilogue, the Store with the conv's bias and scalar loads, the
    generic loop, the register epilogue, the wgmma loop) in bfloat16 and float16 on the GPU: kgen validate's cases
    (float64 on the rounded inputs within the dtype's tolerance, KernelBench's 1e-2 against eager in the dtype,
    batches 1-3, NaN and inf, each stage fed +-inf, NaN, ties)."""
    from kgen.validate import validate

    spec, d, _ = c16_cuda[name]
    report = validate(spec, d, "cuda")
    assert_report_passed(report, name)
    for dtype in DTYPES_16:
        assert any("vs eager" in c.case for c in report.cases if c.dtype == dtype), (name, dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_cuda_against_float64_and_eager_odd_sizes_and_specials(c16_cuda, dtype):
    """The window loop's Store (c16_store_bias: W = 11, scalar loads; 9 rows: partial tiles) at batch 5 with
    inf, -inf and NaN in x and the weight, and an input at an odd offset (read from an aligned copy): NaN and inf
    where eager has them, the dtype's tolerance of float64 (products exact, fp32 accumulation, output rounded,
    then the bias added and rounded as eager), KernelBench's 1e-2 of eager."""
    from kgen.validate import DTYPE_TOLERANCES

    m = c16_cuda["c16_store_bias"][2]
    dt = getattr(torch, dtype)
    torch.manual_seed(5)
    model = m.Model().cuda().to(dt)
    atol, rtol = DTYPE_TOLERANCES[dtype]
    F = torch.nn.functional
    with torch.no_grad():
        model.conv.weight[2, 1, 1, 1] = float("inf")
        base = torch.randn(5 * 4 * 9 * 11 + 1, device="cuda").to(dt)
        x = base[1:].view(5, 4, 9, 11)  # 2 bytes past an aligned allocation
        x[0, 0, 3, 3], x[1, 2, 0, 10], x[4, 3, 8, 0] = float("nan"), float("inf"), -float("inf")
        got = model(x)
        eager = F.conv2d(x, model.conv.weight, model.conv.bias)
        w, b = model.conv.weight.double(), model.conv.bias.double()
        ref = (F.conv2d(x.double(), w).to(dt).double() + b.view(1, -1, 1, 1))  # eager's rounding point, then the bias
        assert got.dtype == dt and got.shape == eager.shape
        assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf())
        fin = ref.isfinite()
        assert torch.allclose(got.double()[fin], ref[fin], atol=atol, rtol=rtol)
        assert torch.allclose(got.float(), eager.float(), atol=1e-2, rtol=1e-2, equal_nan=True)
        # the weight again after an in-place update: repacked (kgen::WeightCache, the float32 copy)
        model.conv.weight.mul_(0.5)
        assert torch.allclose(model(x).float(), F.conv2d(x, model.conv.weight, model.conv.bias).float(),
                              atol=1e-2, rtol=1e-2, equal_nan=True)
