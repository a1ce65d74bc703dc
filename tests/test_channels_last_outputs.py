"""pool_reduce:channels_last: an elementwise stage that reads a channels_last convolution output and feeds a
next stage can write channels_last itself, value by value in the input's memory order, so that a next
channels_last convolution (cuDNN's tensor-core layout) reads it without a copy. The plan chooses: the cost
model prices the copy the next convolution makes of an NC[D]HW input, and the copy a stage's binding makes of a
channels_last value it reads as a plain tensor (kgen.cost.relayout_copies)."""
import shutil

import pytest
import torch

from conftest import CL_ATEN, assert_report_passed, pipeline_of, spec_text, write_spec
from kgen.build import cuda_home

CHANNEL_SCALE = {"s": {"shape": [12, 1, 1], "init": "randn"}}
# (input shape, ops, params): convolutions pinned to cuDNN's channels_last calls (the spec's plan: CL_ATEN);
# odd channel counts and sizes; a per-channel parameter (its channel read from the memory order)
CASES = {
    "clo_2d": ([5, 9, 11], [{"conv2d": {"out_channels": 12, "kernel_size": 3, "padding": 1}}, {"mul": {"param": "s"}},
                            "relu", {"conv2d": {"out_channels": 7, "kernel_size": 3, "name": "conv2"}}], CHANNEL_SCALE),
    "clo_3d": ([3, 5, 6, 7], [{"conv3d": {"out_channels": 6, "kernel_size": 3, "padding": 1}}, {"add": {"scalar": 0.5}},
                              "tanh", {"conv3d": {"out_channels": 5, "kernel_size": 2, "name": "conv2"}}], None),
}
# a value named after the elementwise stage and read again by a later stage as a plain tensor (a residual)
RESIDUAL = ([8, 7, 9], [{"conv2d": {"out_channels": 8, "kernel_size": 3, "padding": 1}}, {"relu": {"as": "h"}},
                        {"conv2d": {"out_channels": 8, "kernel_size": 3, "padding": 1, "name": "conv2"}}, {"add": {"tensor": "h"}},
                        "tanh"])
CL = "pool_reduce:channels_last"


def _text(name, dtypes="float32", suffix=""):
    shape, ops, params = CASES[name]
    return spec_text(shape, ops, params=params, name=name + suffix, batch=3, plan=CL_ATEN).replace(
        "dtype: float32", f"dtype: {dtypes}")


def _elementwise_stage(plan):
    """The first elementwise stage (the one between the convolutions)."""
    return next(s for s in plan.stages if s.family.name == "pool_reduce" and s.ops)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_stage_offers_both_outputs_and_the_model_takes_channels_last(name):
    from kgen.plan import choose_plans, make_plan

    pipe = pipeline_of(_text(name))
    plan = choose_plans(pipe).plans[0]
    st = _elementwise_stage(plan)
    assert st.candidates == ("pool_reduce", CL) and st.choice.startswith(CL)
    assert st.output.layout == "channels_last" and st.output.dense and st.schedule.transpose_channels == 0
    assert st.schedule.kept_walk[-1] == 1  # the walk is the memory order: channels innermost
    nxt = plan.stages[st.index + 1]
    assert nxt.input == st.output and nxt.family.input_copy(nxt) is None  # read as it lies
    # the NC[D]HW alternative: the next convolution copies its input into channels_last
    flat = make_plan(pipe, choices={f"implementation @ {st.ops[0].key}": "pool_reduce"})
    fst = _elementwise_stage(flat)
    assert fst.output.flat
    assert flat.stages[fst.index + 1].family.input_copy(flat.stages[fst.index + 1]) == "kernel"
    # the last stage writes the plain NC[D]HW output: never offered there
    assert not any(c.endswith(":channels_last") for s in plan.stages[st.index + 1:] for c in s.candidates
                   if c.startswith("pool_reduce"))


def test_a_channels_last_value_read_as_a_tensor_costs_its_copy():
    from kgen.cost import estimate, relayout_copies
    from kgen.plan import make_plan

    shape, ops = RESIDUAL
    pipe = pipeline_of(spec_text(shape, ops, name="clo_res", batch=3, plan=CL_ATEN))
    key = f"implementation @ {pipe.ops[0].key}.bias"  # the stage starts with the convolution's deferred bias
    cl, flat = (make_plan(pipe, choices={key: c}) for c in (CL, "pool_reduce"))
    assert _elementwise_stage(cl).output.layout == "channels_last"
    reader = cl.stages[-1]  # the add of h (and tanh): h is t1, channels_last
    (copy,) = relayout_copies(cl, reader, 3)
    assert copy.bytes == 2 * 4 * 3 * 8 * 7 * 9 and "t1" in copy.what
    assert relayout_copies(flat, flat.stages[-1], 3) == []
    assert any(w is not None and w.what == copy.what for e in estimate(cl, 3) for w in e.work)


def _render_and_validate(tmp_path, texts, device, selection_of=None):
    from kgen.build import build_modules
    from kgen.render import render_plan, render_spec, write_rendered
    from kgen.validate import validate

    gen = tmp_path / "gen"
    made = {}
    for name, text in texts.items():
        spec = write_spec(tmp_path, text, f"{name}.yaml")
        sel = selection_of(spec) if selection_of else None
        write_rendered(render_plan(sel, gen) if sel else render_spec(spec, gen), gen)
        made[name] = (spec, gen / name, sel)
    build_modules([d for _, d, _ in made.values()], device)
    for name, (spec, module_dir, sel) in made.items():
        assert_report_passed(validate(spec, module_dir, device, selection=sel, example_batch=True), name)


def _residual_selection(spec):
    from kgen.ir import load_pipeline
    from kgen.plan import Selection, Variant, make_plan

    pipe = load_pipeline(spec)
    why = "pinned by the test: the channels_last output read again as a plain tensor"
    plan = make_plan(pipe, choices={f"implementation @ {pipe.ops[0].key}.bias": CL}, reason=why)
    assert _elementwise_stage(plan).output.layout == "channels_last"
    return Selection(pipe, [Variant(plan, why=why)], why, candidates=[plan])


@pytest.mark.slow
def test_cpu_build_matches_the_reference(tmp_path):
    """Both cases in each dtype (the memory-order walk and the per-channel parameter), and the residual read of a
    channels_last output (its `.contiguous()` copy), against float64 and eager. (bfloat16 since the CPU build runs
    each ATen convolution as eager's contiguous call: ATen's channels_last bfloat16 convolution on an AVX512-BF16
    CPU put NaN where the NC[D]HW reference has none, clo_2d's NaN case at 21 places.)"""
    texts = {n: _text(n, "[float32, bfloat16, float16]") for n in CASES}
    _render_and_validate(tmp_path, texts, "cpu")
    shape, ops = RESIDUAL
    _render_and_validate(tmp_path, {"clo_res": spec_text(shape, ops, name="clo_res", batch=3, plan=CL_ATEN)}, "cpu",
                         _residual_selection)


@pytest.mark.cuda
def test_cuda_build_matches_the_reference(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # named apart from the CPU test's modules: a process loads one module of a name (on a GPU machine both run)
    texts = {n + "_gpu": _text(n, "[float32, bfloat16, float16]", "_gpu") for n in CASES}
    _render_and_validate(tmp_path, texts, "cuda")
    shape, ops = RESIDUAL
    _render_and_validate(tmp_path, {"clo_res_gpu": spec_text(shape, ops, name="clo_res_gpu", batch=3, plan=CL_ATEN)},
                         "cuda", _residual_selection)


@pytest.mark.skipif(cuda_home() is None and shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_map_kernel_stores_in_memory_order_and_compiles_clean(tmp_path):
    from kgen.build import demangle, ptxas_report
    from kgen.render import render_spec, write_rendered

    spec = write_spec(tmp_path, _text("clo_3d", "[float32, bfloat16]"), "clo_3d.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    src = (tmp_path / "gen" / "clo_3d" / "kernel.cu").read_text()
    assert src.count("if (j < total) a.out[j] = v[u];") == 2  # one stage per dtype
    kernels = ptxas_report(tmp_path / "gen" / "clo_3d", "9.0a")
    assert any("map_kernel" in demangle(k.name) for k in kernels)
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]
