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

from conftest import BUILD_DEVICES, HAS_CUDA, build_and_validate, pipeline_of, render_specs, spec_text
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
