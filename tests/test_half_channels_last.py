"""A convolution run by ATen (conv_aten) writes channels_last in bfloat16 and float16 plans too: cuDNN's
tensor-core convolutions are NHWC, so an NC[D]HW call converts its input and output around the call
(conv_aten.NCHW_CONVERSION). The generated input copy moves the storage type (a copy of 16-bit values is
exact), the next stage reads the channels_last buffer (norm: statistics by rows, apply by transpose;
pool_reduce), and the cost model chooses the layout. The TF32 rules (eager_rounding_only, fp32_products)
are float32's: cuDNN multiplies 16-bit operands exactly in every form.

Planning (no build), the CPU build's numerics against eager in the dtype and float64, the kernel compiled
for sm_90a (nvcc), and the CUDA build on a GPU (marked cuda)."""
import re
import shutil

import pytest
import torch

from conftest import CL_ATEN, ROOT, pipeline_of, render_specs, spec_text
from kgen.build import cuda_home

HALF = ("bfloat16", "float16")
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def motivating(dtypes="[float32, bfloat16, float16]", extra="", intermediates="\nintermediates: float32") -> str:
    """specs/relu_group_norm.yaml (a stride-1 ConvTranspose3d 64 -> 128, ReLU, GroupNorm) with a dtype list and
    float32 intermediates: with eager's rounding points the norm keeps eager's own transposed call (rewrites:
    sub-pixel phases sum in another order), here the sub-pixel form (one forward call) is a candidate too."""
    text = (ROOT / "specs" / "relu_group_norm.yaml").read_text()
    text = re.sub(r"^name: relu_group_norm$", "name: rgn_dt" + intermediates + extra, text, flags=re.M)
    return re.sub(r"^(\s+)dtype: float32$", rf"\1dtype: {dtypes}", text, flags=re.M)


def half(shape, ops, name, plan=CL_ATEN, batch=3) -> str:
    return spec_text(shape, ops, name=name, batch=batch, plan=plan).replace("dtype: float32", "dtype: [bfloat16, float16]")


CONV2 = {"conv2d": {"out_channels": 16, "kernel_size": 3, "padding": 1}}
# group norm over 4 channels x 288 positions (above a warp's group: the row kernels); a 3-d transposed
# convolution at stride 1 (one sub-pixel phase, channels_last) before it; a max pool and an average pool
# with a channel sum (pool_reduce's transposing tile and its reduction over channels_last rows)
NORM_OPS = [CONV2, "relu", {"group_norm": {"num_groups": 4}}]
T3_OPS = [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3}}, "relu", {"group_norm": {"num_groups": 4}}]
POOL_OPS = [CONV2, "relu", {"max_pool2d": {"kernel_size": 2}}]
AVG_OPS = [CONV2, {"avg_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}]
CASES = {"hcl_norm": ([8, 16, 18], NORM_OPS), "hcl_t3": ([8, 6, 7, 8], T3_OPS),
         "hcl_pool": ([8, 16, 16], POOL_OPS), "hcl_avg": ([8, 16, 16], AVG_OPS)}


# ------------------------------------------------------------ planning


@pytest.mark.parametrize("dtype", HALF)
def test_16_bit_plan_offers_and_picks_channels_last(dtype):
    """The motivating case: in 16 bits the sub-pixel convolution's stage offers both layouts, and channels_last
    (no NCHW conversions around cuDNN's call, a generated input copy in the dtype, the norm's row kernels) is the
    cheaper by the model. (The cheapest plan of all is cuDNN's transposed call as written: its 16-bit rate, measured
    on the H200, conv_aten.TRANSPOSED16_STRIDE1_EFFICIENCY.)"""
    from dataclasses import replace

    from kgen.cost import estimate_ms
    from kgen.plan import candidate_plans

    pipe = pipeline_of(motivating())
    batch = pipe.example_batch()
    phased = [p for p in candidate_plans(replace(pipe, dtype=dtype)) if not p.eager and p.stages[0].phases]
    by_layout = {p.stages[0].layout: estimate_ms(p, batch) for p in phased}
    assert set(by_layout) == {"channels_last", "contiguous"} and by_layout["channels_last"] < by_layout["contiguous"], by_layout
    conv, norm = min(phased, key=lambda p: estimate_ms(p, batch)).stages
    assert conv.family.name == "conv_aten" and conv.layout == "channels_last"
    assert conv.family.input_copy(conv) == "kernel" and not conv.fp32_products
    assert (norm.schedule.stats_by, norm.schedule.apply_by) == ("rows", "transpose")
    # the NC[D]HW form pays cuDNN's conversions; the channels_last form the generated copy at 2 bytes a value
    target = phased[0].target
    works = {layout: [w.what for w in conv.family.work(conv.family.make_stage(_request(pipe, dtype), layout), batch, target)]
             for layout in ("channels_last", "contiguous")}
    assert works["channels_last"][0] == "input copy" and not any("NCHW" in w for w in works["channels_last"])
    assert any("NCHW to NHWC" in w for w in works["contiguous"])


def _request(pipe, dtype):
    """The conv stage's request of the chosen 16-bit plan (to make its stage in either layout)."""
    from dataclasses import replace

    from kgen import families
    from kgen.buffer import flat_buffer
    from kgen.plan import make_plan

    plan = make_plan(replace(pipe, dtype=dtype))
    st, nxt = plan.stages[0], plan.stages[1]
    return families.StageRequest(0, list(st.ops), (st.in_type, st.out_type), flat_buffer(st.in_type), nxt.family, plan.pipeline,
                                 plan.target, plan.batch, start=0)


@pytest.mark.parametrize("dtype", HALF)
def test_16_bit_bias_is_deferred_where_nothing_amplifies_it(dtype):
    """plan.defer_conv_bias in 16 bits: a decision per convolution (kept first). Before an elementwise tail the
    model takes the deferral with cuDNN's call (ATen's separate bias pass priced, conv_aten.BIAS16_PASS): the next
    stage adds the bias to the rounded output and rounds again; conv_gemm declines a deferred 16-bit bias. Before a
    norm the decision is offered too: the next stage's add is CUDA's only (Elementwise.cuda_only, under
    __CUDA_ARCH__) and ATen's CPU call keeps the bias, so each build rounds as eager does on its device; and
    before a pool (the stage adds it to each value before it pools them), where conv_gemm's choice keeps it."""
    from dataclasses import replace

    from kgen.plan import DEFER_BIAS, OFF, ON, choose_plans, make_plan, rewrite_key

    # KernelBench #1's kind (64 -> 128 channels, k3, 64 x 64): cuDNN's call is the model's choice
    tail = spec_text([64, 64, 64], [{"conv2d": {"out_channels": 128, "kernel_size": 3}}, "relu", {"mul": {"scalar": 2.0}}],
                     batch=32).replace("dtype: float32", f"dtype: {dtype}")
    (v,) = choose_plans(pipeline_of(tail)).variants
    conv, nxt = v.plan.stages
    key = rewrite_key(DEFER_BIAS, "ops[0].conv2d")
    assert v.plan.choices[key] == ON and v.plan.options[key] == (OFF, ON)
    assert conv.family.name == "conv_aten" and conv.conv.bias_deferred
    assert nxt.ops[0].key == "ops[0].conv2d.bias" and nxt.ops[0] in nxt.rounded
    assert not any("bias (ATen's add)" in w.what for w in conv.family.work(conv, 32, v.plan.target))
    kept = make_plan(replace(pipeline_of(tail), dtype=dtype), choices={key: OFF, "implementation @ ops[0].conv2d": "conv_aten:channels_last"})
    assert not kept.stages[0].conv.bias_deferred
    assert any("bias (ATen's add)" in w.what for w in kept.stages[0].family.work(kept.stages[0], 32, kept.target))
    deferred = make_plan(replace(pipeline_of(tail), dtype=dtype), choices={key: ON, "implementation @ ops[0].conv2d": "conv_gemm"})
    assert deferred.stages[0].family.name != "conv_gemm"  # conv_gemm declines: the first family that takes it
    normed = spec_text([64, 64, 64], [{"conv2d": {"out_channels": 128, "kernel_size": 3}}, "relu", {"group_norm": {"num_groups": 8}}],
                       batch=32).replace("dtype: float32", f"dtype: {dtype}")
    (v,) = choose_plans(pipeline_of(normed)).variants
    assert v.plan.options[key] == (OFF, ON)
    deferred = make_plan(replace(pipeline_of(normed), dtype=dtype), choices={key: ON})
    conv, nxt = deferred.stages[:2]
    assert conv.family.name == "conv_aten" and conv.conv.bias_deferred and nxt.ops[0].cuda_only
    assert not any(o.cuda_only for o in v.plan.pipeline.ops if hasattr(o, "cuda_only")) or v.plan.stages[0].conv.bias_deferred
    pooled = spec_text([64, 64, 64], [{"conv2d": {"out_channels": 128, "kernel_size": 3}}, "relu", {"max_pool2d": {"kernel_size": 2}}],
                       batch=32).replace("dtype: float32", f"dtype: {dtype}")
    (v,) = choose_plans(pipeline_of(pooled)).variants
    assert v.plan.options[key] == (OFF, ON)
    assert v.plan.stages[0].conv.bias_deferred == (v.plan.stages[0].family.name == "conv_aten")
    deferred = make_plan(replace(pipeline_of(pooled), dtype=dtype), choices={key: ON})
    conv, nxt = deferred.stages[:2]
    assert conv.family.name == "conv_aten" and conv.conv.bias_deferred and nxt.ops[0].cuda_only
    assert [o.op_name for o in nxt.ops] == ["add", "relu", "max_pool2d"]


DEFERRED_BEFORE_NORMS_AND_POOLS = {
    "dfb_group_norm": [{"conv2d": {"out_channels": 8, "kernel_size": 3}}, {"group_norm": {"num_groups": 2}}, "relu"],
    "dfb_layer_norm": [{"conv2d": {"out_channels": 6, "kernel_size": 3, "padding": 1}}, {"layer_norm": {"normalized_shape": [9]}}],
    "dfb_max_pool": [{"conv2d": {"out_channels": 8, "kernel_size": 3}}, "tanh", {"max_pool2d": {"kernel_size": 2}}],
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", sorted(DEFERRED_BEFORE_NORMS_AND_POOLS))
def test_16_bit_bias_deferred_before_a_norm_or_pool_validates(name, device, tmp_path):
    """A 16-bit convolution's bias deferred into the norm or pool stage after it (cuDNN's channels_last call): on CUDA the
    stage adds it to the rounded output and rounds again, as ATen's CUDA call; on the CPU ATen's call adds it inside
    (as eager's) and the stage's add is compiled out: each build against the float64 reference, eager in the dtype
    at 1e-2, and stage by stage (the stage's own reference skips the add where the build does). One module holds
    both dtypes' plans (one build); validate checks each dtype's cases."""
    from dataclasses import replace

    from conftest import assert_report_passed, write_spec
    from kgen.build import build_module
    from kgen.ir import load_pipeline
    from kgen.plan import DEFER_BIAS, ON, Selection, Variant, make_plan, rewrite_key
    from kgen.render import render_plan, write_rendered
    from kgen.validate import validate

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module = f"{name}_{device}"
    text = spec_text([3, 7, 9], DEFERRED_BEFORE_NORMS_AND_POOLS[name], batch=5, name=module, plan=CL_ATEN)
    spec = write_spec(tmp_path, text.replace("dtype: float32", f"dtype: [{', '.join(HALF)}]"), f"{module}.yaml")
    pipe = load_pipeline(spec)
    variants = []
    for dtype in HALF:
        plan = make_plan(replace(pipe, dtype=dtype), choices={rewrite_key(DEFER_BIAS, "ops[0].conv2d"): ON})
        conv, norm = plan.stages
        assert conv.conv.bias_deferred and conv.conv.bias_deferred_on_cuda and norm.ops[0].cuda_only, dtype
        variants.append(Variant(plan, why="pinned by the test", dtype=dtype))
    sel = Selection(pipe, variants, "pinned by the test", candidates=[v.plan for v in variants])
    write_rendered(render_plan(sel, tmp_path / "gen"), tmp_path / "gen")
    source = (tmp_path / "gen" / module / "stages.h").read_text()
    assert "#ifdef __CUDA_ARCH__" in source and "is_cuda() ?" in (tmp_path / "gen" / module / "binding.cpp").read_text()
    build_module(tmp_path / "gen" / module, device, quiet=True)
    report = validate(spec, tmp_path / "gen" / module, device, selection=sel)
    assert {c.dtype for c in report.cases} == set(HALF), {c.dtype for c in report.cases}
    assert_report_passed(report, module)


def test_tf32_layout_rules_are_float32s():
    """A forward convolution with TF32 products before a group norm is eager's own call in float32 where no
    generated copy can round its input as that call does (eager_rounding_only: cuDNN's TF32 ties); in 16 bits
    its products are exact in every form, so both layouts are candidates. A small convolution in channels_last gets TF32 off in float32 (fp32_products)
    and nothing in 16 bits."""
    from kgen.plan import choose_plans

    large = [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, {"group_norm": {"num_groups": 4}}]
    # (300 input channels: ATen copies them into channels_last, and nothing rounds them as eager's call would)
    text = spec_text([300, 20, 20], large, name="tf", plan={"conv": "aten"}).replace("dtype: float32", "dtype: [float32, bfloat16, float16]")
    for v in choose_plans(pipeline_of(text)).variants:
        st = v.plan.stages[0]
        want = {"conv_aten:contiguous"} if v.dtype == "float32" else {"conv_aten:channels_last", "conv_aten:contiguous"}
        assert set(st.candidates) == want and not st.eager_rounding, v.dtype
    small = spec_text([8, 40, 40], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, "relu"], name="sm", plan=CL_ATEN)
    small = small.replace("dtype: float32", "dtype: [float32, bfloat16]")
    fp32 = {v.dtype: v.plan.stages[0].fp32_products for v in choose_plans(pipeline_of(small)).variants}
    assert "no sum or mean" in fp32["float32"] and fp32["bfloat16"] == ""


def test_16_bit_stages_after_a_channels_last_convolution():
    """What reads a 16-bit channels_last output: the norm's row kernels, pool_reduce, another ATen
    convolution (the tensor as it is), and at the end pool_reduce's copy into NC[D]HW."""
    from kgen.plan import choose_plans

    conv2 = {"conv2d": {"out_channels": 8, "kernel_size": 3, "name": "conv2"}}
    texts = {"norm": half([8, 16, 18], NORM_OPS, "a"), "pool": half([8, 16, 16], POOL_OPS, "b"),
             "conv": half([8, 9, 10], [CONV2, conv2, "relu"], "c"), "alone": half([8, 9, 10], [CONV2], "d")}
    for what, text in texts.items():
        for v in choose_plans(pipeline_of(text)).variants:
            st = v.plan.stages
            assert st[0].layout == "channels_last" and st[1].input.layout == "channels_last", (what, v.dtype)
            names = [s.family.name for s in st]
            assert names == {"norm": ["conv_aten", "norm"], "pool": ["conv_aten", "pool_reduce"],
                             "conv": ["conv_aten", "conv_aten", "pool_reduce"],
                             "alone": ["conv_aten", "pool_reduce"]}[what], (what, names)
            if what == "norm":
                assert st[1].schedule.stats_by == "rows"
            if what == "conv":  # the second convolution reads the first one's channels_last tensor as it is
                assert st[1].family.input_copy(st[1]) is None


def test_float32_copy_kernel_is_unchanged_and_16_bit_moves_the_storage_type(tmp_path):
    """The rendered input copy: float's code as before (float pointers, 0.f), the 16-bit plans' over
    kgen::bfloat16 / kgen::float16 (no conversion to float), the binding's pointers typed by the dtype."""
    (_, d), = render_specs(tmp_path, {"rgn_dt": motivating(extra="\nplan: {conv_layout: channels_last}")}).values()
    kernel, binding = (d / "kernel.cu").read_text(), (d / "binding.cpp").read_text()
    shipped = (ROOT / "generated" / "relu_group_norm" / "kernel.cu").read_text()
    body = lambda text, ns: text.split(f"namespace {ns} {{")[1].split("namespace s1")[0]  # noqa: E731
    assert body(kernel, "v0").split("// ==== stage 1")[0] == body(shipped, "v0").split("// ==== stage 1")[0]
    for v, t, at in (("v1", "kgen::bfloat16", "at::kBFloat16"), ("v2", "kgen::float16", "at::kHalf")):
        copy = body(kernel, v)
        assert f"to_channels_last_kernel(const {t}* __restrict__ x, {t}* __restrict__ y" in copy
        assert f"__shared__ {t} tile" in copy and f"{t} v[kPerThread]" in copy and not re.search(r"\bfloat\b", copy.split("to_channels_last_kernel")[1])
        assert f"s0::to_channels_last(kgen::data_as<{t}>(x, {at}), kgen::data_as<{t}>(y, {at})" in binding


# ------------------------------------------------------------ numerics (CPU build)


@pytest.fixture(scope="module")
def cl_modules(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.ir import load_pipeline
    from kgen.validate import import_module_dir

    rendered = render_specs(tmp_path_factory.mktemp("half_cl"), {n: half(s, o, n) for n, (s, o) in CASES.items()})
    build_modules([d for _, d in rendered.values()], "cpu")
    return {n: (load_pipeline(str(spec)), import_module_dir(d)) for n, (spec, d) in rendered.items()}


def run(pipe, module, dtype, x, device="cpu"):
    """(kgen's output, eager's in the same dtype, float64 on the same rounded inputs and parameters) for x."""
    from kgen.reference import ReferenceModel

    ref = ReferenceModel(pipe).eval()
    eager = ref.to(device=device, dtype=dtype)
    model = module.Model().to(device=device, dtype=dtype)
    model.load_state_dict(eager.state_dict())
    xd = x.to(device=device, dtype=dtype)
    with torch.no_grad():
        return model(xd).double().cpu(), eager(xd).double().cpu(), ref.double()(xd.double()).cpu()


def check(y, want, exact, dtype, what):
    """kgen's output against eager's in the dtype: NaN where eager's is, KernelBench's 1e-2, and as far
    from float64 as eager's is, give or take a unit of the dtype at the output's scale (cuDNN's
    channels_last accumulation order may round a convolution value the other way)."""
    assert torch.equal(y.isnan(), want.isnan()), what
    ok = ~want.isnan()
    y, want, exact = y[ok], want[ok], exact[ok]
    assert torch.allclose(y, want, atol=1e-2, rtol=1e-2), (what, (y - want).abs().max().item())
    unit = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
    assert (y - exact).abs().max().item() <= (want - exact).abs().max().item() + 2 * unit, what


def inputs(shape, seed):
    """Random normal data, then the same with a NaN and ties (equal values: a max pool's and a norm's)."""
    torch.manual_seed(seed)
    x = torch.randn(4, *shape)
    adversarial = x.clone()
    adversarial[1, 2].fill_(0.5)  # a constant plane: equal values everywhere the kernel reads it
    adversarial[2, 0].view(-1)[5] = float("nan")  # spreads through the convolution (and the norm's group)
    return [("normal", x), ("adversarial", adversarial)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(CASES))
def test_channels_last_16_bit_plan_matches_eager(cl_modules, name, dtype):
    pipe, m = cl_modules[name]
    for seed in range(2):
        for what, x in inputs(CASES[name][0], seed):
            check(*run(pipe, m, TORCH[dtype], x), TORCH[dtype], (name, seed, what))


def test_the_cpu_modules_run_channels_last(cl_modules):
    """The cases are what they stand for: channels_last convolution outputs read by the fused stage."""
    from kgen.plan import choose_plans

    for name, (pipe, _) in cl_modules.items():
        for v in choose_plans(pipe).variants:
            assert v.plan.stages[0].layout == "channels_last" and v.plan.stages[1].input.layout == "channels_last", name
            if name in ("hcl_norm", "hcl_t3"):
                assert v.plan.stages[1].schedule.stats_by == "rows", name


# ------------------------------------------------------------ nvcc


@pytest.mark.skipif(cuda_home() is None and shutil.which("nvcc") is None, reason="needs nvcc")
def test_16_bit_input_copy_compiles_without_spills(tmp_path):
    """The copy kernel of each dtype (2-d and 3-d, odd channel counts, a narrowed input) compiles clean for sm_90a."""
    from kgen.build import demangle, ptxas_report

    texts = {"hcl_px3": half([3, 37, 41], [{"conv2d": {"out_channels": 16, "kernel_size": 3}}, {"group_norm": {"num_groups": 4}}], "hcl_px3"),
             "hcl_px33": half([33, 5, 7, 9], [{"conv3d": {"out_channels": 8, "kernel_size": 3, "padding": 1}}, "relu"], "hcl_px33")}
    for name, (_, d) in render_specs(tmp_path, texts).items():
        kernels = ptxas_report(d, "9.0a")
        names = [demangle(k.name) for k in kernels]
        for t in ("bfloat16", "float16"):
            assert sum(f"to_channels_last_kernel(kgen::{t} const*, kgen::{t}*" in n for n in names) == 1, names
        assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


# ------------------------------------------------------------ the GPU


@pytest.fixture(scope="module")
def gpu_modules(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.ir import load_pipeline
    from kgen.validate import import_module_dir

    texts = {f"{n}_gpu": half(s, o, f"{n}_gpu") for n, (s, o) in CASES.items()}
    texts["rgn_gpu"] = motivating("[bfloat16, float16]", intermediates="").replace("name: rgn_dt", "name: rgn_gpu")
    rendered = render_specs(tmp_path_factory.mktemp("half_cl_gpu"), texts)
    build_modules([d for _, d in rendered.values()], "cuda")
    return {n: (load_pipeline(str(spec)), import_module_dir(d)) for n, (spec, d) in rendered.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(CASES))
def test_channels_last_16_bit_plan_matches_eager_on_the_gpu(gpu_modules, name, dtype):
    """The CUDA build: the generated 16-bit input copy (a contiguous input), ATen's (a channels_last input), cuDNN's
    channels_last convolution and the fused stage, against eager CUDA in the dtype and float64."""
    pipe, m = gpu_modules[f"{name}_gpu"]
    shape = CASES[name][0]
    fmt = torch.channels_last if len(shape) == 3 else torch.channels_last_3d
    for seed in range(2):
        for what, x in inputs(shape, seed):
            check(*run(pipe, m, TORCH[dtype], x, "cuda"), TORCH[dtype], (name, seed, what))
        torch.manual_seed(seed)
        x = torch.randn(4, *shape).contiguous(memory_format=fmt)
        check(*run(pipe, m, TORCH[dtype], x, "cuda"), TORCH[dtype], (name, seed, "channels_last input"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", HALF)
def test_motivating_case_matches_eager_on_the_gpu(gpu_modules, dtype):
    """specs/relu_group_norm.yaml in 16 bits at batch 2 (eager's rounding points: cuDNN's ConvTranspose3d 64 -> 128 on
    32^3 as written, then the norm) against eager CUDA in the dtype and float64."""
    pipe, m = gpu_modules["rgn_gpu"]
    torch.manual_seed(0)
    x = torch.randn(2, *pipe.input.shape[1:])
    check(*run(pipe, m, TORCH[dtype], x, "cuda"), TORCH[dtype], ("rgn", dtype))
