"""The linear_gemm family: nn.Linear / matmul with a parameter as a generated split-TF32 GEMM on Hopper's
warpgroup MMAs, with the elementwise stage after it as its epilogue (templates/linear_gemm/).

Plans (where the family takes a product, where it declines, the epilogue it absorbs) on the CPU; the CPU
build (ATen's product, then the epilogue stage's own code) and the CUDA build validated against the float64
reference of the spec, with KernelBench-style shapes in small: M, N and K not multiples of the 128 x 128 x 32
tiles, K from 16 up, a matmul operand [K, N] and its transpose, no bias, values named in the epilogue
(swish), inputs of rank 3 and 4 (the GEMM's rows: all but the last dim), and a product whose next stage reads
it (softmax) rather than absorbing it."""
import pytest
import torch

from conftest import BUILD_DEVICES, HAS_CUDA, assert_report_passed, build_and_validate, pipeline_of, render_specs, spec_text, write_spec
from kgen.build import build_modules
from kgen.plan import make_plan
from kgen.target import DEFAULT

GEMM = {"linear": "gemm"}
SPECS = {
    "lg_relu": spec_text([200], [{"linear": {"out_features": 150}}, {"sub": {"scalar": 2.0}}, {"mul": {"scalar": 1.5}}, "relu"],
                         name="lg_relu", batch=70, plan=GEMM),
    "lg_swish": spec_text([64], [{"matmul": {"param": "w", "as": "m"}}, "sigmoid", {"mul": {"tensor": "m"}}, {"mul": {"scalar": 2.0}}],
                          params={"w": {"shape": [64, 90], "init": "randn"}}, name="lg_swish", batch=33, plan=GEMM),
    "lg_transposed": spec_text([300], [{"matmul": {"param": "w", "transpose": True}}, {"add": {"param": "b"}}, "tanh"],
                               params={"w": {"shape": [257, 300], "init": "randn"}, "b": {"shape": [257], "init": "randn"}},
                               name="lg_transposed", batch=129, plan=GEMM),
    "lg_short_k": spec_text([16], [{"linear": {"out_features": 8, "bias": False}}, "gelu"], name="lg_short_k", batch=5, plan=GEMM),
    "lg_softmax": spec_text([1030], [{"linear": {"out_features": 384}}, {"softmax": {"dim": 1}}], name="lg_softmax", batch=200,
                            plan=GEMM),
    "lg_alone": spec_text([96], [{"linear": {"out_features": 40}}], name="lg_alone", batch=3, plan=GEMM),
    "lg_rows": spec_text([5, 48], [{"linear": {"out_features": 40}}, {"add": {"param": "b"}}, "gelu"],
                         params={"b": {"shape": [40], "init": "randn"}}, name="lg_rows", batch=7, plan=GEMM),
    "lg_rows4": spec_text([2, 3, 36], [{"linear": {"out_features": 20, "as": "y"}}, "sigmoid", {"mul": {"tensor": "y"}}],
                          name="lg_rows4", batch=4, plan=GEMM),
}


def families(plan):
    return [s.family.name for s in plan.stages]


def test_plans_take_the_product_and_its_epilogue():
    for name, text in SPECS.items():
        plan = make_plan(pipeline_of(text), target=DEFAULT)
        st = plan.stages[0]
        assert st.family.name == "linear_gemm", name
        fused = name not in ("lg_softmax", "lg_alone")
        assert (st.epilogue is not None) == fused, name
        if fused:
            assert families(plan) == ["linear_gemm", "pool_reduce"] and plan.stages[1].absorbed_by is st, name


def test_padded_rows_and_operand_layouts():
    """K padded to whole 16-byte rows for TMA; a matmul operand [K, N] is transposed into rows when split."""
    st = make_plan(pipeline_of(SPECS["lg_transposed"]), target=DEFAULT).stages[0]
    assert (st.n, st.k, st.kp) == (257, 300, 300) and st.weight_nk("w") == "w"
    st = make_plan(pipeline_of(SPECS["lg_swish"]), target=DEFAULT).stages[0]
    assert (st.n, st.k, st.kp) == (90, 64, 64) and st.weight_nk("w") == "w.t().contiguous()"
    st = make_plan(pipeline_of(spec_text([30], [{"linear": {"out_features": 5}}], plan=GEMM)), target=DEFAULT).stages[0]
    assert st.kp == 32


def test_declines_short_k_to_cublas():
    plan = make_plan(pipeline_of(spec_text([8], [{"linear": {"out_features": 32}}, "relu"])), target=DEFAULT)
    assert plan.stages[0].family.name == "linear_aten" and "K = 8 < 16" in plan.stages[0].choice


def test_declines_weights_whose_planes_crowd_the_device_memory():
    """The kept TF32 planes take 2x the weight: a 32768 x 32768 weight's (8.6 GB) fit an 80 GB device's
    quarter, not a 24 GB device's."""
    from dataclasses import replace

    text = spec_text([32768], [{"linear": {"out_features": 32768}}, "relu"])
    assert make_plan(pipeline_of(text), target=DEFAULT).stages[0].family.name == "linear_gemm"
    small = make_plan(pipeline_of(text), target=replace(DEFAULT, memory_bytes=24_000_000_000)).stages[0]
    assert small.family.name == "linear_aten" and "TF32 planes (8.6 GB" in small.choice and "24 GB" in small.choice


def test_rows_of_higher_rank_inputs():
    """An input [N, 2, 3, 36]: 6 GEMM rows per sample; the epilogue gets each row's (2, 3) position back."""
    st = make_plan(pipeline_of(SPECS["lg_rows4"]), target=DEFAULT).stages[0]
    assert (st.rows_per_sample, st.row_dims, st.k, st.n) == (6, (2, 3), 36, 20)


def test_targets_without_warpgroup_mma_keep_cublas():
    from dataclasses import replace

    plan = make_plan(pipeline_of(spec_text([256], [{"linear": {"out_features": 64}}, "relu"])), target=replace(DEFAULT, wgmma=False))
    assert families(plan) == ["linear_aten", "pool_reduce"] and "warpgroup MMA" in plan.stages[0].choice


def test_plan_linear_pins_the_implementation():
    text = spec_text([256], [{"linear": {"out_features": 64}}, "relu"], plan={"linear": "aten"})
    assert families(make_plan(pipeline_of(text), target=DEFAULT)) == ["linear_aten", "pool_reduce"]
    assert "eager" not in str(make_plan(pipeline_of(text), target=DEFAULT).options)


def test_cublas_linear_without_a_bias_renders_builds_and_validates(tmp_path):
    """linear_aten's call of a linear with bias=False (a transformer's projections) names no bias tensor."""
    text = spec_text([24], [{"linear": {"out_features": 16, "bias": False}}, "gelu"], plan={"linear": "aten"}, name="nobias")
    rendered = render_specs(tmp_path, {"nobias": text})
    assert "std::nullopt" in (rendered["nobias"][1] / "binding.cpp").read_text()
    build_and_validate(rendered, "cpu")


def test_cost_model_prefers_it_at_kernelbench_sizes():
    """KernelBench #9's 1024 x 8192 x 8192 product: ~1.1 ms in split TF32 (lab gemm_lab in docs/performance.md) against cuBLAS's ~2.7."""
    from kgen.plan import candidate_plans
    from kgen.cost import estimate_ms

    text = spec_text([8192], [{"linear": {"out_features": 8192}}, {"sub": {"scalar": 2.0}}, "relu"], batch=1024)
    pipe = pipeline_of(text)
    by_family = {p.stages[0].family.name: estimate_ms(p, 1024) for p in candidate_plans(pipe, target=DEFAULT)
                 if p.stages and p.stages[0].family.name.startswith("linear")}
    assert 0.8 < by_family["linear_gemm"] < 1.6 < by_family["linear_aten"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return render_specs(tmp_path_factory.mktemp("lg"), SPECS)


def test_rendered_kernels(rendered):
    for name, (spec, d) in rendered.items():
        cu = (d / "kernel.cu").read_text()
        assert "kgen::linear_gemm::gemm(" in cu, name
        assert ("Fused{a}" in cu) == (name not in ("lg_softmax", "lg_alone")), name


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_builds_validate(rendered, device):
    build_and_validate(rendered, device)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_error_is_fp32_level(rendered):
    """Against float64, the split-TF32 product's max error is at most 2x cuBLAS's fp32 one (the lab: 0.16-0.25x)
    at K = 1030, and the weight planes are re-split when the weight changes in place (an optimizer step)."""
    from kgen.validate import import_module_dir

    spec, d = rendered["lg_softmax"]
    build_modules([d], "cuda")
    mod = import_module_dir(d)  # the module validate loaded (its custom op is registered once per process)
    torch.manual_seed(0)
    model = mod.Model().cuda()
    x = torch.randn(200, 1030, device="cuda")
    with torch.no_grad():
        for step in range(2):
            w, b = model.linear.weight, model.linear.bias
            ref = torch.softmax(torch.nn.functional.linear(x.double(), w.double(), b.double()), dim=1)
            torch.backends.cuda.matmul.allow_tf32 = False
            eager = torch.softmax(torch.nn.functional.linear(x, w, b), dim=1)
            got = model(x)
            kgen_err = (got.double() - ref).abs().max().item()
            eager_err = (eager.double() - ref).abs().max().item()
            assert kgen_err <= 2 * eager_err + 1e-9, (step, kgen_err, eager_err)
            w.mul_(-0.5)  # in place: the version counter moves, the cached planes must follow


# ---------------------------------------------------------------- bfloat16 and float16

DTYPES_16 = ("bfloat16", "float16")


def half_text(text: str, dtypes=DTYPES_16) -> str:
    """A spec_text spec with the dtype list ``dtypes`` (spec_text writes float32)."""
    assert "dtype: float32" in text
    return text.replace("dtype: float32", f"dtype: [{', '.join(dtypes)}]")


# KernelBench-style shapes in small (M = batch x rows, N and K as the products have them): M and N not multiples
# of the 128 x 128 tile, K a multiple of 8 (16-byte rows) but not of a 64-value k-block, a bias, a [K, N] matmul
# operand (its rows kept transposed), rows of a rank-3 input, and a product alone (no epilogue).
SPECS_16 = {
    "lg16_relu": half_text(spec_text([256], [{"linear": {"out_features": 512}}, "relu", {"mul": {"scalar": 1.5}}], name="lg16_relu",
                                     batch=64)),
    "lg16_odd": half_text(spec_text([72], [{"linear": {"out_features": 200}}, {"sub": {"scalar": 0.5}}, "gelu"], name="lg16_odd",
                                    batch=130, plan=GEMM)),
    "lg16_swish": half_text(spec_text([40], [{"matmul": {"param": "w", "as": "m"}}, "sigmoid", {"mul": {"tensor": "m"}}],
                                      params={"w": {"shape": [40, 136], "init": "randn"}}, name="lg16_swish", batch=33, plan=GEMM)),
    "lg16_rows": half_text(spec_text([3, 24], [{"linear": {"out_features": 20}}, {"add": {"param": "b"}}, "tanh"],
                                     params={"b": {"shape": [20], "init": "randn"}}, name="lg16_rows", batch=5, plan=GEMM)),
    "lg16_alone": half_text(spec_text([48], [{"linear": {"out_features": 24, "bias": False}}], name="lg16_alone", batch=3, plan=GEMM)),
}


def plan_for(text: str, dtype: str, target=DEFAULT):
    from kgen.plan import choose_plans

    (v,) = [v for v in choose_plans(pipeline_of(text), target).variants if v.dtype == dtype]
    return v.plan


@pytest.mark.parametrize("dtype", DTYPES_16)
def test_16_bit_plans_take_it_on_hopper_only(dtype):
    """The cost model picks the generated product with its epilogue for the 256 -> 512 product (one launch where
    cuBLAS and the elementwise stage take two); a target without wgmma never offers it."""
    from dataclasses import replace

    text = SPECS_16["lg16_relu"]
    plan = plan_for(text, dtype)
    st = plan.stages[0]
    assert families(plan) == ["linear_gemm", "pool_reduce"] and st.epilogue is plan.stages[1], st.choice
    assert st.candidates == ("linear_gemm", "linear_aten") and "cost model" in st.choice
    assert st.product in st.rounded  # the product's output is a rounding point, as cuBLAS's 16-bit output
    old = plan_for(text, dtype, replace(DEFAULT, wgmma=False))
    assert families(old) == ["linear_aten", "pool_reduce"] and "warpgroup MMA" in old.stages[0].choice


def test_16_bit_prices_the_16_bit_tensor_rate():
    """One launch, x, W and the output moved once in 2 bytes a value, FLOPs at the target's 16-bit tensor rate;
    at KernelBench #9's 1024 x 8192 x 8192 (compute-bound) cuBLAS's assumed higher rate keeps ATen's product."""
    from kgen.cost import estimate_ms
    from kgen.families.linear_gemm import FAMILY, GEMM16_FRACTION
    from kgen.plan import candidate_plans

    st = plan_for(SPECS_16["lg16_relu"], "bfloat16").stages[0]
    (w,) = FAMILY.work(st, 64, DEFAULT)
    assert w.launches == 1 and w.flop_rate == DEFAULT.half_tensor_flops * GEMM16_FRACTION
    assert w.bytes == 2 * (64 * 256 + 512 * 256 + 64 * 512)
    text = half_text(spec_text([8192], [{"linear": {"out_features": 8192}}, {"sub": {"scalar": 2.0}}, "relu"], batch=1024), ("bfloat16",))
    by_family = {p.stages[0].family.name: estimate_ms(p, 1024) for p in candidate_plans(pipeline_of(text), target=DEFAULT)
                 if p.stages and p.stages[0].family.name.startswith("linear")}
    assert 0.3 < by_family["linear_gemm"] < 0.5 and by_family["linear_aten"] < by_family["linear_gemm"], by_family
    assert families(plan_for(text, "bfloat16")) == ["linear_aten", "pool_reduce"]


def test_16_bit_declines_k_not_whole_16_byte_rows():
    """TMA reads the operands in place, in 16-byte rows: K = 300 (600 bytes) keeps ATen's product in 16 bits;
    float32 pads its TF32 planes and takes it."""
    text = spec_text([300], [{"linear": {"out_features": 64}}, "relu"], plan=GEMM)
    assert families(make_plan(pipeline_of(text), target=DEFAULT)) == ["linear_gemm", "pool_reduce"]
    st = plan_for(half_text(text.replace("plan:\n  linear: gemm\n", "")), "float16").stages[0]
    assert st.family.name == "linear_aten" and "K = 300 is not a multiple of 8" in st.choice


@pytest.fixture(scope="module")
def rendered16(tmp_path_factory):
    return render_specs(tmp_path_factory.mktemp("lg16"), SPECS_16)


def test_rendered_16_bit_kernels(rendered16, rendered):
    """16-bit plans call the 16-bit GEMM (gemm16: no split, no workspace, no fixup) and round the product where the
    plan rounds it; float32 plans keep the split-TF32 one."""
    for name, (spec, d) in rendered16.items():
        cu, binding = (d / "kernel.cu").read_text(), (d / "binding.cpp").read_text()
        assert cu.count("kgen::linear_gemm::gemm16(") >= 2 and "kgen::linear_gemm::gemm(" not in cu, name  # once per dtype
        assert "split_weight" not in cu and "workspace" not in binding, name
        assert ("Fused{a}" in cu) == (name != "lg16_alone"), name
        fused = name != "lg16_alone"
        for t in ("bfloat16", "float16"):
            assert (f"v = kgen::round_to_in_32_bit_registers<kgen::{t}>(v);  // ops[0]" in cu) == fused, (name, t)
    assert "stage0_weights().derived" in (rendered16["lg16_swish"][1] / "binding.cpp").read_text()  # [K, N]: rows kept
    for name, (spec, d) in rendered.items():
        cu = (d / "kernel.cu").read_text()
        assert "kgen::linear_gemm::gemm(" in cu and "gemm16" not in cu and "round_to" not in cu, name
    header = (next(iter(rendered16.values()))[1].parent / "linear_gemm" / "gemm3xtf32.cuh").read_text()
    for form in ("m64n128k16.f32.bf16.bf16", "m64n128k16.f32.f16.f16", "m64n128k8.f32.tf32.tf32"):
        assert f"wgmma.mma_async.sync.aligned.{form} " in header


def test_16_bit_intermediates_float32_keep_the_product_in_fp32(tmp_path):
    """`intermediates: float32`: the product's value goes to the epilogue unrounded (fp32 until the stage's output)."""
    from kgen.render import render_spec, write_rendered

    text = SPECS_16["lg16_relu"] + "intermediates: float32\n"
    assert not plan_for(text, "bfloat16").stages[0].rounded
    spec = write_spec(tmp_path, text.replace("lg16_relu", "lg16_fp32"), "lg16_fp32.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    cu = (tmp_path / "gen" / "lg16_fp32" / "kernel.cu").read_text()
    assert "kgen::linear_gemm::gemm16(" in cu and "round_to" not in cu


@pytest.mark.slow  # the 16-bit dtypes (five more CPU builds); test_builds_validate keeps the float32 ones in the CPU set
@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_16_bit_builds_validate(rendered16, device):
    """kgen validate in each dtype: the float64 reference with 16-bit tolerances, KernelBench's 1e-2 check against
    eager in the dtype, NaN, +-inf and ties fed to each stage (CPU: ATen's product in the dtype, then the epilogue)."""
    from kgen.validate import validate

    build_modules([d for _, d in rendered16.values()], device)
    for name, (spec, d) in rendered16.items():
        report = validate(spec, d, device)
        assert_report_passed(report, name)
        for dtype in DTYPES_16:
            cases = [c.case for c in report.cases if c.dtype == dtype]
            assert any("vs eager" in c for c in cases), (name, dtype, cases)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES_16)
def test_cuda_16_bit_against_float64_and_eager(rendered16, dtype):
    """The 16-bit GEMM on the GPU over odd shapes (M = 130 x 1 and 7 x 1, N = 200, K = 72: partial tiles and a
    partial k-block) with inf, -inf and NaN in x and the weight: within the dtype's tolerance of float64 on the
    16-bit operands, within KernelBench's 1e-2 of eager in the dtype, and NaN and +-inf exactly where eager has them;
    a misaligned input (a view at an odd offset) is copied, not misread."""
    from kgen.validate import DTYPE_TOLERANCES, import_module_dir

    spec, d = rendered16["lg16_odd"]
    build_modules([d], "cuda")
    mod = import_module_dir(d)
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model = mod.Model().cuda().to(dt)
    w, b = model.linear.weight, model.linear.bias
    atol, rtol = DTYPE_TOLERANCES[dtype]
    with torch.no_grad():
        w[3, 5] = float("inf")  # column 3: +-inf or NaN in every row
        for rows in (130, 7):
            base = torch.randn(rows * 72 + 1, device="cuda").to(dt)
            x = base[1:].view(rows, 72)  # 2 bytes past an aligned allocation: TMA needs a copy
            x[1, 0], x[2, 7], x[4, 71] = float("nan"), float("inf"), -float("inf")
            got = model(x)

            def tail(y):  # the epilogue in float64: - 0.5, then gelu
                return torch.nn.functional.gelu(y - 0.5)

            ref = tail(torch.nn.functional.linear(x.double(), w.double(), b.double()))
            eager = tail(torch.nn.functional.linear(x, w, b))
            assert got.dtype == dt and got.shape == (rows, 200)
            assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf()), rows
            assert torch.equal(got.isnan(), ref.isnan()), rows
            fin = ref.isfinite()
            assert torch.allclose(got.double()[fin], ref[fin], atol=atol, rtol=rtol), rows
            assert torch.allclose(got.float(), eager.float(), atol=1e-2, rtol=1e-2, equal_nan=True), rows
