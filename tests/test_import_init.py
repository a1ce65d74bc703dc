"""`kgen import` of models whose __init__ re-initializes its layers after creating them
(MobileNetV2's `_initialize_weights`: nn.init.kaiming_normal_, normal_, constant_, zeros_, and
`.data.fill_()` / `.data.zero_()`): the calls are recorded in the spec's `constructor.init` in order
and replayed by the reference model and the generated Model, so under the same seed both have the
original's weights. What cannot be replayed (a tensor argument, another in-place change, an init
before a later member is created) is refused naming its line; bad `constructor.init` entries name
their key.
"""
import pytest
import torch

from conftest import assert_report_passed, load_model_file, write_model_file
from kgen.errors import SpecError
from kgen.importer import import_model
from kgen.ir import load_pipeline
from kgen.reference import ReferenceModel
from test_import_nested import HEADER, _refused, _spec_file, assert_same_model

INIT = HEADER + '''
class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Model(nn.Module):
    def __init__(self, channels=6, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.fc = nn.Linear(channels, classes)
        self._initialize_weights()

    def _initialize_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 0.5)
                m.bias.data.fill_(0.25)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                m.bias.data.zero_()

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=[2, 3]))


def get_inputs():
    return [torch.rand(2, 3, 6, 6)]


def get_init_inputs():
    return [6, 5]
'''

EXPECTED = [
    ("stem.weight", "kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}),
    ("stem.bias", "zeros_", {}),
    ("blocks.0.conv.weight", "kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}),
    ("blocks.0.bn.weight", "constant_", {"val": 0.5}),
    ("blocks.0.bn.bias", "constant_", {"val": 0.25}),
    ("blocks.1.conv.weight", "kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}),
    ("blocks.1.bn.weight", "constant_", {"val": 0.5}),
    ("blocks.1.bn.bias", "constant_", {"val": 0.25}),
    ("fc.weight", "normal_", {"mean": 0, "std": 0.01}),
    ("fc.bias", "zeros_", {}),
]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init")
    src = write_model_file(tmp, "init_model", INIT)
    return import_model(str(src), name="init_model", out_dir=tmp / "specs"), src


def test_init_calls_are_recorded_in_order(imported):
    spec, _ = imported
    pipe = load_pipeline(spec)
    # only the model's own calls: the layers' reset_parameters (their construction) are not recorded
    assert [(i.member, i.fn, dict(i.args)) for i in pipe.spec.init] == EXPECTED
    assert "    - {member: stem.weight, fn: kaiming_normal_, args: {mode: fan_out, nonlinearity: relu}}" \
        in spec.read_text().splitlines()


def test_reference_initializes_like_the_original(imported):
    spec, src = imported
    original = load_model_file(src)
    assert_same_model(lambda: ReferenceModel(load_pipeline(spec)), original, original.get_inputs(), True)
    torch.manual_seed(3)
    weight = ReferenceModel(load_pipeline(spec)).get_parameter("blocks.1.bn.weight")
    assert torch.equal(weight, torch.full((6,), 0.5))  # not the default ones: replayed


def test_generated_model_initializes_like_the_original_and_validates(imported, tmp_path):
    from kgen.build import build_modules
    from kgen.render import render_spec, write_rendered
    from kgen.validate import import_module_dir, validate

    spec, src = imported
    write_rendered(render_spec(spec, tmp_path), tmp_path)
    module_dir = tmp_path / "init_model"
    assert "init_members(self, [" in (module_dir / "__init__.py").read_text()
    build_modules([module_dir], "cpu")
    assert_report_passed(validate(spec, module_dir, "cpu"), "init_model")
    mod = import_module_dir(module_dir)
    original = load_model_file(src)
    init = original.get_init_inputs()
    torch.manual_seed(5)
    ours = mod.Model(*init)
    torch.manual_seed(5)
    theirs = original.Model(*init)
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = [torch.randn(t.shape) for t in original.get_inputs()]
    for training in (True, False):  # the module runs in float32
        with torch.no_grad():
            torch.testing.assert_close(ours.train(training)(*x), theirs.train(training)(*x), rtol=1e-4, atol=1e-5)


# ---- what is refused, and how


def test_init_with_a_tensor_argument_names_its_line(tmp_path):
    text = INIT.replace("nn.init.constant_(m.weight, 0.5)", "nn.init.constant_(m.weight, torch.tensor(0.5))")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "torch.tensor(0.5)" in s)
    msg = _refused(tmp_path, text, r"nn\.init\.constant_ of the BatchNorm2d's 'weight' has the argument val = a Tensor")
    assert f"bad.py:{line}:" in msg


def test_other_in_place_change_of_a_member_is_refused(tmp_path):
    text = INIT.replace("m.bias.data.fill_(0.25)", "m.bias.data.add_(0.25)")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "add_(0.25)" in s)
    msg = _refused(tmp_path, text, r"changes with Tensor\.add_ the BatchNorm2d's 'bias'")
    assert f"bad.py:{line}:" in msg


def test_init_before_a_later_member_is_refused(tmp_path):
    text = INIT.replace("        self.fc = nn.Linear(channels, classes)\n        self._initialize_weights()\n",
                        "        self._initialize_weights()\n        self.fc = nn.Linear(channels, classes)\n")
    _refused(tmp_path, text, r"re-initializes 'stem.weight' before 'fc' is created")


BASE = ("name: t\ninput: {shape: [N, 4], example: {N: 2}}\nconstructor:\n  members: [fc]\n  init:\n    - %s\n"
        "ops:\n  - linear: {out_features: 3, name: fc}\n")


@pytest.mark.parametrize("entry, key, match", [
    ("{member: fc.weight, fn: kaiming_normal_, args: {mode: fan_out}}", None, None),
    ("{member: fc.weight, fn: dirac_}", r"constructor\.init\[0\]\.fn", "expected one of kaiming_normal_"),
    ("{member: fc.weight, fn: normal_, args: {gain: 2}}", r"constructor\.init\[0\]\.args\.gain", "normal_ takes mean, std"),
    ("{member: fc.weight, fn: kaiming_normal_, args: {mode: fan}}", r"constructor\.init\[0\]\.args\.mode", "fan_in, fan_out"),
    ("{member: fc.weight, fn: constant_, args: {val: .nan}}", r"constructor\.init\[0\]\.args\.val", "finite number"),
    ("{member: other.weight, fn: zeros_}", r"constructor\.init\[0\]\.member", "neither a listed parameter"),
    ("{member: fc.running_mean, fn: zeros_}", r"constructor\.init\[0\]\.member", "not a parameter or running statistic"),
    ("{fn: zeros_}", r"constructor\.init\[0\]\.member", "missing required field"),
])
def test_init_entries_in_specs_are_checked(tmp_path, entry, key, match):
    path = _spec_file(tmp_path, BASE % entry)
    if match is None:
        torch.manual_seed(0)
        fc = ReferenceModel(load_pipeline(path)).fc
        torch.manual_seed(0)
        want = torch.nn.Linear(4, 3)
        torch.nn.init.kaiming_normal_(want.weight, mode="fan_out")
        assert torch.equal(fc.weight, want.weight)
        return
    with pytest.raises(SpecError, match=key) as e:
        load_pipeline(path)
    assert match in str(e.value)
