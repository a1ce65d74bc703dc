"""`kgen import`: model files in KernelBench's layout (written here, tiny) -> specs that build
and validate; the drop-in constructor; errors that name the call and its line; nothing
written on failure.

Three modules cover every op the importer maps (CONV_MODEL: a 4-d pipeline with batch norm in
training and eval mode; GEMM_MODEL: three inputs, free parameters, values read across
stages and dropout; LAYOUT_MODEL: a fire module's cat, a channel shuffle, an SE gate, split,
indexing, pad, permute, interpolate, adaptive pools and stack); each is imported, built and
validated once for the module.
"""
import re
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import HAS_CUDA, assert_report_passed, load_model_file, write_model_file
from kgen.errors import KgenError
from kgen.importer import ImportFailed, import_model
from kgen.ir import load_pipeline
from kgen.ops import OPS, spec_op_names

CONV_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, num_groups=2, negative_slope=0.05, bias_shape=(4, 1, 1)):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=1)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.bn = nn.BatchNorm2d(out_channels, momentum=None)
        self.gn = nn.GroupNorm(num_groups, out_channels)
        self.act = nn.Hardswish()
        self.pool = nn.MaxPool2d(2)
        self.gelu = nn.GELU()
        self.negative_slope = negative_slope

    def forward(self, x):
        skip = self.conv(x)
        x = self.bn(skip)
        x = F.leaky_relu(x, self.negative_slope)
        x = x * torch.clamp((x + 3) / 6, 0, 1)
        x = x + skip
        x = self.gn(x)
        x = torch.sigmoid(x) * x
        x = F.mish(x) + self.bias
        x = self.act(x)
        x = self.pool(x)
        x = torch.min(x, torch.tensor(0.75))
        x = F.softplus(x, beta=2.0, threshold=1.0)
        x = self.gelu(torch.relu(x) - 0.5)
        x = torch.logsumexp(x, dim=1, keepdim=True) + torch.max(x, dim=1, keepdim=True).values
        x = torch.tanh(x)
        return x.mean(dim=[2, 3])


def get_inputs():
    return [torch.rand(5, 3, 8, 8)]


def get_init_inputs():
    return [3, 4, 3]
'''

GEMM_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, scale=0.5, p=0.3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.linear = nn.Linear(out_features, out_features)
        self.offset = nn.Parameter(torch.tensor(0.25))
        self.unused = nn.Parameter(torch.zeros(3))
        self.shift = nn.Parameter(torch.ones(out_features))
        self.keep = nn.Parameter(torch.randn(out_features))
        self.ln = nn.LayerNorm(out_features)
        self.drop = nn.Dropout(p)
        self.scale = scale

    def forward(self, x, y, z):
        x = torch.matmul(x, self.weight.T)
        x = self.linear(x)
        h = x.clone().detach()
        x = F.hardtanh(x, -2.0, 2.0) - self.offset
        x = F.elu(x, alpha=0.5) + F.hardsigmoid(x)
        x = self.ln(x * self.shift)
        x = F.silu(x) / self.scale
        x = F.normalize(x, dim=1) * 4 + h.abs().sqrt()
        x = x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-5) + h / h.norm(dim=1, keepdim=True)
        x = F.gelu(x, approximate="tanh") + y
        x = x + torch.bmm(z, y.view(-1, 2, 4)).flatten(1)
        x = torch.log(torch.exp(-torch.abs(x)) + 1.5)
        x = 1.0 - torch.maximum(x, torch.neg(h)) / 4
        x = torch.softmax(x, dim=1) * 2 - torch.log_softmax(h, dim=1)
        x = self.drop(x)
        x = x.unsqueeze(1).squeeze(1)
        x = torch.amin(x, dim=1, keepdim=True) - x.sum(dim=1, keepdim=True) + torch.amax(x, dim=1, keepdim=True)
        return x + h.masked_fill(self.keep != 0, -1.0).mean(dim=1, keepdim=True)


def get_inputs():
    return [torch.rand(4, 6), torch.rand(4, 8), torch.rand(4, 2, 2)]


def get_init_inputs():
    return [6, 8]
'''

LAYOUT_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, squeeze_channels, expand_channels, groups=2):
        super().__init__()
        self.squeeze = nn.Conv2d(in_channels, squeeze_channels, 1)
        self.expand1x1 = nn.Conv2d(squeeze_channels, expand_channels, 1)
        self.expand3x3 = nn.Conv2d(squeeze_channels, expand_channels, 3, padding=1)
        self.fc = nn.Linear(2 * expand_channels, 2 * expand_channels)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.pool = nn.AdaptiveMaxPool2d((2, 3))
        self.groups = groups

    def forward(self, x):
        x = torch.relu(self.squeeze(x))
        x = torch.cat([torch.relu(self.expand1x1(x)), torch.relu(self.expand3x3(x))], 1)
        b, c, h, w = x.size()
        x = x.view(b, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous().view(b, -1, h, w)
        s = torch.sigmoid(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))
        x = x * s.view(b, c, 1, 1).expand_as(x)
        a, rest = x.split([2, c - 2], dim=1)
        x = torch.cat([rest[:, 1:], a, s[:, :1, None, None].expand(-1, -1, h, w)], dim=1)
        x = F.pad(x, (1, 0, 2, 1), value=-0.5)
        x = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2)
        x = self.up(x[..., 1:])
        x = F.interpolate(x, size=(5, 7), mode="nearest")
        x = F.adaptive_avg_pool2d(x, (2, 3)) + self.pool(x).cumsum(-1)
        return torch.stack([x, -x], dim=2).flatten(1)


def get_inputs():
    return [torch.rand(3, 5, 6, 6)]


def get_init_inputs():
    return [5, 3, 4]
'''

IMPORTED_KINDS = {  # the ops each model's spec must hold: together every op the importer maps but the convs' kin
    "conv": {"conv2d", "batch_norm", "leaky_relu", "clamp", "add", "div", "mul", "group_norm", "sigmoid", "mish",
             "hardswish", "max_pool2d", "minimum", "softplus", "relu", "sub", "gelu", "logsumexp", "max", "tanh", "mean"},
    "gemm": {"matmul", "linear", "hardtanh", "sub", "elu", "hardsigmoid", "add", "mul", "layer_norm", "silu", "div",
             "gelu_tanh", "reshape", "abs", "neg", "exp", "log", "maximum", "softmax", "log_softmax", "dropout", "min",
             "sum", "max", "sqrt", "rsqrt", "masked_fill"},
    "layout": {"conv2d", "relu", "cat", "reshape", "transpose", "adaptive_avg_pool2d", "linear", "sigmoid", "mul", "slice",
               "expand", "pad", "permute", "interpolate", "adaptive_max_pool2d", "add", "neg", "cumsum"},
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Both models imported, rendered, built (CPU) and validated: name -> (spec, module dir, report, model file)."""
    from kgen.build import build_module
    from kgen.render import render_spec, write_rendered
    from kgen.validate import validate

    tmp = tmp_path_factory.mktemp("import")
    out = {}
    for name, text in (("conv", CONV_MODEL), ("gemm", GEMM_MODEL), ("layout", LAYOUT_MODEL)):
        src = write_model_file(tmp, f"{name}_model", text)
        spec = import_model(str(src), name=f"imp_{name}", out_dir=tmp / "specs")
        write_rendered(render_spec(spec, tmp / "gen"), tmp / "gen")
        build_module(tmp / "gen" / f"imp_{name}", "cpu", quiet=True)
        out[name] = (spec, tmp / "gen" / f"imp_{name}", validate(spec, tmp / "gen" / f"imp_{name}", "cpu"), src)
    return out


@pytest.mark.parametrize("name", ["conv", "gemm", "layout"])
def test_imported_model_builds_and_validates(imported, name):
    spec, _, report, _ = imported[name]
    assert_report_passed(report, name)
    kinds = {k for op in load_pipeline(spec).spec.ops for k in [op.kind]}
    assert IMPORTED_KINDS[name] <= kinds, IMPORTED_KINDS[name] - kinds
    if name == "conv":  # batch norm: both modes, and the running statistics the op returns
        assert any("(training mode)" in c.case for c in report.cases)
        assert any("running_var" in c.case for c in report.cases)
    elif name == "gemm":  # dropout with p > 0: eval mode only
        assert all("training mode" not in c.case for c in report.cases)


def test_every_op_is_covered_by_an_imported_model():
    """The two models use every op a spec may name, except the ones other tests build
    (the convolution, pool and norm kinds of the original chain)."""
    built_elsewhere = {k for k in OPS if k.startswith(("conv", "max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"))}
    built_elsewhere.add("instance_norm")
    covered = set().union(*IMPORTED_KINDS.values())
    assert set(spec_op_names()) - built_elsewhere <= covered, set(spec_op_names()) - built_elsewhere - covered


def test_spec_records_constructor_inputs_and_values(imported):
    spec = load_pipeline(imported["gemm"][0])
    assert list(spec.inputs) == ["x", "y", "z"]
    assert spec.input.shape == ("N", 6) and spec.example == {"N": 4}
    args = {a.name: (a.value, a.default) for a in spec.spec.constructor}
    assert args["in_features"][0] == 6 and args["scale"] == (0.5, 0.5) and args["p"] == (0.3, 0.3)
    assert spec.params["unused"].unused and spec.params["offset"].shape == () and spec.params["offset"].init == 0.25
    assert spec.member_order == ("weight", "linear", "offset", "unused", "shift", "keep", "ln")
    text = imported["conv"][0].read_text()
    assert re.search(r"conv2d: \{.*as: skip", text), text  # the source's own name for the value


def _modules(imported):
    from kgen.validate import import_module_dir

    return {n: import_module_dir(d) for n, (_, d, _, _) in imported.items()}


def test_drop_in_constructor_same_seed_same_weights(imported):
    mods = _modules(imported)
    for name, (_, _, _, src) in imported.items():
        original = load_model_file(src)
        for seed in (0, 7):
            torch.manual_seed(seed)
            ours = mods[name].Model(*original.get_init_inputs())
            torch.manual_seed(seed)
            theirs = original.Model(*original.get_init_inputs())
            a, b = ours.state_dict(), theirs.state_dict()
            assert list(a) == list(b)
            assert all(torch.equal(a[k], b[k]) for k in a), name
        # state_dicts load both ways, and the outputs agree in eval mode
        torch.manual_seed(3)
        theirs = original.Model(*original.get_init_inputs())
        ours.load_state_dict(theirs.state_dict())
        theirs.load_state_dict(ours.state_dict())
        inputs = [torch.randn(2, *t.shape[1:]) for t in original.get_inputs()]
        with torch.no_grad():
            torch.testing.assert_close(ours.eval()(*inputs), theirs.eval()(*inputs), rtol=1e-4, atol=1e-5)


def test_drop_in_constructor_takes_keywords_and_defaults(imported):
    mod = _modules(imported)["conv"]
    torch.manual_seed(1)
    a = mod.Model(in_channels=3, out_channels=4, kernel_size=3, num_groups=2)
    torch.manual_seed(1)
    b = mod.Model(3, 4, kernel_size=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert mod.get_init_inputs() == [3, 4, 3]
    import inspect

    params = inspect.signature(mod.Model).parameters
    assert list(params) == ["in_channels", "out_channels", "kernel_size", "num_groups", "negative_slope", "bias_shape"]
    assert params["num_groups"].default == 2 and params["bias_shape"].default == (4, 1, 1)
    assert mod.Model(3, 4, 3, bias_shape=[4, 1, 1]) is not None  # a list is the tuple it stands for
    with pytest.raises(TypeError):
        mod.Model(3, 4)  # kernel_size has no default, as in the reference


def test_drop_in_constructor_mismatch_names_the_argument(imported):
    mod = _modules(imported)["conv"]
    with pytest.raises(ValueError) as e:
        mod.Model(3, 8, 3)
    msg = str(e.value)
    assert "out_channels=8" in msg and "out_channels=4" in msg and "kgen import" in msg and "kgen all" in msg
    with pytest.raises(ValueError, match="negative_slope=0.2"):
        mod.Model(3, 4, 3, negative_slope=0.2)


def test_kernelbench_evaluator_builds_the_module_from_get_init_inputs(imported):
    """KernelBench's evaluator does ModelNew(*get_init_inputs()) with the file's own functions."""
    mods = _modules(imported)
    original = load_model_file(imported["gemm"][3])
    model_new = mods["gemm"].Model(*original.get_init_inputs()).eval()
    x, y, z = (torch.randn(3, *t.shape[1:]) for t in original.get_inputs())
    assert model_new(x, y, z).shape == (3, 1)


def test_dropout_in_training_mode_is_refused(imported):
    mod = _modules(imported)["gemm"]
    model = mod.Model(6, 8).train()
    with pytest.raises(RuntimeError, match="dropout with p=0.3 in training mode"):
        model(torch.randn(2, 6), torch.randn(2, 8), torch.randn(2, 2, 2))


def test_batch_norm_updates_running_statistics_as_pytorch(imported):
    mod = _modules(imported)["conv"]
    original = load_model_file(imported["conv"][3])
    torch.manual_seed(5)
    ours, theirs = mod.Model(3, 4, 3).train(), original.Model(3, 4, 3).train()
    ours.load_state_dict(theirs.state_dict())
    for step in range(2):
        x = torch.randn(3, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(ours.state_dict()[k], theirs.state_dict()[k], rtol=1e-5, atol=1e-6)
    assert int(ours.bn.num_batches_tracked) == 2  # momentum None: the cumulative average


# ---- errors: one line naming the call and its line; nothing written


UNSUPPORTED = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = torch.relu(x)
        x = torch.cumprod(x, dim=1)
        return x


def get_inputs():
    return [torch.rand(2, 4)]


def get_init_inputs():
    return []
'''


ATTENTION_SCORES = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        scores = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        kt = v.transpose(-2, -1)  # read twice: its own value
        return scores @ v + (kt @ v).sum(dim=-1, keepdim=True) + kt.sum(dim=-2).unsqueeze(-1)


def get_inputs():
    return [torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 5)]


def get_init_inputs():
    return []
'''


def test_a_transpose_only_a_product_reads_is_the_products_operand_transposed(tmp_path):
    """``q @ k.transpose(-2, -1)`` multiplies by k transposed (no op copies k^T); a transposed value read by
    something else keeps its transpose op. The import's float64 check says both compute what the model does."""
    src = write_model_file(tmp_path, "scores", ATTENTION_SCORES)
    ops = load_pipeline(import_model(str(src), name="scores", out_dir=tmp_path / "specs")).spec.ops
    products = [op for op in ops if op.kind == "matmul"]
    assert [op.args["transpose"] for op in products] == [True, False, False], [op.args for op in products]
    assert [op.kind for op in ops].count("transpose") == 1


POWERS = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = x ** 2 + torch.pow(x, 3) + x.square() - x.abs().pow(0.5) + (x.abs() + 1) ** -0.5
        y = y + 1 / (x.abs() + 2) + (x + 3).pow(-1) + torch.pow(x + 3, -2) + x ** 1
        return y + torch.norm(x, dim=(1, 2)).view(-1, 1, 1) + torch.linalg.vector_norm(x, dim=-1, keepdim=True) \\
            + x.norm(p=2, dim=1, keepdim=True)


def get_inputs():
    return [torch.randn(3, 4, 5)]


def get_init_inputs():
    return []
'''


def _refused(tmp_path, name: str, text: str, match: str) -> None:
    """The model file ``text`` is refused by `kgen import` with a message matching ``match``."""
    src = write_model_file(tmp_path, name, text)
    with pytest.raises(ImportFailed, match=match):
        import_model(str(src), name=name, out_dir=tmp_path / "specs")


def test_powers_and_norms_are_the_products_and_roots_aten_computes(tmp_path):
    """x ** e for e in 1, 2, 3, 0.5, -0.5, -1, -2 (ATen's special cases: products, sqrt, rsqrt, reciprocals) and
    the 2-norms over given dims; the import's float64 check says they compute what the model does; any other
    exponent is one error naming it."""
    src = write_model_file(tmp_path, "powers", POWERS)
    kinds = [op.kind for op in load_pipeline(import_model(str(src), name="powers", out_dir=tmp_path / "specs")).spec.ops]
    assert "sqrt" in kinds and "rsqrt" in kinds and kinds.count("sum") == 3, kinds
    _refused(tmp_path, "cube_root", POWERS.replace("x.abs().pow(0.5)", "x.abs().pow(0.3)"),
             "exponent 0.3: only 1, 2, 3, 0.5, -0.5, -1 and -2")


PATCHES = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3 * 4 * 4, 8)

    def forward(self, img):
        p = 4
        x = img.unfold(2, p, p).unfold(3, p, p).reshape(img.shape[0], -1, p * p * img.shape[1])
        y = img[:, :, :, :9].unfold(3, 4, 4)  # the last window would not fill: sliced first
        return self.embed(x).sum(-1) + y.flatten(1)[:, :4].sum(-1, keepdim=True)


def get_inputs():
    return [torch.randn(2, 3, 8, 12)]


def get_init_inputs():
    return []
'''


def test_unfold_into_windows_side_by_side_is_a_view(tmp_path):
    """ViT's patches (``img.unfold(2, p, p).unfold(3, p, p)``, KernelBench level 3 #28) are reshapes and permutes
    (the import's float64 check says they compute what the model does); overlapping windows are refused by name."""
    src = write_model_file(tmp_path, "patches", PATCHES)
    kinds = [op.kind for op in load_pipeline(import_model(str(src), name="patches", out_dir=tmp_path / "specs")).spec.ops]
    assert kinds.count("permute") == 2 and "slice" in kinds and "linear" in kinds, kinds
    _refused(tmp_path, "overlapping", PATCHES.replace("unfold(3, 4, 4)", "unfold(3, 4, 2)"),
             r"with size 4 and step 2: only windows side by side \(step == size\)")


SCALED = '''
import math
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # [B, T, 8]
        y = self.proj(x) * (1.0 / math.sqrt(x.size(-1)))
        return y  # MASKED


def get_inputs():
    return [torch.randn(2, 5, 8)]


def get_init_inputs():
    return []
'''


def test_a_number_computed_from_sizes_is_a_scalar_and_a_sliced_buffer_is_named(tmp_path):
    """MinGPT's ``1.0 / math.sqrt(k.size(-1))`` (a size other than the batch) is a scalar operand; its causal mask
    buffer sliced to the sequence (``self.bias[:, :, :T, :T]``) is refused naming the buffer and the backend."""
    src = write_model_file(tmp_path, "scaled", SCALED)
    ops = load_pipeline(import_model(str(src), name="scaled", out_dir=tmp_path / "specs")).spec.ops
    assert [op.kind for op in ops] == ["linear", "mul"] and ops[1].args["scalar"] == pytest.approx(8 ** -0.5), ops
    masked = SCALED.replace("  # MASKED", ".masked_fill(self.mask[:x.size(1)] == 0, 0.0)").replace(
        "nn.Linear(8, 8)", "nn.Linear(8, 8)\n        self.register_buffer('mask', torch.tril(torch.ones(6, 8)))")
    _refused(tmp_path, "masked", masked, r"reads the buffer self.mask .*torch.compile\(model, backend=\"kgen\"\)")


EINSUMS = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)
        o = torch.einsum("bhqk,bhkd->bqhd", s, v)
        w = torch.einsum("bqhd,bkhd->bhqk", o, v.transpose(1, 2))
        g = torch.einsum("bqhd,bqhe->bde", o, o)
        return o.flatten(1) + w.flatten(1).sum(-1, keepdim=True) + g.flatten(1).sum(-1, keepdim=True)


def get_inputs():
    return [torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)]


def get_init_inputs():
    return []
'''


def test_an_einsum_of_two_values_is_one_batched_product(tmp_path):
    """Attention's einsums (q k^T as the product's transposed operand, the result's dims permuted, two summed
    indices reshaped into one) import as one product each with the permutes and reshapes around it; the import's
    float64 check says they compute what the model does. An einsum the batch does not lead is one error."""
    src = write_model_file(tmp_path, "einsums", EINSUMS)
    ops = load_pipeline(import_model(str(src), name="einsums", out_dir=tmp_path / "specs")).spec.ops
    products = [op for op in ops if op.kind == "matmul"]
    assert len(products) == 4 and products[0].args["transpose"], [op.args for op in products]
    bad = EINSUMS.replace('"bhqd,bhkd->bhqk", q, k).softmax(-1)', '"bhqd,bhkd->hbqk", q, k).transpose(0, 1)')
    with pytest.raises(ImportFailed, match="the batch must be the first index"):
        import_model(str(write_model_file(tmp_path, "bad_einsum", bad)), name="bad_einsum", out_dir=tmp_path / "specs")


CHAINED_EINSUMS = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, b, decay, x_blocks):  # Mamba2's intra-chunk states, and a three-way product summed over two indices
        states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay, x_blocks)
        mixed = torch.einsum("bclhn,bhcl,bclhp->bhp", b, decay.exp(), x_blocks)
        return states.flatten(1) + mixed.flatten(1).sum(-1, keepdim=True)


def get_inputs():
    return [torch.randn(2, 3, 4, 2, 5), torch.randn(2, 2, 3, 4), torch.randn(2, 3, 4, 2, 6)]


def get_init_inputs():
    return []
'''


def test_an_einsum_of_three_values_is_split_into_products_of_two(tmp_path):
    """torch.einsum of three operands imports as two einsums of two, left to right: the first sums nothing (a
    product with the second operand broadcast over the index it lacks), the second is one batched product; the
    import's float64 check says they compute what the model does."""
    src = write_model_file(tmp_path, "chained", CHAINED_EINSUMS)
    ops = load_pipeline(import_model(str(src), name="chained", out_dir=tmp_path / "specs")).spec.ops
    kinds = [op.kind for op in ops]
    assert kinds.count("matmul") == 2 and kinds.count("mul") >= 2, kinds


def test_unsupported_call_names_the_op_and_its_line(tmp_path):
    src = write_model_file(tmp_path, "bad", UNSUPPORTED)
    out = tmp_path / "specs"
    with pytest.raises(ImportFailed) as e:
        import_model(str(src), name="bad", out_dir=out)
    msg = str(e.value)
    line = UNSUPPORTED.splitlines().index("        x = torch.cumprod(x, dim=1)") + 1
    assert "\n" not in msg and f"bad.py:{line}: torch.cumprod is not supported" in msg, msg
    assert not out.exists() or not any(out.iterdir())


def test_control_flow_on_values_names_its_line(tmp_path):
    text = UNSUPPORTED.replace("        x = torch.cumprod(x, dim=1)\n", "        if x.sum() > 0:\n            x = x * 2\n")
    src = write_model_file(tmp_path, "flow", text)
    with pytest.raises(ImportFailed) as e:
        import_model(str(src), name="flow", out_dir=tmp_path / "specs")
    line = text.splitlines().index("        if x.sum() > 0:") + 1
    assert f"flow.py:{line}:" in str(e.value) and "torch.fx cannot trace" in str(e.value)


def test_failed_import_leaves_an_existing_spec_alone(tmp_path):
    good = write_model_file(tmp_path, "good", UNSUPPORTED.replace("        x = torch.cumprod(x, dim=1)\n", ""))
    out = tmp_path / "specs"
    path = import_model(str(good), name="same", out_dir=out)
    before = path.read_text()
    with pytest.raises(ImportFailed):
        import_model(str(write_model_file(tmp_path, "bad", UNSUPPORTED)), name="same", out_dir=out)
    assert path.read_text() == before and sorted(p.name for p in out.iterdir()) == ["same.yaml"]


def test_cli_import_is_one_error_line(tmp_path):
    import os
    import subprocess
    import sys

    src = write_model_file(tmp_path, "bad", UNSUPPORTED)
    root = Path(__file__).resolve().parent.parent  # kgen from this checkout, installed or not
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "kgen", "import", str(src), "--out", str(tmp_path / "s")],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "torch.cumprod is not supported" in p.stderr, p.stderr


def test_module_class_with_input_shape(tmp_path, monkeypatch):
    (tmp_path / "pkg_models.py").write_text(textwrap.dedent('''
        import torch
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 3)
            def forward(self, x):
                return torch.relu(self.fc(x))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = import_model("pkg_models:Net", input_shapes=[(16, 4)], out_dir=tmp_path / "specs")
    pipe = load_pipeline(path)
    assert path.name == "net.yaml" and pipe.input.shape == ("N", 4) and pipe.example == {"N": 16}
    assert [o.op_name for o in pipe.ops] == ["linear", "relu"]
    with pytest.raises(KgenError, match="--input-shape"):
        import_model("pkg_models:Net", out_dir=tmp_path / "specs")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_imported_model_validates_on_the_gpu(imported):
    from kgen.build import build_module
    from kgen.validate import validate

    for spec, module_dir, _, _ in imported.values():
        build_module(module_dir, "cuda", quiet=True)
        report = validate(spec, module_dir, "cuda", example_batch=True)
        assert_report_passed(report)


def test_tune_measures_an_imported_model_with_constructor_arguments(imported, tmp_path):
    """`kgen tune` builds each candidate's Model with the imported file's constructor arguments
    (get_init_inputs) and times it; without them Model() failed for every imported model."""
    from kgen import tune
    from kgen.build import build_modules

    spec = imported["conv"][0]
    t = tune.prepare(spec, [2], 2, tmp_path / "tune")  # the model's best and the eager plan
    build_modules([m.module for m in t.measured], "cpu")
    tune.measure(t, 20, device="cpu")
    for m in t.measured:
        assert not m.problem and all(0 < m.ms[b] < float("inf") for b in t.batches), (m.problem, m.ms)


class _Seen(torch.nn.Module):
    """A linear layer that records which module object ran (the check's copies, or the model itself) in the
    class's list, which a copy shares."""

    seen: list = []

    def __init__(self, stateful: bool):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        if stateful:
            self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.seen.append(self)
        return self.linear(x)


@pytest.mark.parametrize("stateful", [False, True])
def test_the_import_check_copies_a_model_only_where_its_forward_updates_state(stateful):
    """The equivalence check runs each mode from the models' state: a model with buffers (running statistics) as a
    fresh copy per mode, one without as itself (a copy is the model's size again: an MLP of 671M parameters ran out
    of a 23 GB machine's memory)."""
    from types import SimpleNamespace

    from kgen.importer import _same_in_modes

    seen = _Seen.seen
    seen.clear()
    original, reference = _Seen(stateful), _Seen(stateful)
    reference.load_state_dict(original.state_dict())
    _same_in_modes(original, reference, [torch.randn(1, 4)], SimpleNamespace(ops=[]), (True, False),
                   torch.device("cpu"), torch.float32, "a test")
    assert len(seen) == 4
    if stateful:
        assert not {id(m) for m in seen} & {id(original), id(reference)} and len({id(m) for m in seen}) == 4
    else:
        assert [id(m) for m in seen] == [id(original), id(reference)] * 2
