"""A sum or mean over spatial dims of a convolution, computed as a convolution of the input's per-tap sums
(rewrites.sum_before_conv, lowering.TapSums, kgen_runtime.h's tap_sum_convolution): rendered, built and
validated against the float64 reference of the pipeline as written, on the CPU build and (GPU tests) the CUDA one.

KernelBench's cases in small: #42 (a transposed 2-d convolution, a global mean: a matrix product of the sums),
#13 (a transposed 3-d convolution, a mean over depth only, padding 1: a 2-d transposed convolution of the
depth sums), and a forward 1-d one with dilation, summed over its only dim after a factor."""
import pytest

from conftest import HAS_CUDA, assert_report_passed, pipeline_of, render_specs, spec_text
from kgen.build import build_modules
from kgen.lowering import TapSums
from kgen.plan import make_plan
from kgen.validate import validate

ATEN = {"conv": "aten"}  # pinned: at these small sizes the cost model prefers eager's one convolution to the ~20 calls
SPECS = {
    "ts_global": spec_text([6, 13, 11], [{"conv_transpose2d": {"out_channels": 7, "kernel_size": 3}},
                                         {"mean": {"dim": [2, 3], "keepdim": True}}, {"add": {"param": "shift"}},
                                         {"logsumexp": {"dim": 1, "keepdim": True}}],
                           params={"shift": {"shape": [7, 1, 1], "init": "randn"}}, name="ts_global", plan=ATEN),
    "ts_depth": spec_text([5, 6, 9, 10], [{"conv_transpose3d": {"out_channels": 8, "kernel_size": 3, "padding": 1}},
                                          {"mean": {"dim": 2, "keepdim": True}}, {"softmax": {"dim": 1}}, "tanh"],
                          name="ts_depth", plan=ATEN),
    "ts_forward": spec_text([3, 40], [{"conv1d": {"out_channels": 4, "kernel_size": 3, "padding": 2, "dilation": 2}},
                                      {"mul": {"scalar": 0.25}}, {"sum": {"dim": 2, "keepdim": True}}, "sigmoid"],
                            name="ts_forward", plan=ATEN),
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return render_specs(tmp_path_factory.mktemp("ts"), SPECS)


def test_plans_sum_the_input_first(rendered):
    for name, (spec, d) in rendered.items():
        st = make_plan(pipeline_of(spec.read_text())).stages[0]
        assert isinstance(st.conv.lowering, TapSums) and st.family.name == "conv_aten", name
        assert st.fp32_products, name  # the sums' convolution runs with TF32 off
        assert "kgen::tap_sum_convolution(" in (d / "binding.cpp").read_text(), name


def test_cost_model_counts_the_tap_sums_calls():
    """ts_global (a transposed k3 convolution, stride 1, no padding: every tap reads the whole input): per summed dim
    one segment sum, a zero and an add per tap and a cat (8 calls), twice, and 4 around the product."""
    from kgen.target import DEFAULT

    st = make_plan(pipeline_of(SPECS["ts_global"]), target=DEFAULT).stages[0]
    (sums,) = [w for w in st.family.work(st, 2, DEFAULT) if w.what == "tap sums"]
    assert sums.launches == 20 and sums.bytes == 4 * 2 * 6 * 13 * 11


def _build_and_validate(rendered, device):
    build_modules([d for _, d in rendered.values()], device)
    for name, (spec, d) in rendered.items():
        assert_report_passed(validate(spec, d, device), name)


def test_cpu_builds_validate(rendered):
    _build_and_validate(rendered, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_builds_validate(rendered):
    _build_and_validate(rendered, "cuda")
