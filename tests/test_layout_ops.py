"""The ops that move or resample values (cat, permute/transpose, slice, pad, interpolate, expand,
adaptive pools to any size): their shape rules and semantics against torch in float64 (through
``Pipeline.run``), spec errors naming file and key, the plan (one ATen stage each; a cat reads its
named values as tensors), CPU build and validation of kgen's plan and of the eager candidate, and
`kgen explain`. Imported models using them: tests/test_import.py (the layout model) and below
(KernelBench-style modules: a fire module, a channel shuffle, an inception module)."""
import math
import textwrap
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import (BUILD_DEVICES, NETVLAD_SPEC, PERMUTE_CHAIN_SPEC, VIEW_VECTORS_SPEC, assert_report_passed, build_and_validate, fake_tuning, pipeline_of,
                      render_specs, spec_text, write_spec)
from kgen.errors import SpecError
from kgen.ir import AdaptivePool, Cat, Reduce, load_pipeline
from kgen.plan import EAGER, PIPELINE, candidate_plans, make_plan
from kgen.target import DEFAULT


def _run(ops, shape, x, inputs=None, batch=2, **kw):
    pipe = pipeline_of(spec_text(shape, ops, batch=batch, **kw))
    with torch.no_grad():
        return pipe, pipe.run(x, {}, inputs=inputs)


def _adversarial(shape, seed=0):
    """Normal data with NaN, +-inf and ties (a block of equal values) written in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    flat = x.view(-1)
    pos = torch.randperm(flat.numel(), generator=g)[:4]
    flat[pos] = torch.tensor([math.nan, math.inf, -math.inf, 0.0], dtype=torch.float64)
    flat[:6] = 0.5
    return x


CASES = {  # name: (input sample shape, spec ops, the torch function of x)
    "cat": ([4, 5, 6], ["relu", {"sigmoid": {"as": "sg"}}, {"tanh": {"from": "x", "as": "th"}},
                        {"cat": {"dim": -2, "tensors": ["sg", "x", "sg"]}}],
            lambda x: torch.cat([torch.tanh(x), torch.sigmoid(torch.relu(x)), x, torch.sigmoid(torch.relu(x))], -2)),
    "permute": ([3, 4, 5], [{"permute": {"dims": [0, 3, 1, 2]}}], lambda x: x.permute(0, 3, 1, 2)),
    "transpose": ([3, 4, 5], [{"transpose": {"dim0": -1, "dim1": 1}}], lambda x: x.transpose(1, 3)),
    "channel_shuffle": ([6, 4, 5], [{"reshape": {"shape": [3, 2, 4, 5]}}, {"transpose": {"dim0": 1, "dim1": 2}},
                                    {"reshape": {"shape": [6, 4, 5]}}],
                        lambda x: x.view(-1, 3, 2, 4, 5).transpose(1, 2).contiguous().view(-1, 6, 4, 5)),
    "slice": ([7, 9], [{"slice": {"dim": 1, "start": 1, "end": -1, "step": 2}}, {"slice": {"dim": -1, "start": -4}}],
              lambda x: x[:, 1:-1:2, -4:]),
    "slice_clamped": ([7, 9], [{"slice": {"dim": 2, "start": 3, "end": 100}}], lambda x: x[:, :, 3:100]),
    "pad": ([3, 4, 5], [{"pad": {"pad": [1, 2, 0, 3, 2, -1], "value": -1.5}}],
            lambda x: F.pad(x, (1, 2, 0, 3, 2, -1), value=-1.5)),
    "nearest_scale": ([3, 5, 7], [{"interpolate": {"scale_factor": [1.7, 2.0]}}],
                      lambda x: F.interpolate(x, scale_factor=(1.7, 2.0), mode="nearest")),
    "nearest_size_1d": ([3, 5], [{"interpolate": {"size": 12}}], lambda x: F.interpolate(x, size=12)),
    "nearest_3d": ([2, 3, 4, 5], [{"interpolate": {"scale_factor": 2}}], lambda x: F.interpolate(x, scale_factor=2)),
    "bilinear": ([3, 5, 7], [{"interpolate": {"mode": "bilinear", "size": [8, 3]}}],
                 lambda x: F.interpolate(x, size=(8, 3), mode="bilinear", align_corners=False)),
    "bilinear_corners": ([3, 5, 7], [{"interpolate": {"mode": "bilinear", "scale_factor": 1.5, "align_corners": True}}],
                         lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True)),
    "adaptive_avg": ([3, 7, 9], [{"adaptive_avg_pool2d": {"output_size": [3, 4]}}],
                     lambda x: F.adaptive_avg_pool2d(x, (3, 4))),
    "adaptive_max": ([3, 7, 9, 5], [{"adaptive_max_pool3d": {"output_size": [2, 4, 5]}}],
                     lambda x: F.adaptive_max_pool3d(x, (2, 4, 5))),
    "adaptive_max_1d": ([3, 10], [{"adaptive_max_pool1d": {"output_size": 3}}], lambda x: F.adaptive_max_pool1d(x, 3)),
    "adaptive_max_global": ([3, 5, 4], [{"adaptive_max_pool2d": {"output_size": 1}}],
                            lambda x: F.adaptive_max_pool2d(x, 1)),
    "expand": ([3, 1, 1], [{"expand": {"shape": [-1, 4, 5]}}], lambda x: x.expand(-1, -1, 4, 5)),
    "cumsum": ([4, 5, 6], [{"cumsum": {"dim": -1}}, {"cumsum": {"dim": 1}}],
               lambda x: torch.cumsum(torch.cumsum(x, -1), 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_computes_what_torch_does(name):
    shape, ops, fn = CASES[name]
    for seed, make in ((0, lambda s: torch.randn(s, generator=torch.Generator().manual_seed(1), dtype=torch.float64)),
                       (1, _adversarial)):
        x = make((2,) + tuple(shape))
        pipe, got = _run(ops, shape, x)
        want = fn(x)
        assert tuple(pipe.output.concrete(2)) == tuple(want.shape), (pipe.output, want.shape)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        assert got.is_contiguous()


def test_global_pools_stay_reductions_that_fuse_and_other_sizes_are_aten_stages():
    for kind, fn in (("adaptive_avg_pool2d", "mean"), ("adaptive_max_pool2d", "max")):
        pipe = pipeline_of(spec_text([4, 6, 6], ["relu", {kind: {"output_size": [1, 1]}}, "sigmoid"]))
        assert isinstance(pipe.ops[1], Reduce) and pipe.ops[1].fn == fn and pipe.ops[1].dims == (2, 3)
        plan = make_plan(pipe, target=DEFAULT)
        assert [s.family.name for s in plan.stages] == ["pool_reduce"] and plan.stages[0].candidates == ("pool_reduce",)
    pipe = pipeline_of(spec_text([4, 6, 6], ["relu", {"adaptive_avg_pool2d": {"output_size": [2, 1]}}, "sigmoid"]))
    assert isinstance(pipe.ops[1], AdaptivePool)
    assert [s.family.name for s in make_plan(pipe, target=DEFAULT).stages] == ["pool_reduce", "aten", "pool_reduce"]


def test_cat_reads_its_values_as_tensors():
    """A value a cat reads is a tensor (kgen.values cuts the stage after it), even where the value is
    named in the middle of a run of elementwise ops; the cat's stage reads it by its binding tensor."""
    text = spec_text([4, 5], ["relu", {"sigmoid": {"as": "g"}}, "tanh", {"mul": {"tensor": "g"}},
                              {"cat": {"dim": 1, "tensors": ["g", "x"]}}, "relu"])
    plan = make_plan(pipeline_of(text), target=DEFAULT)
    kinds = [(s.family.name, [o.describe() for o in s.ops]) for s in plan.stages]
    assert kinds[0] == ("pool_reduce", ["relu", "sigmoid", "as g"]), kinds
    assert kinds[2][0] == "aten" and kinds[2][1][0].startswith("cat") and kinds[3][0] == "pool_reduce", kinds
    assert plan.value_exprs["g"] == "t0" and plan.stage_values(plan.stages[2]) == ["x", "g"]
    assert isinstance(plan.stages[2].ops[0], Cat) and plan.stages[1].ops[-1].register is False


@pytest.mark.parametrize("pshape, shape, fn", [
    ([1, 1, 5], [1, -1], lambda p, n: p.expand(n, -1, -1)),  # ViT's class token
    ([1, 5], [3, 5], lambda p, n: p.expand(n, 3, 5)),  # fewer dims than the result: new ones in front
    ([1, 2, 1], [2, 4], lambda p, n: p.expand(n, 2, 4)),  # a dim of size 1 grows too
])
def test_expand_of_a_parameter_broadcasts_it_over_the_batch(pshape, shape, fn):
    """``expand: {param: P}``: the parameter, not the input, expanded to [N, *shape]; the input (here `from: x`,
    the cat's other piece) only gives the batch; the gradient of the parameter sums over the batch."""
    ops = [{"relu": {"as": "h"}}, {"expand": {"param": "tok", "shape": shape, "from": "x"}},
           {"cat": {"dim": 1, "tensors": ["h"]}}]
    sample = [4] + list(fn(torch.zeros(pshape), 1).shape[2:])
    pipe = pipeline_of(spec_text(sample, ops, params={"tok": {"shape": pshape}}))
    p = torch.randn(pshape, dtype=torch.float64, requires_grad=True)
    for n, make in ((3, lambda s: torch.randn(s, dtype=torch.float64)), (2, _adversarial)):
        x = make((n, *sample))
        got = pipe.run(x, {"tok": p})
        want = torch.cat([fn(p, n), torch.relu(x)], 1)
        assert got.shape == want.shape == pipe.types[-1].concrete(n)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        g = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, p, g)[0], torch.autograd.grad(want, p, g)[0])
    assert pipe.ops[2].describe() == f"tok.expand([N, {', '.join(map(str, pipe.ops[2].shape))}])"
    assert [s.family.name for s in make_plan(pipe, target=DEFAULT).stages] == ["pool_reduce", "aten", "aten"]


ERRORS = [  # (input sample shape, ops, the key, words of the message)
    ([4, 5], [{"cat": {"dim": 0, "tensors": ["x"]}}], "ops[0].cat.dim", "batch"),
    ([4, 5], [{"cat": {"dim": 3, "tensors": ["x"]}}], "ops[0].cat.dim", "out of range"),
    ([4, 5], [{"cat": {"dim": 1, "tensors": ["nope"]}}], "ops[0].cat.tensors[0]", "unknown value 'nope'"),
    ([4, 5], [{"sum": {"dim": 2, "keepdim": True, "as": "s"}}, {"cat": {"dim": 1, "tensors": ["s"], "from": "x"}}],
     "ops[1].cat", "every other size must be equal"),
    ([4, 5], [{"cat": {"dim": 1, "tensors": []}}], "ops[0].cat.tensors", "non-empty list"),
    ([4, 5], [{"permute": {"dims": [1, 0, 2]}}], "ops[0].permute.dims", "moves the batch"),
    ([4, 5], [{"permute": {"dims": [0, 1, 1]}}], "ops[0].permute.dims", "not a permutation"),
    ([4, 5], [{"permute": {"dims": [0, 2]}}], "ops[0].permute.dims", "not a permutation"),
    ([4, 5], [{"transpose": {"dim0": 0, "dim1": 2}}], "ops[0].transpose.dim0", "batch"),
    ([4, 5], [{"transpose": {"dim0": 1, "dim1": 5}}], "ops[0].transpose.dim1", "out of range"),
    ([4, 5], [{"slice": {"dim": 0, "start": 1}}], "ops[0].slice.dim", "batch"),
    ([4, 5], [{"slice": {"dim": 1, "start": 3, "end": 2}}], "ops[0].slice", "empty"),
    ([4, 5], [{"slice": {"dim": 1, "start": 9}}], "ops[0].slice", "empty"),
    ([4, 5], [{"slice": {"dim": 1, "step": 0}}], "ops[0].slice.step", "positive integer"),
    ([4, 5], [{"pad": {"pad": [1, 1, 1, 1, 1, 1]}}], "ops[0].pad.pad", "the batch is not padded"),
    ([4, 5], [{"pad": {"pad": [1, 2, 3]}}], "ops[0].pad.pad", "list of 2, 4"),
    ([4, 5], [{"pad": {"pad": [-3, -2]}}], "ops[0].pad", "leaves nothing"),
    ([4, 5, 6], [{"interpolate": {"size": 3, "scale_factor": 2}}], "ops[0].interpolate", "exactly one"),
    ([4, 5, 6], [{"interpolate": {"mode": "bicubic", "size": 3}}], "ops[0].interpolate.mode", "nearest, bilinear"),
    ([4, 5], [{"interpolate": {"mode": "bilinear", "size": 3}}], "ops[0].interpolate", "4-d input"),
    ([4, 5, 6], [{"interpolate": {"size": [3, 4, 5]}}], "ops[0].interpolate.size", "one value or 2"),
    ([4, 5, 6], [{"interpolate": {"scale_factor": 0.1}}], "ops[0].interpolate.scale_factor", "to nothing"),
    ([4, 5, 6], [{"interpolate": {"scale_factor": -2}}], "ops[0].interpolate.scale_factor", "positive"),
    ([4, 5, 6], [{"interpolate": {"size": 3, "align_corners": True}}], "ops[0].interpolate.align_corners", "bilinear only"),
    ([4, 5, 6], [{"adaptive_max_pool3d": {"output_size": 2}}], "ops[0].adaptive_max_pool3d", "5-d input"),
    ([4, 5, 6], [{"adaptive_avg_pool2d": {"output_size": [2, 0]}}], "ops[0].adaptive_avg_pool2d.output_size", "positive"),
    ([4, 1], [{"expand": {"shape": [4]}}], "ops[0].expand.shape", "the batch stays first"),
    ([4, 2], [{"expand": {"shape": [4, 6]}}], "ops[0].expand.shape", "only dims of size 1 grow"),
    ([4, 2], [{"expand": {"param": "nope", "shape": [4, 2]}}], "ops[0].expand.param", "unknown parameter 'nope'"),
    ([4, 5], [{"cumsum": {"dim": 0}}], "ops[0].cumsum.dim", "batch"),
    ([4, 5], [{"cumsum": {"dim": -4}}], "ops[0].cumsum.dim", "out of range"),
    ([4, 5], ["cumsum"], "ops[0].cumsum.dim", "required"),
]
PARAM_ERRORS = [  # (the parameter's shape, expand's shape, words of the message)
    ([2, 1, 5], [1, 5], "where it has the batch's place its size there is 1"),  # a parameter with a batch of 2
    ([1, 3, 5], [4, 5], "cannot expand parameter 'p' [1, 3, 5] to [N, 4, 5]"),
    ([1, 1, 1, 5], [1, 5], "cannot expand parameter 'p'"),  # more dims than the result
    ([5], [-1, 5], "cannot expand parameter 'p'"),  # -1 where the parameter has no dim
]


@pytest.mark.parametrize("pshape, shape, words", PARAM_ERRORS)
def test_expand_of_a_parameter_that_does_not_broadcast_names_the_key(pshape, shape, words):
    ops = [{"expand": {"param": "p", "shape": shape}}]
    with pytest.raises(SpecError) as e:
        pipeline_of(spec_text([4, 5], ops, params={"p": {"shape": pshape}}), "bad.yaml")
    assert e.value.key == "ops[0].expand.shape" and words in e.value.message, (e.value.key, e.value.message)


@pytest.mark.parametrize("shape, ops, key, words", ERRORS, ids=lambda v: v if isinstance(v, str) else None)
def test_spec_errors_name_file_and_key(shape, ops, key, words):
    with pytest.raises(SpecError) as e:
        pipeline_of(spec_text(shape, ops), "bad.yaml")
    assert e.value.path == "bad.yaml" and e.value.key == key and words in e.value.message, (e.value.key, e.value.message)
    assert str(e.value).startswith(f"bad.yaml: {key}")


LAYOUT_SPEC = """
name: layout_ops
input:
  shape: [N, 8, 6, 6]
  dtype: float32
  example: {N: 2}
ops:
  - conv2d: {out_channels: 4, kernel_size: 1, as: ca}
  - relu: {as: rb}
  - cat: {dim: 1, tensors: [ca], from: ca}
  - reshape: {shape: [2, 4, 6, 6]}
  - transpose: {dim0: 1, dim1: 2}
  - reshape: {shape: [8, 6, 6]}
  - slice: {dim: 1, start: 1, end: 7, as: sl}
  - permute: {dims: [0, 2, 3, 1]}
  - permute: {dims: [0, 3, 1, 2]}
  - pad: {pad: [1, 1, 0, 2], value: 0.5}
  - interpolate: {mode: bilinear, scale_factor: 1.5, align_corners: true}
  - adaptive_avg_pool2d: {output_size: [3, 5], as: ap}
  - adaptive_max_pool2d: {output_size: 1}
  - expand: {shape: [-1, 3, 5]}
  - mul: {tensor: ap}
  - sigmoid
  - cumsum: {dim: -2}
  - interpolate: {size: [6, 6]}
  - adaptive_max_pool2d: {output_size: [4, 3]}
  - interpolate: {scale_factor: [1.5, 2]}
  - cat: {dim: 1, tensors: [sl, rb]}
"""


@pytest.fixture(scope="module")
def layout_modules(tmp_path_factory):
    """LAYOUT_SPEC rendered twice, with kgen's plan and with the eager candidate chosen (a tuning file),
    built for the CPU: (spec, kgen module dir, eager spec, eager module dir)."""
    from kgen import tune, tunefile
    from kgen.build import build_modules
    from kgen.render import render_spec, write_rendered

    tmp = tmp_path_factory.mktemp("layout")
    spec = write_spec(tmp, LAYOUT_SPEC, "layout_ops.yaml")
    eager_spec = write_spec(tmp, LAYOUT_SPEC.replace("name: layout_ops", "name: layout_eager"), "layout_eager.yaml")
    t = fake_tuning(eager_spec, [], {2: lambda c: c.get(PIPELINE) == EAGER}, tmp / "tune")
    tunefile.write_entry(eager_spec, tune.entry(t, 30, DEFAULT.name))
    out = tmp / "gen"
    for s in (spec, eager_spec):
        write_rendered(render_spec(s, out), out)
    build_modules([out / "layout_ops", out / "layout_eager"], "cpu")
    return spec, out / "layout_ops", eager_spec, out / "layout_eager"


def test_layout_spec_builds_and_validates_on_the_cpu(layout_modules):
    from kgen.validate import validate

    spec, module, _, _ = layout_modules
    binding = (module / "binding.cpp").read_text()
    # the last cat: rb, which only it reads, written in place by the ReLU's stage; the other two copied into their slices
    for call in ("at::cat({t0, t0}, 1)", "t19.narrow(1, 0, 6).copy_(t18);", "t19.narrow(1, 6, 6).copy_(t6);",
                 "kgen::channel_slice(kOp, into, {batch, 16, 6, 6}, 12, 4, like.options())", ".permute({0, 2, 1, 3, 4})", ".slice(1, 1, 7, 1)", "at::constant_pad_nd(",
                 "at::upsample_bilinear2d(", "at::adaptive_avg_pool2d(t", "std::get<0>(at::adaptive_max_pool2d(t",
                 ".expand({t", "at::cumsum(t", "at::upsample_nearest2d(t", "std::optional<double>(1.5), std::optional<double>(2.0)"):
        assert call in binding, call
    assert_report_passed(validate(spec, module, "cpu"))


def test_eager_candidate_has_every_layout_op_and_validates(layout_modules):
    from kgen.validate import validate

    _, _, spec, module = layout_modules
    binding = (module / "binding.cpp").read_text()
    assert "eager" in (module / "plan.json").read_text()
    for call in ("Y = at::cat({Y, v_ca}, 1);", "Y = Y.permute({0, 2, 1, 3, 4});", "Y = Y.slice(1, 1, 7, 1);",
                 "Y = at::constant_pad_nd(Y, {1, 1, 0, 2}, 0.5);", "Y = at::adaptive_avg_pool2d(Y, {3, 5});",
                 "Y = std::get<0>(at::adaptive_max_pool2d(Y, {4, 3}));", "Y = Y.expand({Y.size(0), 6, 3, 5});",
                 "Y = at::cumsum(Y, 2);",
                 "Y = at::upsample_nearest2d(Y, {6, 6}, std::nullopt, std::nullopt);", "Y = at::cat({Y, v_sl, v_rb}, 1);"):
        assert call in binding, call
    assert_report_passed(validate(spec, module, "cpu"))


def test_layout_spec_has_an_eager_candidate_and_explains(tmp_path):
    from kgen.explain import explain_text

    spec = write_spec(tmp_path, LAYOUT_SPEC, "layout_ops.yaml")
    pipe = load_pipeline(spec)
    assert sum(p.choices.get(PIPELINE) == EAGER for p in candidate_plans(pipe, DEFAULT)) == 1
    text = explain_text(pipe)
    for words in ("cat([x, sl, rb], dim=1)", "transpose(1, 2)", "permute([0, 2, 3, 1])", "slice(dim 1, 1:7)",
                  "pad([1, 1, 0, 2], value=0.5)", "interpolate(bilinear, scale 1.5, align_corners)",
                  "adaptive_avg_pool2d(3x5)", "expand([N, 6, 3, 5])", "eager (the spec's ops through ATen)"):
        assert words in text, words


# ---- imported: small modules in KernelBench's layout, like level 3's (flattened: no nested modules with weights)

FIRE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, squeeze_channels, expand1x1_channels, expand3x3_channels):
        super(Model, self).__init__()
        self.squeeze = nn.Conv2d(in_channels, squeeze_channels, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze_channels, expand1x1_channels, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze_channels, expand3x3_channels, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([
            self.expand1x1_activation(self.expand1x1(x)),
            self.expand3x3_activation(self.expand3x3(x))
        ], 1)


def get_inputs():
    return [torch.rand(2, 6, 7, 7)]


def get_init_inputs():
    return [6, 3, 4, 5]
'''

SHUFFLE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class ChannelShuffle(nn.Module):
    def __init__(self, groups):
        super(ChannelShuffle, self).__init__()
        self.groups = groups

    def forward(self, x):
        batch_size, channels, height, width = x.size()
        channels_per_group = channels // self.groups
        x = x.view(batch_size, self.groups, channels_per_group, height, width)
        x = x.transpose(1, 2).contiguous()
        x = x.view(batch_size, -1, height, width)
        return x


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, groups=3):
        super(Model, self).__init__()
        mid_channels = out_channels // 4
        self.conv1 = nn.Conv2d(in_channels, mid_channels, kernel_size=1, groups=groups, bias=False)
        self.bn1 = nn.BatchNorm2d(mid_channels)
        self.conv2 = nn.Conv2d(mid_channels, mid_channels, kernel_size=3, padding=1, groups=mid_channels, bias=False)
        self.bn2 = nn.BatchNorm2d(mid_channels)
        self.conv3 = nn.Conv2d(mid_channels, out_channels, kernel_size=1, groups=groups, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shuffle = ChannelShuffle(groups)
        self.shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = self.shuffle(out)
        out = F.relu(self.bn3(self.conv3(out)))
        out = out + self.shortcut(x)
        return out


def get_inputs():
    return [torch.rand(2, 6, 5, 5)]


def get_init_inputs():
    return [6, 12, 3]
'''

INCEPTION = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_1x1, reduce_3x3, out_3x3, reduce_5x5, out_5x5, pool_proj):
        super(Model, self).__init__()
        self.branch1x1 = nn.Conv2d(in_channels, out_1x1, kernel_size=1)
        self.reduce3x3 = nn.Conv2d(in_channels, reduce_3x3, kernel_size=1)
        self.branch3x3 = nn.Conv2d(reduce_3x3, out_3x3, kernel_size=3, padding=1)
        self.reduce5x5 = nn.Conv2d(in_channels, reduce_5x5, kernel_size=1)
        self.branch5x5 = nn.Conv2d(reduce_5x5, out_5x5, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=1, padding=1)
        self.pool_proj = nn.Conv2d(in_channels, pool_proj, kernel_size=1)

    def forward(self, x):
        branch1x1 = self.branch1x1(x)
        branch3x3 = self.branch3x3(self.reduce3x3(x))
        branch5x5 = self.branch5x5(self.reduce5x5(x))
        branch_pool = self.pool_proj(self.pool(x))
        outputs = [branch1x1, branch3x3, branch5x5, branch_pool]
        return torch.cat(outputs, 1)


def get_inputs():
    return [torch.rand(2, 5, 6, 6)]


def get_init_inputs():
    return [5, 3, 2, 4, 2, 3, 2]
'''

MODELS = {"fire": (FIRE, {"cat": 1}), "shuffle": (SHUFFLE, {"transpose": 1, "reshape": 2}),
          "inception": (INCEPTION, {"cat": 1, "max_pool2d": 1})}


@pytest.fixture(scope="module")
def imported_models(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.importer import import_model
    from kgen.render import render_spec, write_rendered

    tmp = tmp_path_factory.mktemp("kb_layout")
    out = {}
    for name, (text, _) in MODELS.items():
        src = tmp / f"{name}.py"
        src.write_text(textwrap.dedent(text))
        spec = import_model(str(src), name=f"kb_{name}", out_dir=tmp / "specs")
        write_rendered(render_spec(spec, tmp / "gen"), tmp / "gen")
        out[name] = (spec, tmp / "gen" / f"kb_{name}")
    build_modules([d for _, d in out.values()], "cpu")
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kernelbench_style_module_imports_builds_and_validates(imported_models, name):
    from kgen.validate import validate

    spec, module = imported_models[name]
    kinds = [o.kind for o in load_pipeline(spec).spec.ops]
    for kind, count in MODELS[name][1].items():
        assert kinds.count(kind) == count, (kind, kinds)
    if name == "inception":  # the four branches' values, then one cat of them in order
        cat = load_pipeline(spec).spec.ops[-1]
        assert cat.kind == "cat" and len(cat.args["tensors"]) == 3 and cat.src is not None
    assert_report_passed(validate(spec, module, "cpu"), name)


INDEXING = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        p, q, r = torch.split(x, [1, 2, 3], dim=-1)
        y = torch.cat([b[:, :, 1:4], a[:, :, :3], x[:, 1:3, -3:]], dim=1)
        t = torch.stack([p, p, q[..., 1:]], dim=-1).flatten(3)
        v = (x.narrow(3, 0, 3) * r + t)[:, :, ::2]
        z = v.mean(dim=(2, 3))[:, :, None, None]
        v = v * z.expand_as(v) + v[:, 2].unsqueeze(1)
        v = torch.stack([v, z.expand(-1, -1, 2, 3)], dim=1).view(v.size(0), -1)
        return torch.cat([v.cumsum(-1), torch.cumsum(y, dim=2).mean(dim=(2, 3))], dim=1)


def get_inputs():
    return [torch.rand(3, 6, 4, 6)]


def get_init_inputs():
    return []
'''


def test_indexing_split_chunk_stack_expand_and_cumsum_import(tmp_path):
    from kgen.importer import import_model

    src = tmp_path / "indexing.py"
    src.write_text(textwrap.dedent(INDEXING))
    spec = import_model(str(src), name="indexing", out_dir=tmp_path / "specs")  # checked against the model in float64
    kinds = [o.kind for o in load_pipeline(spec).spec.ops]
    assert kinds.count("expand") == 1 and kinds.count("cat") == 4 and "transpose" in kinds and kinds.count("slice") >= 8
    assert kinds.count("cumsum") == 2


BAD_IMPORTS = [
    ("torch.cat([x, x], dim=0)", "concatenates along the batch"),
    ("x.permute(1, 0, 2, 3)", "moves the batch"),
    ("x.transpose(0, 1)", "moves the batch"),
    ("x.flatten(1).t()", "moves the batch"),
    ("x[1:]", "indexes the batch"),
    ("x[:, :, torch.tensor([0, 1])]", "only basic indexing"),
    ("torch.split(x, 1, dim=0)[0]", "splits the batch"),
    ("F.pad(x, (1, 1, 1, 1), mode='reflect')", "mode='reflect' is not supported"),
    ("F.interpolate(x, scale_factor=2, mode='bicubic')", "mode='bicubic' is not supported"),
    ("F.adaptive_max_pool2d(x, 2, return_indices=True)[0]", "return_indices"),
    ("x.masked_fill(x > 0, 1.0)", "masked_fill"),  # a mask other than t != 0
    ("x.cumsum(0)", "sums along the batch"),
    ("torch.cumsum(x, 1, dtype=torch.float64)", "dtype= or out= is not supported"),
]


@pytest.mark.parametrize("call, words", BAD_IMPORTS)
def test_unsupported_uses_name_the_call_and_its_line(tmp_path, call, words):
    from kgen.importer import ImportFailed, import_model

    text = INDEXING.split("    def forward")[0] + f"    def forward(self, x):\n        y = {call}\n        return y * 2\n" + \
        "\n\ndef get_inputs():\n    return [torch.rand(3, 6, 4, 6)]\n"
    src = tmp_path / "bad.py"
    src.write_text(text)
    with pytest.raises(ImportFailed) as e:
        import_model(str(src), name="bad", out_dir=tmp_path / "specs")
    line = text.splitlines().index(f"        y = {call}") + 1
    assert f"bad.py:{line}:" in str(e.value) and words in str(e.value), str(e.value)


def test_masked_fill_of_a_value_mask_imports(tmp_path):
    """``x.masked_fill(m != 0, v)`` and ``x.masked_fill(m.bool(), v)`` with m a value: the mask's comparison is read
    by the masked_fill (kgen's mask is nonzero where filled), not a call of its own; the module computes what the
    model does (the import's own check against the model) with zeros and other numbers in m."""
    from kgen.importer import import_model

    src = tmp_path / "fill.py"
    src.write_text(INDEXING.split("    def forward")[0] + """    def forward(self, x, m):
        return torch.relu(x).masked_fill(m != 0, -1.5).masked_fill(m.bool(), 2.0) * 2


def get_inputs():
    m = torch.rand(3, 6, 4, 6)
    m[m < 0.5] = 0.0
    return [torch.rand(3, 6, 4, 6), m]
""")
    spec = import_model(str(src), name="fill", out_dir=tmp_path / "specs")
    text = spec.read_text()
    assert text.count("masked_fill: {tensor: m") == 2 and " ne" not in text and "bool" not in text, text


PARAMETER_BROADCASTS_VALUE = '''
import torch
from torch import nn


class Model(nn.Module):
    """NetVLAD's soft assignment in small: a [B, 1, K] value times a [1, D, K] parameter is [B, D, K]."""

    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.randn(1, 5, 4))
        self.d = nn.Parameter(torch.randn(5, 1))

    def forward(self, x):
        s = x.sum(1, keepdim=True)
        return x - (self.c - s) * 2 + s / self.d


def get_inputs():
    return [torch.randn(3, 5, 4)]
'''


def test_a_parameter_that_broadcasts_a_value_expands_the_value_first(tmp_path):
    """Each broadcast is the value's expand to the result's shape, then the op with the parameter as operand
    (in its order: c - s is a reversed sub); the import checks the spec against the model in float64."""
    from kgen.importer import import_model

    src = tmp_path / "broadcast.py"
    src.write_text(PARAMETER_BROADCASTS_VALUE)
    spec = import_model(str(src), name="broadcast", out_dir=tmp_path / "specs")
    ops = load_pipeline(spec).spec.ops
    kinds = [o.kind for o in ops]
    assert kinds.count("expand") == 2, kinds
    assert [kinds[i + 1] for i, k in enumerate(kinds) if k == "expand"] == ["sub", "div"], kinds


VIEWS_SPEC = """
name: views
input:
  shape: [N, 6, 8]
  dtype: float32
  example: {N: 3}
params:
  w: {shape: [1, 8, 6], init: randn}
ops:
  - transpose: {dim0: 1, dim1: 2}  # read as a channels_last [8, 6]
  - relu: {as: r}
  - sum: {dim: 1, keepdim: true}
  - expand: {shape: [8, 6]}  # read with stride 0 over the 8
  - mul: {param: w}
  - add: {tensor: r}
  - reshape: {shape: [2, 4, 6]}
  - permute: {dims: [0, 3, 1, 2]}  # channels_last again: the last dim moved first
  - tanh
  - permute: {dims: [0, 2, 1, 3]}  # any strides, into a reduction
  - sum: {dim: 2}
  - transpose: {dim0: 1, dim1: 2, as: tv}  # read in place by the next stage, and later as a plain tensor: copied
  - sigmoid: {as: sg}
  - tanh: {from: tv}
  - add: {tensor: sg}
"""


VIEW_MATMUL_SPEC = """
name: view_matmul
inputs:
  x: {shape: [N, 5, 4]}
  y: {shape: [N, 5, 6]}
example: {N: 3}
ops:
  - transpose: {dim0: 1, dim1: 2}  # given to ATen's matmul as the view, as eager's `x.transpose(1, 2) @ y`
  - matmul: {tensor: y}
  - relu
  - transpose: {dim0: 1, dim1: 2, as: t}  # named, read only as the product's operand below: a view too
  - sigmoid: {from: y}
  - matmul: {tensor: t}
"""


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_permutes_and_expands_are_views_the_next_stage_reads_in_place(tmp_path, device):
    """A permute or an expand of a plain tensor before a stage that reads any strides (pool_reduce) is ATen's view,
    not a copy: its stage launches nothing and the next stage's input buffer is the view (channels_last where the
    permute moves the last dim first, else strided; an expand's broadcast dims of stride 0). A view that something
    reads as a plain tensor (``from: tv``) is a copy; one read only as a product's operand is a view. Validated against float64, stage by stage too (the
    broadcast buffer's stage cases repeat their values along the broadcast dims), also with a non-contiguous input."""
    from kgen import cost

    plan = make_plan(pipeline_of(VIEWS_SPEC), target=DEFAULT)
    views = [st for st in plan.stages if st.family.name == "aten" and st.ops[0].op_name != "reshape"]
    assert [st.output.layout for st in views] == ["channels_last", "strided", "channels_last", "strided",
                                                  "contiguous"]
    readers = [plan.stages[st.index + 1].input for st in views]
    assert readers[1].tiles[0].strides == (0, 1) and readers[1].tiles[0].stored == 6
    assert readers[3].tiles[0].strides == (4, 8, 1)  # tanh's [N, 6, 2, 4] seen as [N, 2, 6, 4]
    assert all(e.launches == 0 for e in cost.estimate(plan, 3) if e.stage in views[:4])
    from kgen.explain import explain_text

    assert explain_text(pipeline_of(VIEWS_SPEC)).count("nothing copied, its readers read it in place") == 4
    product = make_plan(pipeline_of(VIEW_MATMUL_SPEC), target=DEFAULT)  # (and no copy stage between)
    assert [st.kind for st in product.stages] == ["aten", "linear", "pool_reduce", "aten", "pool_reduce", "linear"]
    assert not product.stages[0].output.flat and not product.stages[3].output.flat
    # (a module name per device: one process loads each name once)
    rendered = render_specs(tmp_path, {f"views_{device}": VIEWS_SPEC.replace("name: views", f"name: views_{device}"),
                                       f"view_matmul_{device}": VIEW_MATMUL_SPEC.replace("name: view_matmul",
                                                                                          f"name: view_matmul_{device}")})
    binding = (rendered[f"views_{device}"][1] / "binding.cpp").read_text()
    assert binding.count("// a view: its readers read it in place") == 4
    assert "t0_source = x.contiguous()" in binding and "t10 = t9.permute({0, 2, 1}).contiguous();" in binding
    product_binding = (rendered[f"view_matmul_{device}"][1] / "binding.cpp").read_text()
    assert "kgen::matmul(t0, y)" in product_binding and "kgen::matmul(t4, t3)" in product_binding
    build_and_validate(rendered, device)


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_elementwise_chains_moved_past_a_permute_build_and_validate(tmp_path, device):
    """Mamba2's sites (tests/conftest.py PERMUTE_CHAIN_SPEC; kgen.rewrites.permute_before_elementwise): the
    exponential reads its input through the transpose, the chain after the second matmul reads the matmul's output
    and its operand ``w`` through views; NetVLAD's (NETVLAD_SPEC, commute_operand_chain): the sub reads the
    transposed product as a named view. Validated against float64 (every output), also at batches 1 to 3."""
    plan = make_plan(pipeline_of(PERMUTE_CHAIN_SPEC), target=DEFAULT)
    assert [st.kind for st in plan.stages] == ["linear", "aten", "pool_reduce", "linear", "aten", "aten", "pool_reduce"]
    assert all(st.output.layout == "strided" for st in plan.stages if st.kind == "aten")
    texts = {f"permute_chain_{device}": PERMUTE_CHAIN_SPEC.replace("name: permute_chain", f"name: permute_chain_{device}"),
             f"netvlad_{device}": NETVLAD_SPEC.replace("name: netvlad", f"name: netvlad_{device}")}
    build_and_validate(render_specs(tmp_path, texts), device)


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_elementwise_stages_over_views_with_adjacent_rows_move_whole_vectors(tmp_path, device):
    """An elementwise stage whose input is a view keeping runs of 16 bytes adjacent (a permute of outer dims, a
    slice of rows) loads and stores whole vectors (pool_reduce's map_vector); a view that splits them (a slice of each
    row's values in bfloat16) goes value by value. Validated against float64 in both dtypes, where the run-time
    alignment check sends some of them to the value-by-value kernel; an expand along the last dim stores whole
    vectors of one value loaded once (tests/conftest.py VIEW_VECTORS_SPEC)."""
    vectors = {}
    for dtype in ("float32", "bfloat16"):
        plan = make_plan(replace(pipeline_of(VIEW_VECTORS_SPEC), dtype=dtype), target=DEFAULT)
        stages = [st for st in plan.stages if st.kind == "pool_reduce"]
        vectors[dtype] = [(st.schedule.map_vector, st.schedule.map_repeated) for st in stages]
        assert all(st.input.layout == "strided" for st in stages)
    assert vectors == {"float32": [(4, False), (4, False), (4, False), (4, True)],
                       "bfloat16": [(8, False), (8, False), (1, False), (8, True)]}
    name = f"view_vectors_{device}"
    build_and_validate(render_specs(tmp_path, {name: VIEW_VECTORS_SPEC.replace("name: view_vectors", f"name: {name}")}), device)


INTERLEAVED_SPEC = """
name: interleaved
inputs:
  x: {shape: [N, 3, M, K, D]}
  y: {shape: [N, 3, K, D, 2]}
example: {N: 2}
ops:
  - permute: {dims: [0, 1, 3, 2, 4]}  # [N, 3, K, M, D]: the batch dims N, 3, K of no one stride
  - matmul: {tensor: y}
"""


def _interleaved(name, m, k, d):
    return INTERLEAVED_SPEC.replace("M", str(m)).replace("K", str(k)).replace("D", str(d)).replace("name: interleaved", f"name: {name}")


@pytest.mark.parametrize("device", BUILD_DEVICES)
def test_views_a_batched_product_cannot_take_are_sliced_or_priced_as_atens_copies(tmp_path, device):
    """A view handed to ATen's matmul is read in place only where cuBLAS's batched product takes it as it is (a
    transpose of the matrix dims; Buffer.batched_matrices). A permute that interleaves the batch dims would be
    copied by at::matmul first (Mamba2's einsums: 2.07 ms of copies on the H200); where leaving out one batch dim
    of at most 16 indices makes the views batched matrices and the copies outweigh the extra launches (8 MiB a
    launch), kgen::matmul runs one bmm per index on the views (buffer.product_slice_dim), priced as launches; else
    the cost model prices the copy. Both forms built and checked against float64 (the large one at batch 1, where
    it slices: a 31 MB copy saved for 3 launches)."""
    from kgen import cost
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    product = make_plan(pipeline_of(VIEW_MATMUL_SPEC), target=DEFAULT)  # transposes of [N, 5, 4]: cuBLAS's forms
    assert not any("copied by ATen's matmul" in w.what for e in cost.estimate(product, 8) for w in e.work)
    cases = {"small": (5, 4, 6, False), "large": (640, 4, 1024, True), "many": (5, 20, 6, False)}  # M, K, D, sliced
    texts = {}
    for what, (m, k, d, sliced) in cases.items():
        texts[what] = _interleaved(f"interleaved_{what}_{device}", m, k, d)
        plan = make_plan(pipeline_of(texts[what]), target=DEFAULT)
        assert not plan.stages[0].output.batched_matrices and plan.stages[0].output.layout == "strided"
        work = [w for e in cost.estimate(plan, 8) for w in e.work if "ATen's matmul" in w.what or "slices" in w.what]
        if sliced:  # K slices of dim 2, the innermost batch dim
            assert [(w.what, w.bytes, w.launches) for w in work] == [(f"y multiplied in {k} slices of dim 2 (no copies)", 0, k - 1)]
        else:
            assert [(w.what, w.bytes) for w in work] == [("its input copied by ATen's matmul", 2 * 4 * 8 * 3 * m * k * d)]
    rendered = render_specs(tmp_path, {f"interleaved_{w}_{device}": texts[w] for w in ("small", "large")})
    build_and_validate({n: v for n, v in rendered.items() if "small" in n}, device)
    build_modules([d for n, (_, d) in rendered.items() if "large" in n], device)
    model = import_module_dir(rendered[f"interleaved_large_{device}"][1]).Model()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(1, 3, 640, 4, 1024, generator=g, dtype=torch.float64), torch.randn(1, 3, 4, 1024, 2, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got = model(x.float().to(device), y.float().to(device)).double().cpu()
    torch.testing.assert_close(got, torch.matmul(x.permute(0, 1, 3, 2, 4), y), rtol=1e-5, atol=1e-4)


def test_product_slices_are_found_as_the_runtime_finds_them():
    """buffer.product_slice_dim (the cost model's) against kgen_runtime.h's twin's rule on drawn permutes of both
    operands: wherever it names a dim, bmm of each index's slices (views, no copy: torch.Tensor.view) computes
    torch.matmul; where at::matmul copies nothing, it names none."""
    import itertools

    from kgen.buffer import MAX_PRODUCT_SLICES, SLICE_BYTES, batched_matrix, product_slice_dim

    g = torch.Generator().manual_seed(1)
    found = 0
    for px, pw in itertools.product(itertools.permutations(range(1, 4)), repeat=2):
        x = torch.randn(2, 3, 4, 5, 6, generator=g, dtype=torch.float64).permute(0, *px, 4)
        x = x[..., :5, :] if x.shape[-2] != 5 else x
        w = torch.randn(2, *x.shape[1:-2], 6, 7, generator=g, dtype=torch.float64)
        w = w.permute(0, *[1 + i for i in pw[:2]], 3, 4) if x.shape[1] == x.shape[2] else w
        dims = lambda t: list(zip(t.shape, t.stride()))  # noqa: E731
        d = product_slice_dim(dims(x), dims(w), SLICE_BYTES * MAX_PRODUCT_SLICES)  # (any copy large enough: the dims alone)
        if batched_matrix(dims(x)) and batched_matrix(dims(w)):
            assert d is None
        if d is None:
            continue
        found += 1
        y = torch.empty(*x.shape[:-1], w.shape[-1], dtype=torch.float64)
        for i in range(x.shape[d]):
            torch.bmm(*(t.select(d, i).view(-1, *t.shape[-2:]) for t in (x, w)), out=y.select(d, i).view(-1, *y.shape[-2:]))
        torch.testing.assert_close(y, torch.matmul(x, w))
    assert found


def test_only_views_skip_the_copy_before_a_family_that_reads_views():
    """The aten family reads a permute's view, not a sub-pixel convolution's phase tiles: those are still copied
    into a plain tensor before its ATen call."""
    from kgen.plan import candidate_plans

    text = spec_text([4, 6, 6], [{"conv_transpose2d": {"out_channels": 4, "kernel_size": 4, "stride": 2, "padding": 1}},
                                 {"pad": {"pad": [1, 1, 1, 1]}}, "relu"], plan={"conv": "aten"})
    phased = [p for p in candidate_plans(pipeline_of(text), DEFAULT) if p.stages[0].output.phased]
    assert phased
    for plan in phased:
        assert [s.kind for s in plan.stages] == ["conv", "pool_reduce", "aten", "pool_reduce"]
        assert not plan.stages[1].ops  # the copy into a plain tensor
