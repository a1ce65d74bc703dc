"""Concatenation without a copy: a cat's operand whose stage can write a channel slice (a pool_reduce stage, on its
own or as a generated convolution's epilogue) and that nothing else reads is written straight into its slice of the
cat's output; the cat copies only the other operands (an input, a value read twice). The plan's choices, the cost
model's price of the cat, and the built modules (poisoned outputs: an element no stage wrote fails) on the CPU and,
marked cuda, on the GPU."""
import pytest
import torch

from conftest import BUILD_DEVICES, assert_report_passed, pipeline_of, render_specs
from test_graph import CAT
from kgen import cost
from kgen.explain import explain_text
from kgen.plan import make_plan
from kgen.stage import ChannelSlice
from kgen.target import DEFAULT

# two pools of one value, concatenated (test_graph's cat of branches: each pool's stage writes its slice)
POOLS = CAT.replace("name: g_cat", "name: cc_pools")

# SqueezeNet's fire module: two expand convolutions of one squeezed value, each with its ReLU, concatenated; odd
# channel counts and positions (the samples of a slice start at no whole vector)
FIRE = """
name: cc_fire_{conv}
input: {{shape: [N, 3, 5, 5], dtype: [float32, bfloat16], example: {{N: 2}}}}
plan: {{conv: {conv}}}
ops:
  - conv2d: {{out_channels: 4, kernel_size: 1, name: squeeze}}
  - relu: {{as: s}}
  - conv2d: {{out_channels: 3, kernel_size: 1, name: expand1x1}}
  - relu: {{as: e1}}
  - conv2d: {{out_channels: 5, kernel_size: 3, padding: 1, name: expand3x3, from: s}}
  - relu: {{as: e3}}
  - cat: {{tensors: [e3], dim: 1, from: e1}}
"""

# DenseNet's layer: the input itself is an operand (copied), the new features are written in place
DENSE = """
name: cc_dense
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - relu
  - conv2d: {out_channels: 3, kernel_size: 3, padding: 1, as: f}
  - cat: {tensors: [f], dim: 1, from: x}
  - avg_pool2d: {kernel_size: 2}
"""

# p is also an output of the graph: its stage writes it as a tensor of its own, and the cat copies it
READ_TWICE = (POOLS.replace("name: cc_pools", "name: cc_read_twice").replace("dim: 1}", "dim: 1, as: y}")
              .replace("  - mul: {scalar: 0.5}\n", "") + "outputs: [y, p]\n")


def _plan(text):
    return make_plan(pipeline_of(text), target=DEFAULT)


def _cat(plan):
    return next(s for s in plan.stages if s.ops and s.ops[0].op_name == "cat")


def _cat_work(plan):
    return next(e for e in cost.estimate(plan, 8) if e.stage is _cat(plan)).work


def test_each_pool_writes_its_slice_and_the_cat_costs_nothing():
    plan = _plan(POOLS)
    cat = _cat(plan)
    assert cat.in_place == (0, 1)
    avg, mx = plan.writer_of(cat.source), plan.writer_of(plan.value_exprs["p"])
    assert avg.into == ChannelSlice(cat.index, 0, cat.out_type) and mx.into == ChannelSlice(cat.index, 4, cat.out_type)
    assert mx.out_sample == avg.out_sample == 8 * 3 * 3  # a sample of the cat's output
    assert sum(w.bytes for w in _cat_work(plan)) == 0 and sum(w.launches for w in _cat_work(plan)) == 0
    assert plan.to_json()["stages"][cat.index]["operands_in_place"] == [0, 1]


@pytest.mark.parametrize("conv", ["gemm", "aten"])
def test_the_fire_modules_expand_convolutions_write_their_slices(conv):
    text = FIRE.format(conv=conv)
    plan = _plan(text)
    cat = _cat(plan)
    assert cat.in_place == (0, 1)
    writers = [plan.writer_of(cat.source), plan.writer_of(plan.value_exprs["e3"])]
    assert [w.family.name for w in writers] == ["pool_reduce", "pool_reduce"]
    assert [w.into.channel0 for w in writers] == [0, 3]
    if conv == "gemm":  # the ReLU is the convolution's epilogue: the convolution's kernel writes the slice
        assert all(w.absorbed_by is not None and w.absorbed_by.family.name == "conv_gemm" for w in writers)
    text = explain_text(pipeline_of(text), batch=8)
    assert "writes its output into channels 3..7 of stage" in text and "copies nothing" in text


def test_an_input_operand_is_copied_into_its_slice():
    plan = _plan(DENSE)
    cat = _cat(plan)
    assert cat.in_place == (1,) and cat.source == "x"
    assert plan.writer_of(plan.value_exprs["f"]).into.channel0 == 4
    (copy,) = _cat_work(plan)
    assert copy.launches == 1 and copy.bytes == 2 * 4 * 8 * (4 * 6 * 6)  # x read and written once, float32


def test_a_cat_that_copies_reads_every_piece():
    """The cost model's cat (aten family): a copy reads each piece and writes the whole, once."""
    plan = _plan("""
name: cc_twice
input: {shape: [N, 4, 6, 6], example: {N: 2}}
ops:
  - cat: {tensors: [x], dim: 1}
""")
    assert _cat(plan).in_place == ()  # (the input: no stage writes it)
    (work,) = _cat_work(plan)
    assert work.bytes == 4 * 8 * (4 * 36 + 4 * 36 + 8 * 36)  # x read twice, the cat written (float32)


def test_an_operand_read_as_an_output_too_is_copied():
    plan = _plan(READ_TWICE)
    cat = _cat(plan)
    assert cat.in_place == (0,)
    assert plan.writer_of(plan.value_exprs["p"]).into is None


# ---------------------------------------------------------------- built and validated


@pytest.fixture(scope="module")
def built_cats(tmp_path_factory):
    root = tmp_path_factory.mktemp("concat")
    return render_specs(root, {"cc_pools": POOLS, "cc_fire_gemm": FIRE.format(conv="gemm"), "cc_dense": DENSE,
                               "cc_read_twice": READ_TWICE})


@pytest.mark.parametrize("device", BUILD_DEVICES)
@pytest.mark.parametrize("name", ["cc_pools", "cc_fire_gemm", "cc_dense", "cc_read_twice"])
def test_built_cats_validate(built_cats, name, device):
    """Every case of the module and of each stage run on its own (which allocates the whole cat's output and
    writes its slice), with unwritten elements poisoned."""
    from kgen.build import build_modules
    from kgen.validate import validate

    spec, module_dir = built_cats[name]
    binding = (module_dir / "binding.cpp").read_text()
    assert "kgen::channel_slice(" in binding and (name == "cc_read_twice" or "at::cat(" not in binding)
    build_modules([module_dir], device.split(":")[0])
    assert_report_passed(validate(spec, module_dir, device), f"{name} on {device}")


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_the_cat_output_is_a_plain_tensor_equal_to_torch_cat(built_cats, device):
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    spec, module_dir = built_cats["cc_fire_gemm"]
    build_modules([module_dir], device.split(":")[0])
    module = import_module_dir(module_dir).Model().to(device)
    x = torch.randn(3, 3, 5, 5, device=device)
    x[0, 1, 2, 2] = float("nan")
    y = module(x)
    t = {n: p for n, p in module.state_dict().items()}
    F = torch.nn.functional
    s = torch.relu(F.conv2d(x, t["squeeze.weight"], t["squeeze.bias"]))
    want = torch.cat([torch.relu(F.conv2d(s, t["expand1x1.weight"], t["expand1x1.bias"])),
                      torch.relu(F.conv2d(s, t["expand3x3.weight"], t["expand3x3.bias"], padding=1))], 1)
    assert y.is_contiguous() and y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5, equal_nan=True)
