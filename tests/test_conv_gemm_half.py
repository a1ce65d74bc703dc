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

from conftest import CONV16, HAS_CUDA, POOL16, assert_report_passed, pipeline_of, render_specs
from kgen.families import conv_gemm
from kgen.plan import choose_plans
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
    """The generic loops' 16-bit kernel: its values at 2 bytes, its products at the TF32 rate (not the 16-bit tensor
    cores'), and its whole time (the weight pack aside) HALF_TIME_FACTOR times that, as measured."""
    text, _, _ = CONV16["c16_store_bias"]
    st = _plan(text, "bfloat16").stages[0]
    batch = 64
    half = st.family.work(st, batch, DEFAULT)
    st.dtype = "float32"  # the same stage, counted as float32
    full = st.family.work(st, batch, DEFAULT)
    st.dtype = "bfloat16"
    factor = conv_gemm.HALF_TIME_FACTOR
    assert half[0] == full[0] and half[0].what == "weight pack"
    values = batch * (st.in_type.sample_numel + st.out_type.sample_numel)
    # the weights stay fp32 (packed)
    assert sum(w.bytes for w in full[1:]) - sum(w.bytes for w in half[1:]) / factor == pytest.approx(2 * values)
    assert [w.flops for w in half] == [w.flops for w in full]
    assert [w.flop_rate * factor for w in half[1:]] == pytest.approx([w.flop_rate or DEFAULT.fp32_flops for w in full[1:]])
    assert max(w.flop_rate for w in half) * factor <= DEFAULT.tensor_flops


def test_the_norm_epilogues_decline_16_bits():
    """The norm epilogues (the direct loop has no 16-bit loads yet): a norm after the convolution reads it written."""
    norm = CONV16["c16_store_bias"][0].replace(
        "- conv2d:\n    out_channels: 8\n    kernel_size: 3\n", "- conv2d:\n    out_channels: 8\n    kernel_size: 3\n- instance_norm: {}\n")
    plan = _plan(norm, "bfloat16")
    # (the norm: the norm family's kernels, or the layer_norm family's where a group fits in registers)
    assert [s.family.name for s in plan.stages][0] == "conv_gemm" and plan.stages[1].family.name in ("norm", "layer_norm")
    assert len(plan.stages) == 2 and plan.stages[0].fused_norm is None
    assert plan.stages[0].candidates == ("conv_gemm",)


# ------------------------------------------------------------ phase_pool and pool_ring in 16 bits


@pytest.mark.parametrize("name", sorted(POOL16))
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_fused_pool_kernels_plan_in_16_bits(name, dtype):
    """Each form of conftest.POOL16: the cost model takes the kernel; the convolution output is a rounding point and
    keeps its bias (added by the kernel, rounded again); pool_ring's partial per channel where the reduction keeps them."""
    text, candidate, per_channel = POOL16[name]
    per_channel = per_channel[dtype] if isinstance(per_channel, dict) else per_channel
    plan = _plan(text, dtype)
    st = plan.stages[0]
    assert st.choice.startswith(candidate + ":"), st.choice
    assert st.epilogue is plan.stages[1] and plan.stages[1].absorbed_by is st
    assert st.ops[0] in st.rounded and st.conv.conv.bias and not st.conv.bias_deferred
    said = "\n".join(st.family.explain_lines(st))
    assert (f"{dtype} input loaded as stored" in said and "+ its bias (rounded again) into its epilogue" in said
            and f"stored as {dtype}" in said and "TF32 operands rounded" not in said), said
    stage_json = plan.to_json()["stages"][0]
    if per_channel is None:
        assert st.phase_pool is not None and st.pool_ring is None
    else:
        assert st.pool_ring.per_channel is per_channel and stage_json["pool_ring"].get("per_channel", False) is per_channel
        kept = plan.stages[1].out_type.sample_numel
        assert kept == (st.conv.conv.out_channels if per_channel else 1)


@pytest.mark.parametrize("spec,candidate", [("maxpool_sum", "conv_gemm:phase_pool"), ("div_max_gap_bias_sum", "conv_gemm:pool_ring")])
def test_shipped_specs_take_the_fused_pool_kernels_in_every_dtype(spec, candidate):
    """maxpool_sum (8 cuDNN phase convolutions in 16 bits before: 2.17 ms on an H200 against phase_pool's 0.71 in
    float32) and div_max_gap_bias_sum (the window loop: 0.51 ms against pool_ring's 0.32) in bfloat16 and float16 too;
    the estimates count the 16-bit input at 2 bytes, and phase_pool's 16-bit MMAs at the 16-bit tensor-core rate."""
    from conftest import SPECS

    path = next(p for p in SPECS if p.stem == spec)
    text = path.read_text().replace("dtype: float32", "dtype: [float32, bfloat16, float16]")
    sel = choose_plans(pipeline_of(text, str(path)), DEFAULT)
    assert sorted(v.dtype for v in sel.variants) == ["bfloat16", "float16", "float32"]
    for v in sel.variants:
        st = v.plan.stages[0]
        assert st.choice.startswith(candidate + ":"), (v.dtype, st.choice)
        if v.dtype == "float32":
            continue
        half = st.family.work(st, 16, DEFAULT)[-1]
        st.dtype = "float32"  # the same stage, counted as float32
        full = st.family.work(st, 16, DEFAULT)[-1]
        st.dtype = v.dtype
        rate = full.flop_rate * (DEFAULT.half_tensor_flops / DEFAULT.tensor_flops if candidate.endswith("phase_pool") else 1)
        assert half.bytes < 0.6 * full.bytes and half.flops == full.flops and half.flop_rate == pytest.approx(rate)


def test_pool_ring_reduction_forms():
    """pool_ring's epilogue: a 2 x 2 x 2 max pool, then a reduction of everything or of every spatial dim; a second
    reduction is the next stage's (not the epilogue's)."""
    from kgen.ir import Elementwise, Pool, Reduce

    pool = Pool("p", kind="max", kernel=(2, 2, 2), stride=(2, 2, 2), padding=(0, 0, 0), dilation=(1, 1, 1))
    pool3 = Pool("p", kind="max", kernel=(3, 3, 3), stride=(3, 3, 3), padding=(0, 0, 0), dilation=(1, 1, 1))
    form = conv_gemm._pool_ring_reduction
    assert form([pool, Reduce("r", fn="sum", dims=(1, 2, 3, 4))], 5) == "all"
    assert form([pool, Elementwise("e", fn="div", scalar=2.0), Reduce("r", fn="mean", dims=(2, 3, 4), kept=(2, 3, 4)),
                 Elementwise("e", fn="add", param="b"), Reduce("r", fn="sum", dims=(1,))], 5) == "spatial"
    assert form([pool, Reduce("r", fn="sum", dims=(1,))], 5) is None  # over the channels alone
    assert form([pool3, Reduce("r", fn="sum", dims=(1, 2, 3, 4))], 5) is None
    assert form([Reduce("r", fn="sum", dims=(2, 3, 4)), pool], 5) is None
    # the layout: a per-channel partial needs 16 floats of scratch per warp and step
    lc = _div_max_conv()
    whole, per = conv_gemm.pool_ring_layout(lc, (16, 64, 64), (7, 31, 31)), conv_gemm.pool_ring_layout(lc, (16, 64, 64), (7, 31, 31), True)
    assert per.smem_bytes - whole.smem_bytes == 4 * 2 * 4 * (16 - 1) and per.per_channel and not whole.per_channel


def _div_max_conv():
    """div_max_gap_bias_sum's convolution (8 -> 16, 3 x 3 x 3)."""
    from conftest import SPECS
    from kgen.lowering import lowered

    path = next(p for p in SPECS if p.stem == "div_max_gap_bias_sum")
    return lowered(pipeline_of(path.read_text(), str(path)).ops[0]).conv


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


# ------------------------------------------------------------ phase_pool and pool_ring on the GPU


@pytest.fixture(scope="module")
def pool16_cuda(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.ir import load_pipeline
    from kgen.validate import import_module_dir

    rendered = render_specs(tmp_path_factory.mktemp("pool16_cuda"), {n: t for n, (t, _, _) in POOL16.items()})
    build_modules([d for _, d in rendered.values()], "cuda")
    return {n: (spec, d, load_pipeline(str(spec)), import_module_dir(d)) for n, (spec, d) in rendered.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(POOL16))
def test_cuda_fused_pool_kernels_validate_in_16_bits(pool16_cuda, name):
    """kgen validate's cases in bfloat16 and float16 (float64 on the rounded inputs within the dtype's tolerance,
    KernelBench's 1e-2 against eager, batches 1-3, NaN and inf, each stage fed +-inf, NaN, ties); phase_pool also at
    batch 17, whose last round of tiles runs split (136 tiles on 132 SMs)."""
    from kgen.validate import validate

    spec, d, _, _ = pool16_cuda[name]
    assert_report_passed(validate(spec, d, "cuda"), name)
    if name == "pp16":
        assert_report_passed(validate(spec, d, "cuda", stages=False, batch=17), f"{name} at batch 17")


def _run16(pipe, module, dtype, x):
    """(kgen's output, eager's in the dtype, float64 on the same rounded input and parameters), on the GPU."""
    from kgen.reference import ReferenceModel

    torch.manual_seed(7)
    ref = ReferenceModel(pipe).eval()
    eager = ref.to(dtype).cuda()
    model = module.Model().to(dtype).cuda()
    model.load_state_dict(eager.state_dict())
    xd = x.to(dtype).cuda()
    with torch.no_grad():
        return model(xd).double().cpu(), eager(xd).double().cpu(), ref.double()(xd.double()).cpu()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(POOL16))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_pool_kernels_round_as_eager(pool16_cuda, name, dtype, request):
    """Random normal input with NaN, +inf and -inf: NaN and inf where eager has them; the finite values within
    two roundings of eager's in the dtype (the kernel's fp32 sums in another order may land a rounded intermediate
    on the other side of a tie) and within the dtype's tolerance of float64. Integer data (every product and sum
    exact, max pools full of ties; phase_pool): eager's values exactly."""
    from kgen.validate import DTYPE_TOLERANCES

    if name in ("ring16_channels", "ring16_per_channel") and dtype == torch.float16:
        # H200, cuDNN 9.19 (2026-12-01; reports/dtypes_h200.md, Known differences): eager's float16 conv3d
        # returns finite values at about half of the outputs an inf input reaches (154 of 324 where float64 has
        # inf; bfloat16 and the transposed convolution keep all), so eager's result here is finite where kgen's
        # and float64's are inf. kgen keeps IEEE arithmetic's inf.
        request.node.add_marker(pytest.mark.xfail(strict=True, reason="eager's float16 cuDNN convolution drops an inf input"))

    _, _, pipe, m = pool16_cuda[name]
    eps = torch.finfo(dtype).eps
    atol, rtol = DTYPE_TOLERANCES[str(dtype).removeprefix("torch.")]
    torch.manual_seed(3)
    x = torch.randn(5, *pipe.input.shape[1:])
    x[1, 0, 1, 2, 3], x[2, 3, 2, 0, 5], x[3, 7, 0, 4, 1] = float("nan"), float("inf"), -float("inf")
    y, want, exact = _run16(pipe, m, dtype, x)
    assert y.shape == want.shape
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf()), (y, want)
    assert torch.equal(y[y.isinf()], want[want.isinf()])
    fin = want.isfinite()
    assert fin[0].all() and fin[4].all()  # (the samples without specials)
    scale = want[fin].abs().max().item()
    assert (y[fin] - want[fin]).abs().max().item() <= 2 * eps * scale, (y, want)
    ok = exact.isfinite() & fin
    assert torch.allclose(y[ok], exact[ok], atol=atol, rtol=rtol)
    if name == "pp16":  # integer data: products and sums exact in fp32, the bias an integer too
        xi = torch.randint(-2, 3, (3, *pipe.input.shape[1:])).float()
        from kgen.reference import ReferenceModel

        ref = ReferenceModel(pipe).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randint(-2, 3, p.shape).float())
        eager = ref.to(dtype).cuda()
        model = m.Model().to(dtype).cuda()
        model.load_state_dict(eager.state_dict())
        with torch.no_grad():
            got, ties = model(xi.to(dtype).cuda()), eager(xi.to(dtype).cuda())
        assert torch.equal(got, ties)
