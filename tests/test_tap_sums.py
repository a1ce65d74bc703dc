"""A sum or mean over spatial dims of a convolution, computed as a convolution of the input's per-tap sums
(rewrites.sum_before_conv, lowering.TapSums, kgen_runtime.h's tap_sum_convolution): rendered, built and
validated against the float64 reference of the pipeline as written, on the CPU build and (GPU tests) the CUDA one.

KernelBench's cases in small: #42 (a transposed 2-d convolution, a global mean: a matrix product of the sums),
#13 (a transposed 3-d convolution, a mean over depth only, padding 1: a 2-d transposed convolution of the
depth sums), a forward 1-d one with dilation, summed over its only dim after a factor, and a strided transposed
3-d one summed over every dim. Summed over every dim, the CUDA build sums the input in a generated kernel
(conv_aten.TapSumKernel: a block per plane, doubles per segment of the taps' ranges)."""
import pytest

from conftest import BUILD_DEVICES, build_and_validate, pipeline_of, render_specs, spec_text
from kgen.lowering import TapSums
from kgen.plan import make_plan

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
    "ts_3d": spec_text([3, 5, 6, 8], [{"conv_transpose3d": {"out_channels": 4, "kernel_size": 3, "stride": 2, "padding": 1,
                                                            "output_padding": 1}},
                                      {"mean": {"dim": [2, 3, 4], "keepdim": True}}, "gelu"], name="ts_3d", plan=ATEN),
}
ALL_SUMMED = ("ts_global", "ts_forward", "ts_3d")  # the generated tap-sum kernel's cases


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return render_specs(tmp_path_factory.mktemp("ts"), SPECS)


def test_plans_sum_the_input_first(rendered):
    for name, (spec, d) in rendered.items():
        st = make_plan(pipeline_of(spec.read_text())).stages[0]
        assert isinstance(st.conv.lowering, TapSums) and st.family.name == "conv_aten", name
        assert st.fp32_products, name  # the sums' convolution runs with TF32 off
        assert "kgen::tap_sum_convolution(" in (d / "binding.cpp").read_text(), name
        assert ("tap_sums_kernel" in (d / "kernel.cu").read_text()) == (name in ALL_SUMMED), name


def test_tap_sum_kernel_geometry():
    """ts_3d (transposed k3 s2 p1, output_padding 1): tap 0 of each dim reads inputs [1, L), taps 1 and 2 all of
    them, so every dim cuts into [0, 1) and [1, L): 8 segment boxes; a tap's run is segment 1, or both."""
    from kgen.families.conv_aten import TapSumKernel

    st = make_plan(pipeline_of(SPECS["ts_3d"])).stages[0]
    k = TapSumKernel.of(st.conv, st.in_type.spatial)
    assert k.segments == (((0, 1), (1, 5)), ((0, 1), (1, 6)), ((0, 1), (1, 8)))
    assert k.runs == (((1, 2), (0, 2), (0, 2)),) * 3 and k.count == 8 and k.taps == 27
    assert len(k.row_boxes()) == 4


def test_cost_model_counts_the_tap_sums_calls():
    """Summed over every dim (ts_global), the input's tap sums are the generated kernel's one launch; summed over
    depth only (ts_depth: k3 p1 over D = 6, taps reading [1, 6), [0, 6), [0, 5)), ATen's calls: 3 segment sums and
    their cat, a sum per tap over its run of 2, 3 and 2 segments, the taps' cat, and 4 around the convolution."""
    from kgen.target import DEFAULT

    st = make_plan(pipeline_of(SPECS["ts_global"]), target=DEFAULT).stages[0]
    (sums,) = [w for w in st.family.work(st, 2, DEFAULT) if w.what == "tap sums"]
    assert sums.launches == 1 and sums.bytes == 4 * 2 * 6 * 13 * 11  # the generated kernel
    st = make_plan(pipeline_of(SPECS["ts_depth"]), target=DEFAULT).stages[0]
    (sums,) = [w for w in st.family.work(st, 2, DEFAULT) if w.what == "tap sums"]
    assert sums.launches == st.conv.lowering.aten_calls(st.conv.conv, st.in_type.spatial) == 12


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_builds_validate(rendered, device):
    build_and_validate(rendered, device)
