"""A sum, mean or average pool over a matrix product's output features, computed as the product with its
weight's rows summed (rewrites.pool_into_linear, lowering.PooledProduct, kgen_runtime.h's window_sums):
rendered, built and validated against the float64 reference of the pipeline as written, on the CPU build and
(GPU tests) the CUDA one.

KernelBench's cases in small: #14 (matmul with a transposed parameter, a factor, a sum over the features),
#51 (linear, a per-feature subtraction, a mean, a residual add of the input), #98 (linear, reshape, avg_pool1d
over the features, reshape, gelu, a factor, a max) and a matmul with an [in, out] parameter whose columns sum."""
import pytest

from conftest import BUILD_DEVICES, build_and_validate, pipeline_of, render_specs, spec_text
from kgen.lowering import PooledProduct
from kgen.plan import make_plan

SPECS = {
    "pl_sum": spec_text([40], [{"matmul": {"param": "weight", "transpose": True}}, {"div": {"scalar": 2.0}},
                               {"sum": {"dim": 1, "keepdim": True}}, {"mul": {"scalar": 1.5}}],
                        params={"weight": {"shape": [24, 40], "init": "randn"}}, name="pl_sum"),
    "pl_mean": spec_text([33], [{"linear": {"out_features": 20}}, {"sub": {"param": "shift"}},
                                {"mean": {"dim": 1, "keepdim": True}}, {"logsumexp": {"dim": 1, "keepdim": True}},
                                {"gelu": {"as": "g"}}, {"add": {"tensor": "g", "from": "x"}}],
                         params={"shift": {"shape": [20], "init": "randn"}}, name="pl_mean"),
    # 96 >= cexpr.HOST_SUM_MIN subtracted values: their sum is the binding's (once per call), not each thread's
    "pl_mean_wide": spec_text([40], [{"linear": {"out_features": 96}}, {"sub": {"param": "shift"}},
                                     {"mean": {"dim": 1, "keepdim": True}}, "tanh"],
                              params={"shift": {"shape": [96], "init": "randn"}}, name="pl_mean_wide"),
    "pl_pool": spec_text([48], [{"linear": {"out_features": 64}}, {"reshape": {"shape": [1, 64]}},
                                {"avg_pool1d": {"kernel_size": 16}}, {"reshape": {"shape": [4]}}, "gelu",
                                {"mul": {"scalar": 2.0}}, {"max": {"dim": 1}}], name="pl_pool"),
    "pl_columns": spec_text([5, 12], [{"matmul": {"param": "w"}}, {"mean": {"dim": -1, "keepdim": True}}, "tanh"],
                            params={"w": {"shape": [12, 9], "init": "randn"}}, name="pl_columns"),
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return render_specs(tmp_path_factory.mktemp("pl"), SPECS)


def test_plans_sum_the_weight(rendered):
    for name, (spec, d) in rendered.items():
        st = make_plan(pipeline_of(spec.read_text())).stages[0]
        assert isinstance(st.ops[0], PooledProduct) and st.family.name == "linear_aten", name
        assert "kgen::window_sums(" in (d / "binding.cpp").read_text(), name
    binding = (rendered["pl_mean_wide"][1] / "binding.cpp").read_text()
    assert "const at::Tensor sum_shift = shift_c.sum();" in binding
    assert "const at::Tensor sum_shift" not in (rendered["pl_mean"][1] / "binding.cpp").read_text()  # 20 values: summed inline

@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_builds_validate(rendered, device):
    build_and_validate(rendered, device)
