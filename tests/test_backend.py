"""torch.compile(model, backend="kgen") (kgen/backend.py) on the CPU build.

Most tests build a kgen module of their own (each a few seconds). Net (conv, batch norm, relu, residual add, max
pool, flatten, linear: one partition) and Split with torch.cumprod (kgen cannot compute it) or a print (a graph
break) between the conv/bn/relu and the pool/flatten/linear (the same two partitions either way) are first called
at batch 4 wherever a test builds or loads their partitions, in eval or training mode: a partition's plans are made
for the batch of its first call, so those tests share their partitions' modules (the module cache is this file's).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
import yaml
import torch.nn.functional as F
from torch import nn

from conftest import DEVICES, fresh_kgen_cache
from kgen.errors import KgenError

ROOT = Path(__file__).resolve().parent.parent


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))) + x
        y = F.max_pool2d(y, 2)
        return self.fc(torch.flatten(y, 1))


class Split(nn.Module):
    def __init__(self, between: str):
        super().__init__()
        self.between = between
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        if self.between == "cumprod":
            y = torch.cumprod(y, 2)
        else:
            print("kgen test: a graph break")
        y = F.max_pool2d(y, 2)
        return self.fc(y.view(y.size(0), -1))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """KGEN_CACHE set to a fresh folder for this module (the precompiled header shared with kgen's usual cache)."""
    with fresh_kgen_cache(tmp_path_factory.mktemp("backend")) as folder:
        yield folder


@pytest.fixture(autouse=True)
def partitions_in_kgen(request, monkeypatch):
    """The models here are tiny, where the cost model often finds a partition's own ops through ATen its fastest
    plan, and such a partition stays PyTorch's (test_a_partition_whose_plan_is_eager_stays_pytorchs, marked
    ``eager_fallback``): the other tests of partitions keep them as kgen modules."""
    from kgen import backend

    if request.node.get_closest_marker("eager_fallback") is None:
        monkeypatch.setattr(backend, "_refuse_eager_plans", lambda module_dir, g, batch: None)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_module(fn) -> "torch.fx.GraphModule":
    """The graph module whose forward the backend returned (itself, or kgen's form of kgen.runtime.MeasuredGraph)."""
    forms = getattr(fn, "forms", None)
    return (next(iter(forms.values())) if forms else fn).__self__


def _compiled(model):
    from kgen.backend import kgen_backend

    return torch.compile(model, backend=kgen_backend)


def _partitions_of(model, *inputs) -> list:
    """``model`` under the backend computes what it computes eagerly on ``inputs`` (without grad); the
    partitions the backend made for it (``kgen.backend.PARTITIONS``' new entries)."""
    from kgen import backend

    before = len(backend.PARTITIONS)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(model)(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    return backend.PARTITIONS[before:]


def _folders(cache: Path) -> set:
    return {p.name for p in (cache / "compiled").iterdir()} if (cache / "compiled").is_dir() else set()


def _with_statistics(model):
    """Running statistics that are not the defaults (eval mode then reads something)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def test_supported_model_in_eval_mode_equals_eager_and_a_new_batch_does_not_recompile(cache):
    from torch._dynamo.utils import counters

    from kgen import backend

    torch.manual_seed(0)
    model = _with_statistics(Net()).eval()
    compiled = _compiled(model)
    before = len(backend.PARTITIONS)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert len(made) == 1 and made[0]["module"] is not None, made  # the whole graph is one kgen partition
    for call in ("conv2d", "batch_norm", "relu", "add", "max_pool2d", "flatten", "linear"):
        assert call in made[0]["calls"], made[0]
    folders, graphs = _folders(cache), backend.STATS["graphs"]
    frames = counters["stats"]["unique_graphs"]
    assert len(folders) == 1
    # its plans are chosen for the batch of the call compiled (as `kgen import` plans for the file's batch)
    spec = yaml.safe_load((cache / "compiled" / next(iter(folders)) / "spec.yaml").read_text())
    assert list(spec["input"]["example"].values()) == [4], spec["input"]
    # the partition names its spec, which `kgen explain` reads
    from kgen.explain import explain_text
    from kgen.ir import load_pipeline

    assert Path(made[0]["spec"]).parent.name in folders
    assert "kernels of the plan" in explain_text(load_pipeline(made[0]["spec"]))
    for batch in (3, 5, 7):  # the batch was dynamic from the first trace: no recompile, nothing built
        x = torch.randn(batch, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert _folders(cache) == folders
    assert backend.STATS["graphs"] == graphs and counters["stats"]["unique_graphs"] == frames
    x = torch.randn(1, 3, 8, 8)  # Dynamo specializes a size of 1 (a graph of its own): loaded, not built
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    assert _folders(cache) == folders
    assert all(p["module"] == made[0]["module"] for p in backend.PARTITIONS[before:])


def test_the_kgen_call_is_issued_before_the_norms_bookkeeping(cache):
    """Dynamo's graph adds 1 to each batch norm's num_batches_tracked before the norm: the backend's graph calls
    the kgen partition first (its kernels reach the GPU sooner) and counts the batches after it, as eager does."""
    from kgen.backend import kgen_backend

    graphs = []

    def keep(gm, examples):
        out = kgen_backend(gm, examples)
        graphs.append(_graph_module(out).graph)
        return out

    torch.manual_seed(2)
    model = Net().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=keep)(x), reference(x), rtol=1e-4, atol=1e-5)
    (graph,) = graphs
    calls = [n for n in graph.nodes if n.op in ("call_module", "call_method", "call_function")]
    assert [n.target for n in calls][:2] == ["fused_0", "add_"], [n.target for n in calls]
    assert int(model.bn.num_batches_tracked) == 1
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var, rtol=1e-5, atol=1e-6)


def test_supported_model_trains_one_step_as_eager(cache):
    torch.manual_seed(1)
    model = Net().train()
    reference = copy.deepcopy(model)
    compiled = _compiled(model)
    x = torch.randn(4, 3, 8, 8)
    y, want = compiled(x), reference(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    (y.square().sum()).backward()
    (want.square().sum()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}.grad: {m}")
    # the running statistics are updated in place, as F.batch_norm does
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert int(model.bn.num_batches_tracked) == 1
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)):
        opt.step()
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-5)


def _steps(model, forward, xs, targets):
    """Training steps: forward, loss, backward, SGD with momentum and weight decay; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    losses = []
    for x, t in zip(xs, targets):
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), t)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _assert_same_state(model, reference, rtol=1e-4, atol=1e-5):
    for (name, p), q in zip(model.state_dict(keep_vars=True).items(), reference.state_dict().values()):
        torch.testing.assert_close(p.detach(), q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["net", "cumprod"])
def test_training_steps_give_eager_parameters_and_running_statistics(cache, kind):
    """Four steps of forward, loss, backward and an optimizer step, the model compiled: its parameters,
    running statistics and batch counts stay eager's (a model with a call kgen leaves to PyTorch too)."""
    from kgen import backend

    torch.manual_seed(8)
    model = (Net() if kind == "net" else Split("cumprod")).train()
    reference = copy.deepcopy(model)
    compiled = _compiled(model)
    before = len(backend.PARTITIONS)
    xs = [torch.randn(b, 3, 8, 8) for b in (4, 4, 6, 3)]  # a new batch mid-training
    targets = [torch.randint(0, 5, (x.shape[0],)) for x in xs]
    losses = _steps(model, compiled, xs, targets)
    want = _steps(reference, reference, xs, targets)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-5, atol=1e-6)
    _assert_same_state(model, reference)
    assert all(int(m.num_batches_tracked) == 4 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    made = backend.PARTITIONS[before:]
    assert made and all(p["module"] for p in made), made  # kgen computed them all


@pytest.mark.slow
def test_compiled_training_step_function(cache):
    """torch.compile of the whole step (forward, loss, backward, optimizer step): Dynamo breaks the graph at
    backward; the forward's graph is kgen's, the optimizer's graph PyTorch's."""
    torch.manual_seed(9)
    model = Net().train()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)

    def step(m, o, x, t):
        o.zero_grad()
        loss = F.cross_entropy(m(x), t)
        loss.backward()
        o.step()
        return loss.detach()

    from kgen import backend

    before = len(backend.PARTITIONS)
    compiled_step = torch.compile(step, backend=backend.kgen_backend)
    for b in (4, 4, 5):
        x, t = torch.randn(b, 3, 8, 8), torch.randint(0, 5, (b,))
        torch.testing.assert_close(compiled_step(model, opt, x, t), step(reference, ref_opt, x, t), rtol=1e-5, atol=1e-6)
    _assert_same_state(model, reference)
    assert any(p["module"] and "conv2d" in p["calls"] for p in backend.PARTITIONS[before:])


def test_a_partition_whose_values_nothing_reads_is_not_built(cache):
    """A region whose results nothing reads (dead code here; in an optimizer's graph, in-place updates kept
    for their effect) is no partition: nothing built, the graph's result PyTorch's."""
    import torch.fx as fx

    from kgen import backend

    def f(x, w):
        y = F.conv2d(x, w)
        y.relu_()  # in place, and nothing reads y after it
        return (x + 1,)

    gm = fx.symbolic_trace(f)
    conv, relu_, add = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert [conv.target, relu_.target] == [F.conv2d, "relu_"]
    assert not backend._computes([conv, relu_])  # (torch 2.11's partitioner proposes such a region)
    assert backend._computes([conv]) and backend._computes([add])
    before = len(backend.PARTITIONS)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    fn = backend.kgen_backend(gm, [x, w])
    torch.testing.assert_close(fn(x, w)[0], x + 1)
    assert backend.PARTITIONS[before:] == []  # (each partition, built or eager, has its row)


def test_unsupported_call_runs_in_pytorch_and_the_rest_in_kgen(cache):
    from kgen import backend

    torch.manual_seed(2)
    model = _with_statistics(Split("cumprod")).eval()
    before = len(backend.PARTITIONS)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(model)(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert len(made) == 2 and all(p["module"] for p in made), made
    assert not any("cumprod" in p["calls"] for p in made)
    assert any("conv2d" in p["calls"] for p in made) and any("linear" in p["calls"] for p in made)


def test_graph_break(cache, capsys):
    from kgen import backend

    torch.manual_seed(3)
    model = _with_statistics(Split("print")).eval()
    before, graphs = len(backend.PARTITIONS), backend.STATS["graphs"]
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(model)(x), model(x), rtol=1e-4, atol=1e-5)
    assert "kgen test: a graph break" in capsys.readouterr().out
    assert backend.STATS["graphs"] == graphs + 2  # one graph before the print, one after it
    made = backend.PARTITIONS[before:]
    assert len(made) == 2 and all(p["module"] for p in made), made


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.randn(1, 4, 1, 1))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.conv(x)) * self.scale
        return y, torch.sigmoid(y).sum(1)


def test_partition_with_two_outputs_a_free_parameter_and_an_in_place_call(cache):
    from kgen import backend

    torch.manual_seed(5)
    model = TwoOutputs().eval()
    before = len(backend.PARTITIONS)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        got, want = _compiled(model)(x), model(x)
    assert len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert len(made) == 1 and made[0]["module"], made


@pytest.mark.parametrize("error", [KgenError("no family computes it (test)"), KeyError("linear0.bias")])
def test_partition_that_fails_stays_eager_with_one_line(cache, monkeypatch, capsys, error):
    """A partition kgen refuses, or one where kgen itself fails (a bug: said as such), runs eagerly; the model runs."""
    from kgen import backend, compiler

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(compiler, "compile_module", refuse)
    torch.manual_seed(4)
    model = _with_statistics(Net()).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(model)(x), model(x))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kgen: backend:")]
    said = "no family computes it (test)" if isinstance(error, KgenError) else \
        "kgen failed on it, a bug in kgen (KeyError: 'linear0.bias'); please report it"
    assert len(lines) == 1 and f"stays eager: {said}" in lines[0], lines
    assert backend.PARTITIONS[-1]["module"] is None


def test_unknown_option_or_mode_is_refused():
    from kgen.backend import kgen_backend
    from kgen.errors import KgenError

    gm = torch.fx.symbolic_trace(nn.ReLU())
    with pytest.raises(KgenError, match="unknown options fast; expected verbose, precision, intermediates, mode"):
        kgen_backend(gm, [torch.randn(2, 3)], options={"fast": True})
    with pytest.raises(KgenError, match="mode='reduce-overhead'; expected one of default, max-autotune"):
        kgen_backend(gm, [torch.randn(2, 3)], mode="reduce-overhead")
    with pytest.raises(KgenError, match="mode given twice"):
        kgen_backend(gm, [torch.randn(2, 3)], options={"mode": "max-autotune"}, mode="max-autotune")


def test_a_new_spatial_size_recompiles_and_its_dynamic_sizes_stay_eager_with_the_reason(cache, capsys):
    from kgen import backend

    torch.manual_seed(6)
    model = TwoOutputs().eval()
    compiled = _compiled(model)
    graphs = backend.STATS["graphs"]
    for shape in ((2, 3, 8, 8), (4, 3, 8, 8), (2, 3, 12, 12)):
        x = torch.randn(shape)
        with torch.no_grad():
            for g, w in zip(compiled(x), model(x)):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert backend.STATS["graphs"] == graphs + 2  # the batch: no recompile; the spatial size: one
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kgen: backend:") and "eager" in ln]
    assert len(lines) == 1 and "stay eager: sizes other than the batch are dynamic" in lines[0], lines
    assert "conv2d" in lines[0] and "dim 2, 3 dynamic" in lines[0], lines
    assert backend.PARTITIONS[-1]["module"] is None
    x = torch.randn(3, 3, 16, 16)  # the spatial size is dynamic now: no recompile, PyTorch computes it
    with torch.no_grad():
        torch.testing.assert_close(compiled(x)[0], model(x)[0], rtol=1e-4, atol=1e-5)
    assert backend.STATS["graphs"] == graphs + 2


def test_dynamic_false_keeps_the_batch_static(cache):
    from kgen import backend

    model = TwoOutputs().eval()
    from kgen.backend import kgen_backend

    compiled = torch.compile(model, backend=kgen_backend, dynamic=False)
    graphs = backend.STATS["graphs"]
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 8, 8)
            torch.testing.assert_close(compiled(x)[0], model(x)[0], rtol=1e-4, atol=1e-5)
    assert backend.STATS["graphs"] == graphs + 2  # a graph per batch, each from the same module
    assert backend.PARTITIONS[-1]["module"] == backend.PARTITIONS[-2]["module"] is not None

def test_a_value_computed_from_the_input_is_never_taken_as_a_parameter(cache):
    """With the batch static, the attention's output [S, B, E] of a batch-first encoder layer has no batch dim
    kgen can name; it was taken for a value computed from parameters alone (given to the op as a parameter) and
    its transpose back failed the import. It is the partition's input now, and the partition starts after it."""
    from kgen import backend
    from kgen.backend import kgen_backend

    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    compiled = torch.compile(model, backend=kgen_backend, dynamic=False)  # (training mode: no fused fast path)
    before = len(backend.PARTITIONS)
    x = torch.randn(4, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert [p["module"] is not None for p in made] == [True], made
    assert made[0]["calls"][-2:] == ["add", "layer_norm"], made



def test_fullgraph_refuses_a_partition_that_would_stay_eager(cache, monkeypatch):
    from kgen import compiler
    from kgen.backend import kgen_backend
    from kgen.errors import KgenError

    def refuse(*args, **kwargs):
        raise KgenError("no family computes it (test)")

    monkeypatch.setattr(compiler, "compile_module", refuse)
    model = _with_statistics(Net()).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), pytest.raises(Exception, match=r"fullgraph=True: partition \(conv2d, batch_norm.*would stay "
                                                        r"eager: no family computes it \(test\)"):
        torch.compile(model, backend=kgen_backend, fullgraph=True)(x)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="fullgraph=True: .*sizes other than the batch are dynamic"):
        torch.compile(model, backend=kgen_backend, fullgraph=True, dynamic=True)(x)


def test_precision_option_reaches_the_partitions_spec(cache, monkeypatch):
    from kgen import compiler
    from kgen.backend import kgen_backend
    from kgen.errors import KgenError

    asked = []

    def record(*args, **kwargs):
        asked.append(kwargs.get("precision"))
        raise KgenError("recorded (test)")

    monkeypatch.setattr(compiler, "compile_module", record)
    model = _with_statistics(Net()).eval()
    with torch.no_grad():
        torch.compile(model, backend=kgen_backend, options={"precision": "tf32x3", "verbose": False})(torch.randn(2, 3, 8, 8))
    assert asked == ["tf32x3"]


@pytest.mark.parametrize("how", ["mode", "options"])
def test_max_autotune_on_the_cpu_says_once_that_it_has_nothing_to_tune(cache, capsys, how):
    from kgen import backend
    from kgen.backend import kgen_backend

    backend._SAID.clear()
    torch.manual_seed(7)
    model = _with_statistics(Split("print")).eval()  # two graphs, a partition each
    kw = {"mode": "max-autotune"} if how == "mode" else {"options": {"mode": "max-autotune"}}
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=kgen_backend, **kw)(x), model(x), rtol=1e-4, atol=1e-5)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "max-autotune" in ln]
    assert lines == ["kgen: backend: mode max-autotune: nothing to tune on the CPU (kgen tune measures plans on a "
                     "CUDA GPU); the cost model's plans run"], lines


def test_backend_resolves_through_the_entry_point(cache, tmp_path):
    """The package's torch_dynamo_backends entry point names the backend; torch finds it by name without
    kgen imported first (an installed distribution's entry points, written here as pip writes them)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["torch_dynamo_backends"]
    assert eps == {"kgen": "kgen.backend:kgen_backend"}
    dist = tmp_path / "kgen_backend_test-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kgen-backend-test\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[torch_dynamo_backends]\nkgen = kgen.backend:kgen_backend\n")
    script = textwrap.dedent("""
        import sys, torch
        assert "kgen" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        assert "kgen" not in sys.modules
        from torch._dynamo.backends.registry import lookup_backend
        import kgen.backend
        assert lookup_backend("kgen") is kgen.backend.kgen_backend
        from test_backend import Net  # its partition is in the cache already when the tests above ran
        model = Net().eval()
        x = torch.randn(4, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="kgen", options={"verbose": False})(x), model(x))
        assert kgen.backend.PARTITIONS and kgen.backend.PARTITIONS[-1]["module"], kgen.backend.PARTITIONS
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "tests")])}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_a_second_process_traces_a_frame_once_with_the_batch_dynamic(cache, tmp_path):
    """The first process's backend asks Dynamo for the batch as a symbol (Dynamo traces the frame twice, static
    then symbolic) and records the frame in kgen's cache; a second process starts that frame with the batch dynamic
    and Dynamo traces it once (the backend called once), its partition loaded from the cache; a new batch does not
    recompile there either."""
    script = textwrap.dedent("""
        import torch
        from torch._dynamo.utils import counters
        from kgen.backend import kgen_backend
        from test_backend import Net
        calls = []
        def backend(gm, examples):
            calls.append(gm)
            return kgen_backend(gm, examples, options={"verbose": False})
        model = Net().eval()
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            for batch in (4, 6):
                x = torch.randn(batch, 3, 8, 8)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        print("backend calls", len(calls), "graphs", counters["stats"]["unique_graphs"])
    """)
    own = tmp_path / "cache"  # this module's builds, but no frames recorded by the tests before
    own.mkdir()
    for kind in ("compiled", "pch"):
        (cache / kind).mkdir(exist_ok=True)
        (own / kind).symlink_to(cache / kind)
    env = {**os.environ, "KGEN_CACHE": str(own), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    lines = [r.stdout.strip().splitlines()[-1] for r in runs]
    assert lines == ["backend calls 2 graphs 1", "backend calls 1 graphs 1"], lines


class CausalAttention(nn.Module):
    """KernelBench level 3's MinGPT attention in small: ``B, T, C = x.size()``, split, heads by view and
    transpose, a causal mask read from a buffer sliced to the run-time T."""

    def __init__(self, embed=8, heads=2, most=6):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(embed, 3 * embed)
        self.register_buffer("bias", torch.tril(torch.ones(most, most)).view(1, 1, most, most))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return y.transpose(1, 2).contiguous().view(B, T, C)


def test_attention_whose_trace_changes_with_a_dynamic_batch(cache):
    """Asking Dynamo for a dynamic batch retraces the frame along other steps (the sizes are symbols):
    what Dynamo remembered of the first trace must not make it fail ("SpeculationLog diverged")."""
    from kgen import backend

    torch.manual_seed(6)
    model = CausalAttention()
    compiled = _compiled(model)
    before = len(backend.PARTITIONS)
    for batch in (2, 3):
        x = torch.randn(batch, 5, 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert any(p["module"] for p in made), made
    assert not any("masked_fill" in p["calls"] for p in made if p["module"])  # the buffer's mask: PyTorch's


class Around(nn.Module):
    """A partition reading another partition's output around a call left to PyTorch (cumprod): the partitioner
    cannot merge them (the merged one would both feed and read the cumprod)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 4)

    def forward(self, x):
        y = torch.relu(self.fc1(x))
        return self.fc2(y + torch.cumprod(y, 1))


def test_partition_reading_another_partitions_output(cache):
    from kgen import backend

    torch.manual_seed(7)
    model = Around()
    before = len(backend.PARTITIONS)
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(model)(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert len(made) == 2 and all(p["module"] for p in made), made
    assert any("add" in p["calls"] and "linear" in p["calls"] for p in made), made


class DenseLayers(nn.Module):
    """DenseNet's dense block in small: each layer reads the cat of the input and every earlier layer's output.
    The cumprod after each layer (eager) ends the partitions there, so each cat reads its tensors as the
    partition's inputs: the 8th layer's takes 8, the last cat 9 (more than the 8 a spec took before). 8 layers,
    not more: each partition is a module of its own to build (about 4 s each on the CI machine)."""

    def __init__(self, layers=8, channels=3, growth=2):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels + i * growth, growth, 3, padding=1) for i in range(layers))

    def forward(self, x):
        features = [x]
        for conv in self.convs:
            features.append(torch.cumprod(torch.relu(conv(torch.cat(features, 1))), 3))
        return torch.cat(features, 1)


@pytest.mark.slow
def test_dense_layers_cat_of_many_inputs_are_kgen_partitions(cache):
    torch.manual_seed(0)
    made = [p for p in _partitions_of(DenseLayers().eval(), torch.randn(2, 3, 4, 4)) if "cat" in p["calls"]]
    assert len(made) == 9 and all(p["module"] is not None for p in made), made


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit (torchvision): half the channels through a branch, the other half as they are, then the
    channel shuffle (views and a transpose); its pieces from x.chunk (or torch.split into two sizes)."""

    def __init__(self, split: bool = False):
        super().__init__()
        self.split = split
        self.conv = nn.Conv2d(8, 8, 1)
        self.branch = nn.Sequential(nn.Conv2d(3 if split else 4, 5 if split else 4, 1), nn.BatchNorm2d(5 if split else 4),
                                    nn.ReLU())

    def forward(self, x):
        x = self.conv(x)
        x1, x2 = torch.split(x, [5, 3], dim=1) if self.split else x.chunk(2, dim=1)
        out = torch.cat((x1, self.branch(x2)), dim=1)
        n, c, h, w = out.size()
        return out.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


@pytest.mark.parametrize("split", [False, True])
def test_chunk_and_split_pieces_are_in_the_partition(cache, split):
    """torch.chunk / torch.split and the getitems of their pieces are kgen's (slices): one partition, not one on
    each side of the split (ShuffleNetV2 was 14 partitions, one per unit)."""
    torch.manual_seed(0)
    (one,) = _partitions_of(_with_statistics(ShuffleUnit(split)).eval(), torch.randn(2, 8, 5, 5))
    assert one["module"] is not None and ("split" if split else "chunk") in one["calls"], one


class PooledHead(nn.Module):
    """A CNN's classifier head as torchvision's EfficientNet writes it: pooled features flattened (a view), an
    in-place dropout (random in training mode: PyTorch's, after the partition), then the linear layer."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.drop, self.fc = nn.Dropout(0.2, inplace=True), nn.Linear(6, 4)

    def forward(self, x):
        x = torch.flatten(F.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 1), 1)
        return self.fc(self.drop(x))


def test_an_in_place_call_on_a_partitions_flattened_result_trains_as_eager(cache):
    """A training step where the partition's result is a view (the flatten at its end) that the graph then
    modifies in place: autograd refused that on the op's view; the loss and the gradients are eager's."""
    torch.manual_seed(0)
    model = PooledHead().train()
    reference = copy.deepcopy(model)
    x, target = torch.randn(4, 3, 5, 5), torch.randint(0, 4, (4,))
    losses = []
    for m in (_compiled(model), reference):
        torch.manual_seed(1)  # the same dropout mask
        loss = F.cross_entropy(m(x), target)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


class TokenModel(nn.Module):
    """A language model's shape: token ids [B, S] (int64) in, an embedding (PyTorch's), then float layers."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(50, 16), nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, ids):
        h = self.norm(self.emb(ids))
        return h + self.down(F.gelu(self.up(h)))


def test_a_model_of_token_ids_has_its_float_layers_in_a_partition(cache):
    """The graph's only input is integer (token ids): the batch is its dim 0, the values kgen computes the
    parameters' dtype (BERT, GPT-2 and Llama made no partition at all before)."""
    torch.manual_seed(0)
    made = _partitions_of(TokenModel().eval(), torch.randint(0, 50, (2, 7)))
    assert len(made) == 1 and made[0]["module"] is not None and "layer_norm" in made[0]["calls"], made


class FirstCacheStep(nn.Module):
    """A key-value cache's first step (transformers' DynamicCache): the keys so far are `torch.tensor([])`, and
    torch.cat skips that 1-d empty piece beside the new keys [B, heads, S, d]."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(16, 16)

    def forward(self, x):
        k = self.k(x).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)
        keys = torch.cat([torch.tensor([], dtype=k.dtype, device=k.device), k], dim=-2)
        return torch.relu(keys) * 2


def test_a_caches_empty_first_piece_is_left_out_of_the_cat(cache):
    """The empty piece is no input of the partition (a parameter of shape [0] refused the whole partition)."""
    torch.manual_seed(0)
    (made,) = _partitions_of(FirstCacheStep().eval(), torch.randn(2, 5, 16))
    assert made["module"] is not None and "cat" in made["calls"], made


class RunningSums(nn.Module):
    """Mamba2's segment sums in small: a projection, its exponent's running sum along the sequence, differences of
    it, then another projection."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        s = torch.cumsum(self.a(x).sigmoid(), dim=1)
        return self.b(torch.relu(s - s.mean(dim=1, keepdim=True)))


def test_cumsum_is_in_the_partition(cache):
    """torch.cumsum is a kgen op (an ATen stage in the module): the model is one partition, not two around it."""
    torch.manual_seed(0)
    (made,) = _partitions_of(RunningSums().eval(), torch.randn(2, 6, 8))
    assert made["module"] is not None and "cumsum" in made["calls"], made


class ZeroDropout(nn.Module):
    """DenseNet's layer: a convolution, nn.Dropout(0.0) (x itself, also in training mode), a ReLU, then a
    convolution."""

    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.0), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.b(torch.relu(self.drop(self.a(x))))


def test_dropout_of_zero_in_training_mode_is_in_the_partition(cache):
    """Dropout with p = 0 is deterministic in training mode too: one partition, the dropout in it; with p > 0
    the dropout stays eager (random) and cuts the model in two."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5)
    (one,) = _partitions_of(ZeroDropout().train(), x)
    assert one["module"] is not None and "dropout" in one["calls"], one
    torch._dynamo.reset()
    random = ZeroDropout().train()
    random.drop.p = 0.5
    from kgen import backend

    before = len(backend.PARTITIONS)
    with torch.no_grad():
        _compiled(random)(x)
    made = backend.PARTITIONS[before:]
    assert len(made) == 2 and not any("dropout" in p["calls"] for p in made), made


class HandLinear(nn.Module):
    """A Linear without bias written by hand (KernelBench level 2 #14's form): Dynamo's graph reads the
    weight as getattr(weight, 'T')."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 6))

    def forward(self, x):
        return torch.relu(torch.matmul(x, self.weight.T))


def test_matmul_by_a_parameters_transpose_is_a_kgen_partition(cache):
    torch.manual_seed(0)
    made = _partitions_of(HandLinear().eval(), torch.randn(3, 6))
    assert len(made) == 1 and made[0]["module"] is not None and made[0]["calls"] == ["getattr", "matmul", "relu"], made


class Patches(nn.Module):
    """ViT's patch embedding: the image unfolded into patches, a 6-d value kgen has no dims for."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3 * 4 * 4, 8)

    def forward(self, x):
        p = x.unfold(2, 4, 4).unfold(3, 4, 4)  # [N, 3, 2, 2, 4, 4]
        p = p.reshape(x.shape[0], 3, 4, 16).permute(0, 2, 1, 3).reshape(x.shape[0], 4, 48)
        return torch.relu(self.proj(p))


def test_a_value_of_more_dims_than_kgens_stays_eager_and_the_rest_is_a_partition(cache):
    torch.manual_seed(0)
    made = _partitions_of(Patches().eval(), torch.randn(2, 3, 8, 8))
    assert made and all(p["module"] is not None for p in made), made  # none refused for a 6-d input
    assert any("linear" in p["calls"] for p in made), made


class TokenPool(nn.Module):
    """Swin's head: tokens [N, L, C] transposed, an adaptive average pool over L, flattened, a linear layer
    (Dynamo hands the pool over as the builtin torch.adaptive_avg_pool1d, whose arguments have no signature)."""

    def __init__(self):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.flatten(self.avgpool(x.transpose(1, 2)), 1))


def test_adaptive_pool_builtin_is_a_kgen_partition(cache):
    torch.manual_seed(0)
    made = _partitions_of(TokenPool().eval(), torch.randn(2, 7, 16))
    assert len(made) == 1 and made[0]["module"] is not None and "adaptive_avg_pool1d" in made[0]["calls"], made


class ClassToken(nn.Module):
    """CvT's and ViT's class token (KernelBench level 3 #32, #28): a parameter expanded to the batch and put
    before the patches' embeddings, then the head on the token."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=2, stride=2)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.fc_out = nn.Linear(8, 5)

    def forward(self, x):
        B = x.size(0)
        x = self.conv1(x).flatten(2).transpose(1, 2)  # (B, 4, 8)
        cls_tokens = self.cls_token.expand(B, -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)  # (B, 5, 8)
        return self.fc_out(F.gelu(x)[:, 0])


@pytest.mark.parametrize("dynamic", [None, False])
def test_parameter_expanded_to_the_batch_before_a_cat_is_a_kgen_partition(cache, dynamic):
    """The expand of the class token is the IR's expand of a parameter (any batch; with dynamic=False the
    graph's batch is a number, read as the input's batch); the whole graph is one partition."""
    from kgen import backend

    torch.manual_seed(0)
    model = ClassToken().eval()
    compiled = torch.compile(model, backend=backend.kgen_backend, dynamic=dynamic)
    before = len(backend.PARTITIONS)
    for batch in (2, 3):
        x = torch.randn(batch, 3, 4, 4)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert made and all(p["module"] is not None for p in made), made
    assert all(p["calls"] == ["conv2d", "flatten", "transpose", "expand", "cat", "gelu", "getitem", "linear"]
               for p in made), made


class VisionAttention(nn.Module):
    """KernelBench level 3 #31's layout: nn.MultiheadAttention without batch_first reads (seq, batch, embed)
    after a permute; the residual add and the layer norm run on sequence-first values, then a permute puts the
    batch first again."""

    def __init__(self, embed_dim=8, num_heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x):
        B, C, H, W = x.shape
        x = x.view(B, C, H * W).permute(2, 0, 1)  # (seq_len, batch_size, embed_dim)
        attn_output, _ = self.attn(x, x, x)
        x = self.norm(attn_output + x)
        return x.permute(1, 2, 0).view(B, C, H, W)


def test_sequence_first_values_after_attention_are_a_kgen_partition(cache):
    """Dynamo's multi_head_attention_forward stays eager (kgen has no call for it); what follows it, on values
    whose batch is dim 1, is one partition computed with the batch moved first."""
    torch.manual_seed(0)
    made = _partitions_of(VisionAttention().eval(), torch.rand(2, 8, 4, 4))
    assert [p["calls"] for p in made] == [["add", "layer_norm", "permute", "view"]] and made[0]["module"], made


class SequenceFirstOut(nn.Module):
    """A sequence-first region whose result stays sequence-first: a linear layer, a parameter broadcast over the
    last dim and a residual on [L, B, C], then a call kgen has no op for (cumprod over the sequence)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x):
        s = x.permute(2, 0, 1)  # (L, B, C)
        h = torch.relu(self.fc(s)) * self.scale + s
        return torch.cumprod(h, 0)  # over the sequence: eager PyTorch's, on the result moved back to (L, B, C)


def test_sequence_first_result_moves_back_and_trains_as_eager(cache):
    from kgen import backend

    torch.manual_seed(0)
    model = SequenceFirstOut()
    reference = copy.deepcopy(model)
    before = len(backend.PARTITIONS)
    compiled = _compiled(model)
    for batch in (3, 2):
        x = torch.randn(batch, 6, 5)
        y, want = compiled(x), reference(x)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
        y.square().sum().backward()
        want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}.grad: {m}")
    made = backend.PARTITIONS[before:]
    assert made and all(p["module"] for p in made), made
    assert all(p["calls"] == ["permute", "linear", "relu", "mul", "add"] for p in made), made


class BothBroadcast(nn.Module):
    """Both operands of a product broadcast ([B, 1, C] * [B, N, 1], as NetVLAD's and Mamba2's)."""

    def forward(self, x):
        g = x.mean(1, keepdim=True)  # (B, 1, C)
        s = torch.sigmoid(x.sum(2, keepdim=True))  # (B, N, 1)
        return torch.relu(g * s) - s / (g.abs() + 1)


def test_binary_op_broadcasting_both_operands_is_a_kgen_partition(cache):
    torch.manual_seed(0)
    made = _partitions_of(BothBroadcast().eval(), torch.randn(3, 5, 4))
    assert len(made) == 1 and made[0]["module"] is not None and "mul" in made[0]["calls"], made


class BatchFirstAttention(nn.Module):
    """nn.TransformerEncoderLayer with batch_first (CvT, KernelBench level 3 #32) after a cat: Dynamo's graph
    transposes the cat's result to (seq, batch, embed) for multi_head_attention_forward and keeps it for the
    residual."""

    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        x = torch.cat((self.cls_token.expand(x.size(0), -1, -1), x), dim=1)
        return self.layer(x)


def test_transpose_that_only_moves_the_batch_stays_a_view_of_pytorch(cache):
    """A transpose that moves the batch from dim 0 without changing the batch-first order is not taken (kgen's
    op would return its input twice): the cat before it and the layers after the attention are partitions."""
    torch.manual_seed(0)
    made = _partitions_of(BatchFirstAttention().train(), torch.randn(3, 4, 8))
    assert made and all(p["module"] for p in made), made
    assert not any("transpose" in p["calls"] for p in made) and any("cat" in p["calls"] for p in made), made


class MinWithConstant(nn.Module):
    """KernelBench level 2 #93's clamp: ``torch.min`` with a tensor made in forward on the input's device, which
    Dynamo's graph holds as a constant device (cuda:0 on a GPU)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x = torch.min(self.conv(x) + 0.5, torch.tensor(0.0, device=x.device))
        return F.gelu(x) * 2.0


@pytest.mark.parametrize("device", [pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else []) for d in DEVICES])
def test_a_tensor_made_on_the_inputs_device_is_in_the_partition(cache, device):
    """The partition is imported on the meta device: the constant is made where its input is, as the model's
    ``x.device`` (on a GPU its cuda:0 beside meta values failed, and the partition stayed eager)."""
    torch.manual_seed(0)
    made = _partitions_of(MinWithConstant().to(device).eval(), torch.randn(2, 3, 8, 8, device=device))
    assert len(made) == 1 and made[0]["module"] is not None and "min" in made[0]["calls"], made


class ConvRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)) * 2.0


@pytest.mark.eager_fallback
def test_a_partition_whose_plan_is_eager_stays_pytorchs(cache, monkeypatch):
    """Where the cost model (or a tuning file) finds the partition's own ops through ATen its fastest plan, the
    partition stays PyTorch's, with the reason: a generated op would only wrap the same kernels. Nothing is built."""
    from kgen import backend, cost

    monkeypatch.setattr(cost, "estimate_ms", lambda plan, batch: 0.0 if plan.eager else 1.0)
    builds = []
    monkeypatch.setattr(backend, "_build_together", lambda dirs, failures, verbose: builds.extend(dirs))
    graphs = []

    def kept(gm, example_inputs):  # the backend, keeping the calls of the graph it rewrote
        compiled = backend.kgen_backend(gm, example_inputs)
        graphs.append([(n.op, str(n.target)) for n in gm.graph.nodes])
        return compiled

    model, x = ConvRelu().eval(), torch.randn(3, 3, 6, 6)
    before = len(backend.PARTITIONS)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=kept)(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert made and all(p["module"] is None for p in made), made
    assert made[0]["reason"].startswith("its fastest plan is its own ops through ATen (cost model: "), made
    assert builds == []
    # its calls are back in the graph: no submodule call wraps them
    assert graphs
    for nodes in graphs:
        assert not [n for n in nodes if n[0] == "call_module"] and ("call_function", str(F.conv2d)) in nodes, nodes


@pytest.mark.eager_fallback
def test_a_partition_whose_plan_ties_its_own_ops_through_aten_stays_pytorchs(cache, monkeypatch):
    """A partition whose plan the cost model puts at the same time as its own ops through ATen (the same work, as a
    lone elementwise op's) stays PyTorch's, with the reason."""
    from kgen import cost

    monkeypatch.setattr(cost, "estimate_ms", lambda plan, batch: 1.0)
    made = _partitions_of(ConvRelu().eval(), torch.randn(3, 3, 7, 7))  # (a size of its own: a partition of its own)
    assert made and all(p["module"] is None for p in made), made
    assert made[0]["reason"].startswith("its own ops through ATen are as fast as its plan (cost model: 1.000 ms"), made


def test_the_op_replays_on_a_gpu_where_the_graph_records_no_autograd():
    """_replay_applies: CUDA examples (fake ones here) and autograd off, or nothing requiring grad; never on the
    CPU (the op replays CUDA graphs only)."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from kgen import backend

    with FakeTensorMode():
        x, w = torch.empty(2, 3, device="cuda"), torch.empty(3, 3, device="cuda", requires_grad=True)
    trained, frozen, cpu = ({"x": x, "w": w}, {"x": x}, {"x": torch.empty(2, 3)})
    applies = lambda examples: backend._replay_applies(SimpleNamespace(examples=examples))  # noqa: E731
    assert not applies(trained) and applies(frozen) and not applies(cpu)
    with torch.no_grad():
        assert applies(trained) and applies(frozen) and not applies(cpu)


@pytest.mark.eager_fallback
def test_an_eager_plan_that_a_cuda_graph_replay_speeds_up_is_a_kgen_op(cache, monkeypatch):
    """Where the op replays its kernels as one CUDA graph (on a GPU, autograd off: patched here, on the CPU) and
    the replay saves more dispatch than it costs (an RNN's small steps), a partition whose fastest plan is its
    own ops through ATen is still kgen's op: that replay. Where the replay would not run, it stays PyTorch's."""
    from kgen import backend, cost

    monkeypatch.setattr(cost, "estimate_ms", lambda plan, batch: 0.0 if plan.eager else 1.0)
    for replays in (False, True):
        torch._dynamo.reset()
        monkeypatch.setattr(backend, "_replay_applies", lambda g: replays)
        torch.manual_seed(0)
        made = _partitions_of(RNNCell().eval(), torch.randn(6, 7, 6), torch.randn(7, 5))
        assert len(made) == 1 and bool(made[0]["module"]) == replays, made
        if not replays:
            assert made[0]["reason"].startswith("its fastest plan is its own ops through ATen"), made


class RNNCell(nn.Module):
    """KernelBench level 3 #34's layout: a sequence-first input x [S, B, E] beside a batch-first state h0 [B, H];
    every computed value, from the steps x[t] on, leads with the batch B (its stack over the steps leads with S)."""

    def __init__(self, e=6, h=5, o=4):
        super().__init__()
        self.i2h = nn.Linear(e + h, h)
        self.h2o = nn.Linear(h, o)

    def forward(self, x, h0):
        hidden, outputs = h0, []
        for t in range(x.size(0)):
            hidden = torch.tanh(self.i2h(torch.cat((x[t], hidden), dim=1)))
            outputs.append(self.h2o(hidden))
        return torch.stack(outputs, dim=0)


def test_sequence_first_input_beside_a_batch_first_state_takes_the_states_batch(cache):
    """The batch is the size most values lead with (the state's B, not x's S): the unrolled steps are one
    partition (with x's S as the batch, none of them was kgen's)."""
    torch.manual_seed(0)
    model = RNNCell().eval()
    made = _partitions_of(model, torch.randn(3, 7, 6), torch.randn(7, 5))
    assert len(made) == 1 and made[0]["module"], made
    assert made[0]["calls"] == ["cat", "linear", "tanh", "linear"] * 3, made


def test_unrolled_steps_that_return_more_values_than_an_op_may_are_cut_into_partitions(cache):
    """48 steps keep 48 outputs (KernelBench #34 keeps 256), more than a kgen op returns (spec.MAX_OUTPUTS):
    the steps are cut in graph order into partitions that each return at most that many, all kgen's (the whole
    stayed eager before, 'forward returns 48 values'); the pieces alike between the first and the last are one
    module, built once."""
    from kgen.spec import MAX_OUTPUTS

    torch.manual_seed(0)
    steps = 3 * MAX_OUTPUTS
    made = _partitions_of(RNNCell().eval(), torch.randn(steps, 7, 6), torch.randn(7, 5))
    assert len(made) == 4 and all(p["module"] for p in made), made
    calls = [c for p in made for c in p["calls"]]
    assert sorted(calls) == sorted(["cat", "linear", "tanh", "linear"] * steps)
    assert made[1]["module"] == made[2]["module"] and len({p["module"] for p in made}) == 3, made


class Windows(nn.Module):
    """Swin's window attention in small: a view folds the batch with the windows into dim 0 ([4 * B, 16, C])."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):  # [B, 8, 8, C]
        b, h, w, c = x.shape
        win = x.view(b, 2, 4, 2, 4, c).transpose(2, 3).reshape(-1, 16, c)
        y = self.out(torch.relu(self.fc(self.ln(win))).softmax(-1)) + win
        return y.view(b, 2, 2, 4, 4, c).transpose(2, 3).reshape(b, h, w, c)


def test_values_whose_dim_0_folds_the_batch_with_windows_are_a_kgen_partition(cache):
    """The partition's batch is 4 * B (the views that fold and unfold it stay PyTorch's): its spec is made for
    the seen 4 * 3 and its op takes a new batch without a recompile (all of it stayed eager before: 'dim 0
    dynamic')."""
    from kgen import backend

    torch.manual_seed(0)
    model = Windows().eval()
    before = len(backend.PARTITIONS)
    compiled = _compiled(model)
    with torch.no_grad():
        for batch in (3, 5):
            x = torch.randn(batch, 8, 8, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert [p["calls"] for p in made] == [["layer_norm", "linear", "relu", "softmax", "linear", "add"]], made
    assert made[0]["module"], made
    spec = yaml.safe_load(Path(made[0]["spec"]).read_text())
    assert spec["input"]["shape"] == ["N", 16, 8] and spec["input"]["example"] == {"N": 12}, spec["input"]


class CosineWindowAttention(nn.Module):
    """SwinV2's window attention (KernelBench level 3 #30) in small: the windows folded into dim 0 by a size
    computed from the batch (``int(x.shape[0] * 4 / 4)``), q, k and v indexed out of a permute that moves the
    batch to dim 1, a bias and a logit scale computed from parameters, a mask buffer, F.normalize."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.logit_scale = nn.Parameter(torch.randn(2, 1, 1))
        self.register_buffer("mask", torch.randn(4, 6, 6))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # [B, 4 windows, 6 tokens, C]
        b = int(x.shape[0] * 4 / 4)  # Dynamo writes it as TruncToInt(FloatTrueDiv(...)): the batch
        x = x.reshape(-1, 6, 8)
        windows, n, c = x.shape
        bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).reshape(windows, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=2.0).exp()
        attn = attn.view(b, 4, 2, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, 2, n, n).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(windows, n, c)).view(b, 4, n, c)


def test_sizes_written_in_the_batch_are_compared_by_their_values():
    """Dynamo writes ``int(64 * s / 64)`` as TruncToInt(FloatTrueDiv(...)), which sympy leaves as it is: a size is
    the batch, a multiple of it or a constant by its values at several batches."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.functions import FloatTrueDiv, FloorDiv, ToFloat, TruncToInt
    from kgen.backend import _batch_multiple, _same_size, _static

    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    s = env.create_symbol(4, ConstantSource("batch"))
    size = lambda expr: env.create_symintnode(sympy.sympify(expr), hint=None)  # noqa: E731
    batch = size(s)
    folded = TruncToInt(FloatTrueDiv(ToFloat(64 * s), 64.0))
    assert _same_size(size(folded), batch) and not _same_size(size(folded + 1), batch)
    assert _static(size(FloorDiv(8 * s, folded))) == 8 and _static(size(FloorDiv(s, 4))) is not None
    assert isinstance(_static(size(FloorDiv(s, 4))), torch.SymInt)
    assert _batch_multiple(size(64 * folded), batch) == 64 and _batch_multiple(size(FloorDiv(s, 4)), batch) is None
    assert _batch_multiple(size(2 * s + 1), batch) is None


@pytest.mark.parametrize("idx, k_in", [(0, 1), (-1, 2), ((slice(None), 1), 0), ((1, slice(None), 2), 1),
                                        ((slice(1, 3), slice(None), -2), 1), ((2,), 3), ((0, 1), 2)])
def test_an_index_of_a_value_whose_batch_is_not_first_is_renamed_batch_first(idx, k_in):
    """x[idx] of a value whose batch is dim k_in, computed on the value with its batch moved first (the partition's
    form): the same values, the result's batch first."""
    from kgen.backend import _index_batch_first

    x = torch.randn(4, 5, 6, 7)
    result = x[idx]
    k_out = k_in - sum(isinstance(i, int) for i in (idx if isinstance(idx, tuple) else (idx,))[:k_in])
    moved = _index_batch_first(idx, x.dim(), k_in, k_out)
    assert torch.equal(x.movedim(k_in, 0)[moved], result.movedim(k_out, 0))
    assert _index_batch_first(idx, x.dim(), k_in, k_out + 1) is None  # (where the batch would not be)
    assert _index_batch_first((slice(None),) * k_in + (1,), x.dim(), k_in, k_in) is None  # an index into the batch


def test_swin_v2_window_attention_is_kgen_partitions(cache):
    """Every call of the attention is in a kgen partition but the views that fold and unfold the batch and the
    computations on parameters alone: q, k and v indexed out of a value whose batch is dim 1 (taken batch first),
    the bias, logit scale and mask given to the ops at each call (all of it stayed eager before: 'dim 1
    dynamic'), F.normalize as PyTorch computes it; at a new batch and with new parameter values, eager's values."""
    torch.manual_seed(0)
    model = CosineWindowAttention().eval()
    x = torch.randn(3, 4, 6, 8)
    x[0, 0, 0] = 0  # a token whose q and k are the bias alone
    made = _partitions_of(model, x)
    assert made and all(p["module"] for p in made), made
    compiled, x = _compiled(model), torch.randn(5, 4, 6, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        model.logit_scale.mul_(-1)
        model.mask.normal_()
        model.q_bias.normal_()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    calls = [c for p in made for c in p["calls"]]
    for call in ("linear", "permute", "getitem", "normalize", "matmul", "mul", "add", "softmax"):
        assert call in calls, (call, made)
    assert "cat" not in calls and "exp" not in calls and "clamp" not in calls  # (parameters alone: PyTorch's)


def test_swin_v2_window_attention_trains_as_eager(cache):
    """The gradients reach the parameters the computed operands come from (the biases' cat, the logit scale)."""
    torch.manual_seed(0)
    model = CosineWindowAttention().train()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 6, 8)
    _compiled(model)(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item(), msg=name)


class RMSNormBlock(nn.Module):
    """LLaMA's RMSNorm before a linear layer, and an L2-normalized projection."""

    def __init__(self):
        super().__init__()
        self.weight, self.fc = nn.Parameter(torch.rand(16) + 0.5), nn.Linear(16, 8)

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        y = self.fc(x)
        return y / y.norm(dim=-1, keepdim=True)


def test_rms_norm_and_an_l2_norm_are_one_partition(cache):
    from kgen import backend

    torch.manual_seed(0)
    made = _partitions_of(RMSNormBlock().eval(), torch.randn(3, 5, 16))
    assert [p["calls"] for p in made] == [["pow", "mean", "add", "rsqrt", "mul", "mul", "linear", "norm", "truediv"]], made
    assert made[0]["module"], made


class StandardizedConv(nn.Module):
    """A convolution whose weight and bias are computed from parameters at each call (weight standardization)."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(6, 3, 3, 3)), nn.Parameter(torch.randn(6))
        self.ln = nn.LayerNorm(6)

    def forward(self, x):
        w = (self.w - self.w.mean(dim=(1, 2, 3), keepdim=True)) / (self.w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return self.ln(torch.relu(F.conv2d(x, w, self.b * 2, padding=1)).permute(0, 2, 3, 1))


def test_a_layer_whose_weight_is_computed_from_parameters_is_in_the_partition_and_trains(cache):
    """The computed weight and bias are the op's parameters at each call: the convolution is in the partition,
    and the gradients that reach the parameters through them are as close to float64's as eager's."""
    from kgen import backend

    torch.manual_seed(0)
    model = StandardizedConv()
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    before = len(backend.PARTITIONS)
    compiled = _compiled(model)
    x = torch.randn(3, 3, 8, 8)
    compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    exact(x.double()).square().sum().backward()
    assert [p["calls"] for p in backend.PARTITIONS[before:]] == [["conv2d", "relu", "permute", "layer_norm"]]
    for (name, p), q, d in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        error, eager_error = ((t.grad.double() - d.grad).abs().max().item() for t in (p, q))
        assert error <= 2 * eager_error + 1e-6 * d.grad.abs().max().item(), (name, error, eager_error)


class CountedScale(nn.Module):
    """A buffer the forward reads and then updates in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        y = torch.relu(self.fc(x)) * self.scale
        self.scale.add_(1.0)
        return y


def test_a_buffer_the_graph_updates_is_not_given_to_a_partition(cache):
    """The op would read the buffer wherever the partition runs; read before its update, it stays PyTorch's."""
    from kgen import backend

    torch.manual_seed(0)
    model, eager = CountedScale(), CountedScale()
    eager.load_state_dict(model.state_dict())
    before = len(backend.PARTITIONS)
    compiled = _compiled(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            torch.testing.assert_close(compiled(x), eager(x))
    assert all("mul" not in p["calls"] for p in backend.PARTITIONS[before:]), backend.PARTITIONS[before:]
    torch.testing.assert_close(model.scale, eager.scale)


@pytest.mark.eager_fallback  # (the projections' tiny partitions stay eager: nothing to build)
def test_causal_attention_runs_as_pytorchs_fused_call_between_the_partitions(cache, capsys):
    """MinGPT's written-out attention is F.scaled_dot_product_attention before partitioning (kgen.attention):
    no partition holds its softmax, the model computes what eager does, and a line says so."""
    from test_attention import CausalAttention

    torch.manual_seed(0)
    made = _partitions_of(CausalAttention().eval(), torch.randn(3, 12, 16))
    assert made and not any("softmax" in p["calls"] or "masked_fill" in p["calls"] for p in made), made
    assert "as scaled_dot_product_attention" in capsys.readouterr().err


class Fire(nn.Module):
    """SqueezeNet's fire module (KernelBench level 3 #17) in small."""

    def __init__(self):
        super().__init__()
        self.squeeze, self.e1, self.e3 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 6, 1), nn.Conv2d(4, 6, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.e1(x)), torch.relu(self.e3(x))], 1)


def test_a_partitions_nodes_are_taken_in_dynamos_order():
    """torch 2.11's fusing put both expand convolutions of a fire module before their ReLUs, and the plan then
    could not make each ReLU its convolution's epilogue: the partition's model follows the graph's order."""
    import torch.fx as fx
    from kgen import backend

    gm = fx.symbolic_trace(Fire())
    names = [n.name for n in gm.graph.nodes if n.op != "placeholder"]
    assert names == ["squeeze", "relu", "e1", "relu_1", "e3", "relu_2", "cat", "output"], names
    by_name = {n.name: n for n in gm.graph.nodes}
    shuffled, env = fx.Graph(), {}  # the same partition, both convolutions first
    for name in ["x", "squeeze", "relu", "e1", "e3", "relu_1", "relu_2", "cat", "output"]:
        env[by_name[name]] = shuffled.node_copy(by_name[name], lambda a: env[a])
    sub = fx.GraphModule(gm, shuffled)
    assert [n.name for n in backend._in_graph_order(sub, backend._Graph(gm))] == names


class NormsAndReductions(nn.Module):
    """Calls of KernelBench level 2 that once split its partitions: F.group_norm and F.instance_norm with the
    model's weights, torch.min with a dim (values and indices, the values taken), a torch.tensor constant."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.inorm = nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True)

    def forward(self, x):
        y = self.inorm(self.gn(self.conv(x)))
        m = torch.min(y, dim=1, keepdim=True)[0]
        return torch.max(y * m, torch.tensor(0.25))


def test_group_and_instance_norm_a_min_over_a_dim_and_a_constant_are_one_partition(cache):
    torch.manual_seed(0)
    with torch.no_grad():
        model = NormsAndReductions().train()
        model.gn.weight.uniform_(0.5, 1.5)
        model.inorm.bias.uniform_(-0.5, 0.5)
    made = _partitions_of(model, torch.randn(3, 3, 8, 8))
    assert len(made) == 1 and made[0]["module"], made
    assert {"group_norm", "instance_norm", "min", "getitem", "tensor", "max"} <= set(made[0]["calls"]), made


class ViewPassedThrough(nn.Module):
    """Mamba2's shape: a view of the input that only a call kgen lacks reads, beside arithmetic on the input."""

    def forward(self, x):
        blocks = x.reshape(x.shape[0], 2, -1)
        return torch.cumprod(blocks, dim=-1), torch.exp(x[:, :, -1:] - x)


def test_a_view_that_only_passes_an_input_out_stays_outside_the_partition(cache):
    """The reshape of ``x`` that only cumprod (not kgen's) reads is PyTorch's view, outside the partition that
    computes the exp (else the generated op would return it: a copy, or one more output)."""
    made = [p for p in _partitions_of(ViewPassedThrough(), torch.randn(3, 4, 6)) if p["module"] is not None]
    assert len(made) == 1, made
    assert "exp" in made[0]["calls"] and "reshape" not in made[0]["calls"], made
    spec = yaml.safe_load(Path(made[0]["spec"]).read_text())
    assert not any("reshape" in op for op in spec["ops"]) and "outputs" not in spec, spec


class IndependentCalls(nn.Module):
    """Two exps that share no value: one of the input, one after a call kgen lacks (cumprod)."""

    def forward(self, x):
        early = torch.cumprod(torch.exp(x), dim=1)
        return early, torch.exp(torch.cumprod(x, dim=2))


def test_independent_calls_are_partitions_of_their_own(cache):
    """The partitioner would put both exps in one partition (no cycle); one op for both would wait for the second
    cumprod, and the first exp's reader with it. Each is a partition of its own, and the first runs first."""
    from kgen import backend

    order = []

    def kept(gm, example_inputs):  # the backend, keeping the order of the calls in the graph it returns
        compiled = backend.kgen_backend(gm, example_inputs)
        order.extend(str(n.target) for n in _graph_module(compiled).graph.nodes if n.op in ("call_module", "call_function"))
        return compiled

    model, x = IndependentCalls(), torch.randn(3, 4, 5)
    before = len(backend.PARTITIONS)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=kept)(x), model(x), rtol=1e-4, atol=1e-5)
    made = backend.PARTITIONS[before:]
    assert [p["calls"] for p in made] == [["exp"], ["exp"]] and all(p["module"] for p in made), made
    cumprods = [i for i, t in enumerate(order) if "cumprod" in t]
    kgen_calls = [i for i, t in enumerate(order) if t.startswith("fused_")]
    assert len(kgen_calls) == 2 and kgen_calls[0] < cumprods[0], order  # the input's exp before either cumprod


class ConstantsAndWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x):
        top = torch.log(torch.tensor(1. / 0.01, device=x.device))  # (SwinV2's logit scale limit)
        h = torch.zeros(3)
        h[0] = 2.0  # written: made at each call
        return torch.clamp(self.scale, max=top).exp() * x + h


def _returned_by_the_backend(model, *xs):
    """What kgen_backend returns for ``model``'s one graph, and the graph module it was given, after two calls equal
    to eager's (on copies of the inputs, each after the same seed: a model that writes into its input or draws
    random numbers)."""
    from kgen.backend import kgen_backend

    seen = []

    def spy(gm, example_inputs):
        fn = kgen_backend(gm, example_inputs)
        seen.append((fn, gm))
        return fn

    compiled = torch.compile(model, backend=spy)
    with torch.no_grad():
        for _ in range(2):
            torch.manual_seed(3)
            got = compiled(*(x.clone() for x in xs))
            torch.manual_seed(3)
            torch.testing.assert_close(got, model(*(x.clone() for x in xs)))
    return seen[-1]


def test_constants_are_computed_once_and_a_value_written_into_is_not(cache):
    """``torch.log(torch.tensor(...))`` becomes an attribute of the graph (a host copy at every call, and no CUDA
    graph captures one); the ``torch.zeros`` that the graph then writes into stays a call (folded, the write
    would change it for the next call)."""
    from kgen import backend

    _, gm = _returned_by_the_backend(ConstantsAndWrites(), torch.randn(4, 3))
    code = gm.code
    assert "torch.tensor(" not in code and "torch.log(" not in code and "_kgen_constant_0" in code, code
    assert "torch.zeros(3)" in code, code
    assert backend.GRAPHS[-1]["replay"] == "l_x_ is on the cpu", backend.GRAPHS[-1]  # (a CUDA graph takes none)


class WritesThroughAView(nn.Module):
    def forward(self, x):
        c = torch.ones(3)
        c.view(3, 1).mul_(2.0)  # written through a view: made at each call
        d = torch.arange(3.0) * 2.0  # read only: computed once
        return x * c + d, torch.full((2,), 5.0)  # returned: the caller may write into it, made at each call


def test_a_constant_written_through_a_view_is_made_at_each_call(cache):
    _, gm = _returned_by_the_backend(WritesThroughAView(), torch.randn(4, 3))
    code = gm.code
    assert "torch.ones(3)" in code and "mul_" in code and "torch.full(" in code, code
    assert "torch.arange" not in code and "_kgen_constant_0" in code, code


class WritesItsInput(nn.Module):
    def forward(self, x):
        x.mul_(2.0)
        return torch.relu(x) + 1.0


def test_a_graph_that_writes_into_its_input_is_not_replayed(cache):
    """A replay copies the input into the graph's own: the write would land there, not in the caller's tensor."""
    from kgen import backend

    fn, _ = _returned_by_the_backend(WritesItsInput(), torch.randn(4, 3).abs())
    assert backend.GRAPHS[-1]["replay"] == "it writes into its input l_x_ (mul_)", backend.GRAPHS[-1]
    assert callable(fn) and backend.GRAPHS[-1]["measured"]() is not None  # (measured in direct calls: no replay)


class SequencePatches(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3 * 4, 6)

    def forward(self, x):  # [B, 3, 16]: 4 patches of 4 positions
        patches = x.unfold(2, 4, 4).transpose(1, 2).flatten(2)  # [B, 4, 12]
        return torch.relu(self.embed(patches))


def test_unfolded_patches_are_in_the_partition(cache):
    torch.manual_seed(0)
    made = _partitions_of(SequencePatches().eval(), torch.randn(2, 3, 16))
    assert len(made) == 1 and made[0]["module"] is not None and "unfold" in made[0]["calls"], made



class ComputesWhatItDoesNotReturn(nn.Module):
    def forward(self, x, w):
        unused = torch.einsum("bij,jk->bik", x, w).exp()  # (Mamba2's block output where the state alone is returned)
        torch.rand_like(x)  # unused, but a later draw depends on it
        y = x * 2.0
        y.masked_fill_(x > 1.0, 0.0)  # its result unused, its write not
        return y + torch.rand_like(x)


def test_calls_whose_results_nothing_uses_are_dropped_but_not_writes_or_draws(cache):
    """Dynamo keeps a call whose result nothing uses; the backend drops it before partitioning (neither form computes
    it), except a write into an operand or a random draw (the later draws would change)."""
    code = _returned_by_the_backend(ComputesWhatItDoesNotReturn(), torch.randn(2, 4, 3), torch.randn(3, 5))[1].code
    assert "einsum" not in code and "exp" not in code, code
    assert code.count("torch.rand_like(") == 2 and ".masked_fill_(" in code, code


class WriteBetweenReads(nn.Module):
    def forward(self, x):
        y = torch.sigmoid(x) * 2.0
        y.masked_fill_(x > 1.0, 0.0)  # read after: stays eager
        return torch.tanh(y) + 1.0


class WriteWaitingForThePartition(nn.Module):
    def forward(self, x):
        a = torch.sigmoid(x) * 2.0
        y = torch.cumprod(x, 1)  # eager
        y.masked_fill_(a > 1.0, 0.0)  # its mask from the partition's first calls
        r = torch.cumprod(y, 1)  # eager, reads y written
        return torch.tanh(a) + 1.0 + r


def test_a_partition_is_cut_at_a_write_outside_it_into_a_value_it_reads(cache):
    """A partition runs where its last call stood: one of the calls before the eager write and the calls after it
    would have read y unwritten (the write moved after it, waiting for y)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 2
    code = _returned_by_the_backend(WriteBetweenReads(), x)[1].code
    lines = code.splitlines()
    write = next(i for i, line in enumerate(lines) if ".masked_fill_(" in line)
    assert any("fused_0" in line for line in lines[:write]) and any("fused_1" in line for line in lines[write:]), code
    # a write that waits for the partition's first calls would move after its last, past an eager read
    _returned_by_the_backend(WriteWaitingForThePartition(), x)


def test_a_partition_slower_than_its_calls_in_pytorch_runs_them(cache, monkeypatch, measured_forms):
    """Each partition of a graph of several measures its op against its calls as PyTorch computes them (the op
    slowed down): PyTorch's calls are chosen, and every call's result and
    running statistics are eager's throughout, the measurement's calls included. A graph of one partition leaves
    that to its own measurement (one per call is enough)."""
    import time

    from kgen import backend, runtime

    run = backend.KgenPartition._run
    monkeypatch.setattr(backend.KgenPartition, "_run", lambda self, *a: time.sleep(0.1) or run(self, *a))
    seen = []

    def spy(gm, example_inputs):
        seen.append(gm)
        return backend.kgen_backend(gm, example_inputs)

    torch.manual_seed(0)
    model = Split("cumprod").train()  # a partition before the cumprod and one after it
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend=spy)
    with torch.no_grad():
        for _ in range(2 + 2 * runtime.REPLAY_TRIALS + 2):
            x = torch.randn(2, 3, 8, 8)
            torch.testing.assert_close(compiled(x), twin(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.bn.running_var, twin.bn.running_var, rtol=1e-4, atol=1e-6)
    parts = [m for gm in seen for m in gm.modules() if isinstance(m, backend.KgenPartition)]
    assert len(parts) == 2 and all(p.measured.chosen() == ["eager"] and p.settled() for p in parts), \
        [p.measured.choices() for p in parts]
    seen.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Net().train(), backend=spy)(torch.randn(2, 3, 8, 8))
    parts = [m for gm in seen for m in gm.modules() if isinstance(m, backend.KgenPartition)]
    assert len(parts) == 1 and parts[0].measured is None and parts[0].settled()


class ParameterViewOfTheBatchSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 12))

    def forward(self, x):  # the weight of 2 outputs, read through a view (of its own shape)
        return torch.relu(x @ self.w.view(2, 12).t())


def test_a_parameters_view_keeps_a_size_equal_to_the_batch(cache):
    """In a graph specialized to batch 2, ``self.w.view(2, 12)`` keeps its 2: only a view of a value with the batch
    takes the partition's batch (the view failed at the importer's second batch, and the partition stayed eager)."""
    from kgen import backend

    torch.manual_seed(0)
    model, x = ParameterViewOfTheBatchSize(), torch.randn(2, 12)
    before = len(backend.PARTITIONS)
    with torch.no_grad():
        got = torch.compile(model, backend=backend.kgen_backend, dynamic=False)(x)
        torch.testing.assert_close(got, model(x))
    made = backend.PARTITIONS[before:]
    assert len(made) == 1 and made[0]["module"] is not None and "view" in made[0]["calls"], made


class ParameterOfTheBatch(nn.Module):
    """Mamba2's layout: parameters made with the batch size (``torch.randn(batch_size, L, H)``), read beside the
    input as though they were inputs; the model runs at that batch alone."""

    def __init__(self, batch: int):
        super().__init__()
        self.a = nn.Parameter(torch.randn(batch, 6, 3))
        self.bias = nn.Parameter(torch.randn(batch, 1, 1))  # (dim 0 the batch's size, broadcast over the channels)

    def forward(self, x):  # x [B, 6, 3, 5]
        decay = torch.exp(torch.cumprod(self.a, dim=-1))
        y = torch.einsum("blh,blhp->bhp", decay, x)
        return torch.relu(y) + y * self.bias


class BiasOfTheBatchSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, 1, 1))  # per channel, at batch 4 as many as the batch

    def forward(self, x):
        return torch.relu(x + self.bias) * 2


def test_parameters_that_carry_the_batch_are_the_partitions_inputs(cache):
    """Mamba2's parameters lead with the batch size: a partition that took them as parameters failed at the
    importer's second batch and stayed eager. Taken as inputs, the partition is kgen's; a parameter whose dim 0
    merely equals the batch (4 channels at batch 4) stays a parameter."""
    from kgen import backend

    torch.manual_seed(0)
    for model, x, inputs in ((ParameterOfTheBatch(4), torch.randn(4, 6, 3, 5), 3),
                             (BiasOfTheBatchSize(), torch.randn(4, 4, 3, 3), 1)):
        before = len(backend.PARTITIONS)
        compiled = torch.compile(model, backend=backend.kgen_backend, dynamic=False)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        made = [p for p in backend.PARTITIONS[before:] if p["module"] is not None]
        assert len(made) == 1, backend.PARTITIONS[before:]
        assert len(made[0]["runner"]()._inputs) == inputs, made


def test_parameters_that_carry_the_batch_train_as_eager(cache):
    """Given to the partition's op as inputs, Mamba2-style parameters still get their gradients: a training step's
    loss and gradients equal eager's."""
    from kgen import backend

    torch.manual_seed(0)
    model, x = ParameterOfTheBatch(4), torch.randn(4, 6, 3, 5)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend=backend.kgen_backend, dynamic=False)
    before = len(backend.PARTITIONS)
    for m in (model, compiled):
        (m(x) ** 2).sum().backward()
    assert [p["module"] is not None for p in backend.PARTITIONS[before:]] == [True]
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


class SegmentSums(nn.Module):
    """Mamba2's segment sums in small (KernelBench level 3, 48): a cumulative sum (PyTorch's), the differences of
    its values by broadcasting, masked above the diagonal by a mask made from constants alone, and the exponential
    transposed into a product."""

    def forward(self, a, c):
        T = a.size(-1)
        cs = torch.cumprod(a, dim=-1)
        seg = cs[..., :, None] - cs[..., None, :]
        mask = torch.tril(torch.ones(T, T, device=a.device, dtype=torch.bool), diagonal=0)
        return torch.exp(seg.masked_fill(~mask, -torch.inf)).transpose(1, 2) * c


class InputMask(nn.Module):
    def forward(self, x):
        return torch.relu(x.masked_fill(x > 1.0, 0.5)) * 2.0


def test_a_mask_made_from_constants_is_an_operand_of_the_partition(cache):
    """A masked_fill whose mask is computed without the inputs joins the partition (kgen.backend._float_masks: the
    mask as a float tensor, computed once): one kgen partition computes the differences, the fill, the exponential
    and the product, with eager's values (-inf filled, its exponential 0). A mask computed from the input stays
    PyTorch's call."""
    from kgen import backend

    torch.manual_seed(0)
    made = _partitions_of(SegmentSums(), torch.randn(4, 3, 2, 8), torch.randn(4, 2, 3, 8, 8))
    assert [p["module"] is not None for p in made] == [True], made
    assert {"sub", "masked_fill_nonzero", "exp", "mul"} <= set(made[0]["calls"]), made
    spec = Path(made[0]["spec"]).read_text()
    assert "masked_fill: {param: " in spec and "value: -.inf" in spec, spec
    made = _partitions_of(InputMask(), torch.randn(4, 6) * 2)
    assert not any("masked_fill" in c for p in made for c in p["calls"] if p["module"]), made


class BufferMask(nn.Module):
    """ReLUSelfAttention's mask in small (KernelBench level 3, 50): scores masked where a causal buffer sliced to the
    run-time length is 0, then a ReLU instead of a softmax (no fused attention call takes it)."""

    def __init__(self, most=8):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(most, most)).view(1, 1, most, most))

    def forward(self, x):
        T = x.size(-2)
        att = (x @ x.transpose(-2, -1)) * 0.5
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return torch.relu(att) @ x


def test_a_mask_read_from_a_buffer_follows_the_buffer(cache):
    """A mask compared from a buffer is a partition operand computed where PyTorch computes it, each call (not
    folded: the buffer may change): after the buffer changes, the compiled model still computes what eager does."""
    torch.manual_seed(1)
    model = BufferMask()
    x = torch.randn(3, 2, 6, 4)
    made = _partitions_of(model, x)
    assert any(p["module"] and "masked_fill_nonzero" in p["calls"] for p in made), made
    compiled = _compiled(model)
    with torch.no_grad():
        compiled(x)
        model.bias.copy_(torch.ones_like(model.bias).triu())  # another mask, the same buffer
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
