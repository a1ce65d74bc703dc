"""`kgen import` of models built from nested modules (written here, tiny, in KernelBench's layout):
nn.Sequential, ModuleList and ModuleDict, custom child modules with free parameters of their own,
a ResNet-style block whose downsample is created before the block that stores it, keyword
arguments of functional calls, in-place calls and ReLU6.

Each model: the import succeeds, the spec loads, the model built from the spec has the original's
state_dict keys (loaded both ways, strict), initializes like it under the same seed, and computes
what it computes in float64 in training and eval mode. Two of them are built and validated on the
CPU, and the generated Model is checked against the original the same way.
"""

import re

import pytest
import torch

from conftest import assert_report_passed, conv_bn_blocks_model, load_model_file, write_model_file
from kgen.errors import SpecError
from kgen.importer import ImportFailed, import_model
from kgen.ir import load_pipeline
from kgen.reference import ReferenceModel

HEADER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

'''

SEQUENTIAL = HEADER + '''
class Model(nn.Module):
    def __init__(self, in_channels=3, hidden=8, classes=5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, hidden, 3, padding=1), nn.BatchNorm2d(hidden), nn.ReLU(inplace=True),
            nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1), nn.ReLU6()),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(hidden * 4 * 4, classes), nn.ReLU6(inplace=True))

    def forward(self, x):
        return self.classifier(self.features(x))


def get_inputs():
    return [torch.rand(2, 3, 8, 8)]


def get_init_inputs():
    return []
'''

# torchvision's BasicBlock and _make_layer: the downsample is built before the block that stores
# it (creation order differs from registration order), `out += identity`, one ReLU called twice
RESNET = HEADER + '''
class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Model(nn.Module):
    def __init__(self, in_channels=3, planes=8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes // 2, 3, padding=1, bias=False)
        self.layer1 = self._make_layer(planes // 2, planes, 2)

    def _make_layer(self, inplanes, planes, stride):
        downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        return nn.Sequential(BasicBlock(inplanes, planes, stride, downsample), BasicBlock(planes, planes))

    def forward(self, x):
        x = self.conv1(x)
        x = self.layer1(x)
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def get_inputs():
    return [torch.rand(2, 3, 8, 8)]


def get_init_inputs():
    return [3, 8]
'''

MODULE_LIST = HEADER + '''
class Model(nn.Module):
    def __init__(self, sizes=(6, 8, 8, 4)):
        super().__init__()
        self.norms = nn.ModuleDict({"first": nn.LayerNorm(sizes[1]), "last": nn.LayerNorm(sizes[-1])})
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0:
                x = self.norms["first"](x)
            x = F.relu(x, inplace=True)
        return self.norms["last"](x)


def get_inputs():
    return [torch.rand(3, 6)]


def get_init_inputs():
    return []
'''

# a custom child module with a free parameter of its own (used in its forward) and one unused
CUSTOM_CHILD = HEADER + '''
class Scaled(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.gain = nn.Parameter(torch.randn(features))
        self.spare = nn.Parameter(torch.zeros(features))

    def forward(self, x):
        return self.proj(x) * self.gain


class Model(nn.Module):
    def __init__(self, features=8):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(features))
        self.block = Scaled(features)
        self.blocks = nn.ModuleList([Scaled(features) for _ in range(2)])

    def forward(self, x):
        x = self.block(x + self.offset)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def get_inputs():
    return [torch.rand(4, 8)]


def get_init_inputs():
    return [8]
'''

# LeNet-5's functional calls with keyword arguments, in-place methods as statements, ReLU6
KEYWORDS = HEADER + '''
class Model(nn.Module):
    def __init__(self, classes=6):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=3, stride=1)
        self.conv2 = nn.Conv2d(4, 6, kernel_size=3, stride=1)
        self.fc1 = nn.Linear(6 * 2 * 2, 12)
        self.fc2 = nn.Linear(12, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x), inplace=True)
        x = F.max_pool2d(x, kernel_size=2, stride=2)
        x = self.conv2(x)
        x.relu_()
        x = F.avg_pool2d(x, kernel_size=2, stride=2, ceil_mode=False)
        x = x.view(-1, 6 * 2 * 2)
        y = F.relu6(self.fc1(x))
        y.add_(x.sum(dim=1, keepdim=True))
        y = F.dropout(y, p=0.5, training=False)
        y = F.gelu(y, approximate="tanh")
        y = F.hardtanh(y, min_val=-2.0, max_val=3.0).clamp_(min=-1.5)
        y = F.leaky_relu(y, negative_slope=0.2)
        return F.softmax(self.fc2(y), dim=1)


def get_inputs():
    return [torch.rand(2, 1, 14, 14)]


def get_init_inputs():
    return [6]
'''

MODELS = {"sequential": SEQUENTIAL, "resnet": RESNET, "module_list": MODULE_LIST, "custom_child": CUSTOM_CHILD,
          "keywords": KEYWORDS}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every model imported: name -> (spec path, model file)."""
    tmp = tmp_path_factory.mktemp("nested")
    out = {}
    for name, text in MODELS.items():
        src = write_model_file(tmp, f"{name}_model", text)
        out[name] = (import_model(str(src), name=f"nest_{name}", out_dir=tmp / "specs"), src)
    return out


def assert_same_model(ours_of_seed, original, inputs, has_norm: bool):
    """``ours_of_seed()`` (after a seed) against ``original``'s Model: the same state_dict keys and values
    under the same seed, loaded both ways (strict), the same float64 output in training and eval mode and
    the same running statistics after a training step."""
    args = original.get_init_inputs()
    torch.manual_seed(11)
    ours = ours_of_seed()
    torch.manual_seed(11)
    theirs = original.Model(*args)
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b), set(a) ^ set(b)
    for k in b:
        assert torch.equal(a[k], b[k]), k
    torch.manual_seed(12)
    other = original.Model(*args)
    ours.load_state_dict(other.state_dict(), strict=True)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in other.state_dict().items())
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for training in (True, False):
        x = [torch.randn(t.shape, dtype=torch.float64) for t in inputs]
        ours64, theirs64 = ours.double().train(training), theirs.double().train(training)
        with torch.no_grad():
            torch.testing.assert_close(ours64(*x), theirs64(*x), rtol=1e-9, atol=1e-9)
        if training and has_norm:
            after = ours64.state_dict()
            for k, v in theirs64.state_dict().items():
                torch.testing.assert_close(after[k], v, rtol=1e-9, atol=1e-9, msg=k)


@pytest.mark.parametrize("name", list(MODELS))
def test_nested_model_imports_and_is_the_same_model(imported, name):
    spec, src = imported[name]
    pipe = load_pipeline(spec)
    original = load_model_file(src)
    has_norm = any(o.op_name == "batch_norm" for o in pipe.ops)
    assert_same_model(lambda: ReferenceModel(load_pipeline(spec)), original, original.get_inputs(), has_norm)


def test_nested_specs_name_members_by_path(imported):
    names = {n: [o.args["name"] for o in load_pipeline(s).spec.ops if o.args.get("name")] for n, (s, _) in imported.items()}
    assert names["sequential"] == ["features.0", "features.1", "features.3.0", "classifier.1"]
    assert names["module_list"] == ["layers.0", "norms.first", "layers.1", "layers.2", "norms.last"]
    resnet = load_pipeline(imported["resnet"][0])
    # creation order: the downsample before the block that stores it
    assert resnet.member_order[:4] == ("conv1", "layer1.0.downsample.0", "layer1.0.downsample.1", "layer1.0.conv1")
    assert [o.op_name for o in resnet.ops].count("add") == 2  # out += identity, twice
    custom = load_pipeline(imported["custom_child"][0])
    assert set(custom.params) == {"offset", "block.gain", "block.spare", "blocks.0.gain", "blocks.0.spare",
                                  "blocks.1.gain", "blocks.1.spare"}
    assert custom.params["block.spare"].unused and custom.params["block.spare"].init == "zeros"
    assert custom.member_order == ("offset", "block.proj", "block.gain", "block.spare", "blocks.0.proj",
                                   "blocks.0.gain", "blocks.0.spare", "blocks.1.proj", "blocks.1.gain", "blocks.1.spare")
    keywords = [o.op_name for o in load_pipeline(imported["keywords"][0]).ops]
    assert keywords.count("hardtanh") == 2 and "max_pool2d" in keywords and "avg_pool2d" in keywords
    assert "dropout" not in keywords  # training=False: the input itself


@pytest.fixture(scope="module")
def built(imported, tmp_path_factory):
    """The ResNet-style and the custom-child models rendered, built and validated on the CPU."""
    from kgen.build import build_modules
    from kgen.render import render_spec, write_rendered
    from kgen.validate import validate

    gen = tmp_path_factory.mktemp("nested_gen")
    names = ("resnet", "custom_child")
    for n in names:
        write_rendered(render_spec(imported[n][0], gen), gen)
    build_modules([gen / f"nest_{n}" for n in names], "cpu")
    return {n: (gen / f"nest_{n}", validate(imported[n][0], gen / f"nest_{n}", "cpu")) for n in names}


@pytest.mark.parametrize("name", ["resnet", "custom_child"])
def test_nested_model_builds_validates_and_loads_the_original(imported, built, name):
    from kgen.validate import import_module_dir

    module_dir, report = built[name]
    assert_report_passed(report, name)
    mod = import_module_dir(module_dir)
    original = load_model_file(imported[name][1])
    init = original.get_init_inputs()
    text = (module_dir / "__init__.py").read_text()
    assert "set_member(self, " in text
    torch.manual_seed(4)
    ours, theirs = mod.Model(*init), original.Model(*init)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    torch.manual_seed(5)
    a = mod.Model(*init).state_dict()
    torch.manual_seed(5)
    b = original.Model(*init).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
    x = [torch.randn(t.shape) for t in original.get_inputs()]
    for training in (True, False):
        with torch.no_grad():
            torch.testing.assert_close(ours.train(training)(*x), theirs.train(training)(*x), rtol=1e-4, atol=1e-5)
    if name == "resnet":  # the running statistics at their paths, updated as PyTorch does
        for k in ("layer1.0.downsample.1.running_mean", "layer1.1.bn2.running_var", "layer1.0.bn1.num_batches_tracked"):
            torch.testing.assert_close(ours.state_dict()[k], theirs.state_dict()[k], rtol=1e-5, atol=1e-6)
        assert int(ours.state_dict()["layer1.0.bn1.num_batches_tracked"]) == 1


# ---- what is refused, and how


def _refused(tmp_path, text, match):
    src = write_model_file(tmp_path, "bad", text)
    with pytest.raises(ImportFailed, match=match) as e:
        import_model(str(src), name="bad", out_dir=tmp_path / "specs")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_nested_module_called_twice_is_refused(tmp_path):
    text = SEQUENTIAL.replace("return self.classifier(self.features(x))",
                              "x = self.features(x)\n        x = self.features[3](x)\n        return x.mean(dim=[2, 3])")
    _refused(tmp_path, text, r"self\.features\.3\.0 is called twice")


def test_unused_nested_layer_is_named(tmp_path):
    text = CUSTOM_CHILD.replace("self.spare = nn.Parameter(torch.zeros(features))",
                                "self.spare = nn.Parameter(torch.zeros(features))\n        self.extra = nn.Linear(features, 2)")
    _refused(tmp_path, text, r"the submodule self\.block\.extra \(Linear\) has parameters but forward does not use it")


def test_inputs_of_different_batch_sizes_are_refused_clearly(tmp_path):
    text = HEADER + '''
class Model(nn.Module):
    def forward(self, x, y):
        return x + y.sum(dim=0, keepdim=True)


def get_inputs():
    return [torch.rand(2, 4), torch.rand(3, 4)]
'''
    msg = _refused(tmp_path, text, "batch")
    assert "[2, 4], [3, 4]" in msg and "first dim" in msg


def test_init_that_needs_values_is_built_on_the_cpu(tmp_path):
    """``Tensor.item()`` in __init__ cannot run on the meta device: the model is built for real."""
    text = HEADER + '''
class Model(nn.Module):
    def __init__(self, features=4):
        super().__init__()
        width = int(torch.tensor([features * 2]).item())
        self.fc = nn.Sequential(nn.Linear(features, width), nn.ReLU())

    def forward(self, x):
        return self.fc(x)


def get_inputs():
    return [torch.rand(2, 4)]


def get_init_inputs():
    return [4]
'''
    spec = import_model(str(write_model_file(tmp_path, "item", text)), name="item_model", out_dir=tmp_path / "specs")
    pipe = load_pipeline(spec)
    assert [o.op_name for o in pipe.ops] == ["linear", "relu"] and pipe.ops[0].module == "fc.0"


def test_member_paths_in_specs_are_checked(tmp_path):
    base = "name: t\ninput: {shape: [N, 4], example: {N: 2}}\n"
    good = base + "params:\n  block.scale: {shape: [4], init: ones}\nops:\n  - linear: {out_features: 4, name: layers.0}\n" \
                  "  - mul: {param: block.scale}\n"
    pipe = load_pipeline(_spec_file(tmp_path, good))
    assert [a.ident for a in pipe.tensor_args()] == ["layers_0_weight", "layers_0_bias", "block_scale"]
    collide = base + "params:\n  a_b.weight: {shape: [4, 4]}\nops:\n  - linear: {out_features: 4, name: a.b}\n" \
                     "  - matmul: {param: a_b.weight}\n"
    with pytest.raises(SpecError, match="'a_b.weight' and 'a.b.weight' collide as 'a_b_weight'|'a.b.weight' and 'a_b.weight'"):
        load_pipeline(_spec_file(tmp_path, collide))
    for ops, match in (
        ("  - linear: {out_features: 4, name: Layers.0}\n", "expected an identifier"),
        ("  - linear: {out_features: 4, name: layers..0}\n", "expected an identifier"),
        ("  - linear: {out_features: 4, name: block.forward}\n", "attribute of torch.nn.Module"),
        ("  - linear: {out_features: 4, name: block.scale.inner}\n", "lies inside the parameter 'block.scale'"),
        ("  - linear: {out_features: 4, name: block}\n", "'block.scale' lies inside the submodule 'block'"),
    ):
        text = base + "params:\n  block.scale: {shape: [4], init: ones}\nops:\n" + ops + "  - mul: {param: block.scale}\n"
        with pytest.raises(SpecError, match=match):
            load_pipeline(_spec_file(tmp_path, text))


def _spec_file(tmp_path, text):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


# 12 convolution + batch norm blocks: 48 parameters and 24 running statistics, more tensors than a
# PyTorch op takes arguments (64), which the op takes as two lists
DEEP = conv_bn_blocks_model(blocks=12, size=5)


@pytest.mark.slow  # its build and validation take ~80 s on 2 cores
def test_a_model_of_more_tensors_than_an_op_takes_builds_validates_and_trains(tmp_path):
    """A model of 72 parameters and buffers: kgen::NAME(Tensor x, Tensor[] params, Tensor[] buffers, bool training,
    float[] factors) builds on the CPU and validates against float64 (training and eval mode); the generated Model
    loads the original's state_dict both ways, computes what it computes and gives its parameters the same gradients,
    and a wrong parameter is refused naming it by its path."""
    from kgen.build import build_modules
    from kgen.render import render_spec, write_rendered
    from kgen.validate import import_module_dir, validate

    src = write_model_file(tmp_path, "deep_model", DEEP)
    spec = import_model(str(src), name="nest_deep", out_dir=tmp_path / "specs")
    gen = tmp_path / "gen"
    write_rendered(render_spec(spec, gen), gen)
    binding = (gen / "nest_deep" / "binding.cpp").read_text()
    assert 'm.def("nest_deep(Tensor x, Tensor[] params, Tensor[] buffers, bool training, float[] factors)' in binding
    build_modules([gen / "nest_deep"], "cpu")
    assert_report_passed(validate(spec, gen / "nest_deep", "cpu", stages=False), "nest_deep")
    mod = import_module_dir(gen / "nest_deep")
    assert len(mod.PARAMETERS) + len(mod.BUFFERS) == 72
    original = load_model_file(src)
    torch.manual_seed(4)
    ours, theirs = mod.Model(), original.Model()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 4, 5, 5)
    for training in (True, False):
        ours.train(training), theirs.train(training)
        ours.zero_grad(), theirs.zero_grad()
        a, b = ours(x), theirs(x)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        g = torch.randn_like(a)
        a.backward(g), b.backward(g)
        grads = {n: q.grad for n, q in theirs.named_parameters()}
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5, msg=name)
    for k, v in theirs.state_dict().items():  # the running statistics the training step updated
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    state = ours.state_dict()
    params, buffers = [state[n] for n in mod.PARAMETERS], [state[n] for n in mod.BUFFERS]
    name = list(mod.PARAMETERS)[5]
    params[5] = params[5][:3]
    with pytest.raises(RuntimeError, match=rf"params\[5\] \({re.escape(name)}\) must have shape \[4\], got \[3\]"):
        mod.forward(x, *params, *buffers, False, [0.1] * 12)
