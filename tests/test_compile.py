"""kgen.compile(model, *example_inputs) on the CPU: a small nested model (a Sequential of convolution,
batch norm and ReLU, a residual block, adaptive average pool, flatten, linear) compiled from its live
instance into a temporary KGEN_CACHE. The compiled module computes what the model computes in eval
and training mode (running statistics and gradients included), holds the model's own parameters and
buffers (state_dict keys and values), and ``out=`` writes the spec and the module into a project. A
second compile in a new process finds everything in the cache and only loads it; an unsupported call
is one error naming its file:line.
"""
import copy
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import fresh_kgen_cache

import kgen
from kgen.errors import KgenError
from kgen.importer import ImportFailed

MODEL = '''
import torch
import torch.nn as nn


class Residual(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


class Net(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), Residual(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, classes))

    def forward(self, x):
        return self.head(self.pool(self.features(x)))


class CumProd(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, 1)  # UNSUPPORTED
'''

SECOND = '''
import sys, time
import torch
sys.path.insert(0, {dir!r})
import kgen
from model_for_compile import Net

torch.manual_seed(1)
model = Net().eval()
x = torch.randn(2, 3, 12, 12)
start = time.perf_counter()
compiled = kgen.compile(model, x)
seconds = time.perf_counter() - start
assert torch.allclose(compiled(x), model(x), rtol=1e-4, atol=1e-5)
print(f"SECONDS {{seconds:.3f}}")
'''


class Scaled(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * torch.tensor(2.0)


class Outer(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.block = block

    def forward(self, x):
        return self.block(self.conv(x))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A model file, and KGEN_CACHE set to a fresh folder for this module (the precompiled header is
    shared with kgen's usual cache, so that it is not made again)."""
    root = tmp_path_factory.mktemp("compile")
    (root / "model_for_compile.py").write_text(MODEL)
    spec = importlib.util.spec_from_file_location("model_for_compile", root / "model_for_compile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with fresh_kgen_cache(root) as cache:
        yield root, mod, cache


@pytest.fixture(scope="module")
def compiled(env):
    root, mod, cache = env
    torch.manual_seed(0)
    model = mod.Net().eval()
    with torch.no_grad():  # running statistics that are not the defaults
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    reference = copy.deepcopy(model)
    return model, reference, kgen.compile(model, torch.randn(2, 3, 12, 12))


def test_eval_mode_equals_eager(compiled):
    model, _, c = compiled
    assert not c.training
    x = torch.randn(3, 3, 12, 12)  # another batch: the batch is the run-time symbol
    with torch.no_grad():
        torch.testing.assert_close(c(x), model(x), rtol=1e-4, atol=1e-5)


def test_state_dict_and_parameters_are_the_models(compiled):
    model, _, c = compiled
    ours, theirs = c.state_dict(), model.state_dict()
    assert list(ours) == list(theirs)
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    assert [n for n, _ in c.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(c.parameters(), model.parameters()))  # shared, not copied
    assert all(a is b for a, b in zip(c.buffers(), model.buffers()))
    assert c.kgen_sources.is_dir() and (c.kgen_sources / "binding.cpp").is_file()


def test_training_mode_equals_eager(compiled):
    """Batch statistics, the running statistics' update and the gradients as eager's. The compiled
    module shares the model's tensors, so eager runs on a copy taken before."""
    model, _, c = compiled
    eager = copy.deepcopy(model).train()
    c.train()
    try:
        for step in range(2):
            x = torch.randn(4, 3, 12, 12)
            want, got = eager(x), c(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            g = torch.randn_like(want)
            want.backward(g)
            got.backward(g)
        for (k, a), b in zip(eager.state_dict().items(), c.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=k)
        assert int(c.get_submodule("features.1").num_batches_tracked) == 2
        for (k, a), b in zip(eager.named_parameters(), c.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=k)
    finally:
        c.eval()
        with torch.no_grad():  # back to the values the other tests compare against
            for a, b in zip(compiled[1].state_dict().values(), model.state_dict().values()):
                b.copy_(a)
        for p in model.parameters():
            p.grad = None


def test_compiled_folder_holds_spec_and_sources(compiled, env):
    _, _, cache = env
    c = compiled[2]
    folder = c.kgen_sources.parent
    assert folder.parent == cache / "compiled"
    assert folder.name.startswith("net-")
    spec = (folder / "spec.yaml").read_text()
    assert "constructor" not in spec and f"name: {c.kgen_sources.name}" in spec
    assert list((c.kgen_sources / "_build").glob("cpu-*/lib*.so"))


def test_second_process_loads_from_the_cache(compiled, env):
    """A new process compiling the same model (other weights) renders and builds nothing."""
    root, _, cache = env
    folder = compiled[2].kgen_sources
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    os.utime(folder.parent, (0, 0))  # its last use: long ago
    script = root / "second.py"
    script.write_text(SECOND.format(dir=str(root)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert "loaded from the cache" in proc.stderr and "building" not in proc.stderr, proc.stderr
    # one line of kgen's on a cache hit (torch may warn on its own, e.g. without NumPy)
    assert len([l for l in proc.stderr.splitlines() if l.startswith("kgen:")]) == 1, proc.stderr
    after = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    assert after == before  # nothing rendered, built or touched
    assert time.time() - folder.parent.stat().st_mtime < 600  # but the hit recorded as its use (kgen cache --older-than)
    assert [d.name for d in (cache / "compiled").iterdir()] == [folder.parent.name]
    seconds = float(proc.stdout.split("SECONDS")[1])
    print(f"\nkgen.compile in a second process (cache hit): {seconds:.3f} s")


def test_out_writes_spec_and_module_into_the_project(env, compiled):
    root, mod, _ = env
    model = compiled[0]
    project = root / "project"
    c = kgen.compile(model, torch.randn(2, 3, 12, 12), out=project / "generated", name="compiled_net", verbose=False)
    spec = project / "specs" / "compiled_net.yaml"
    assert spec.is_file() and "constructor:" not in spec.read_text()
    for f in ("binding.cpp", "kernel_cpu.cpp", "__init__.py", "plan.json"):
        assert (project / "generated" / "compiled_net" / f).is_file(), f
    assert c.kgen_sources == project / "generated" / "compiled_net"
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        torch.testing.assert_close(c(x), model(x), rtol=1e-4, atol=1e-5)


def test_unsupported_call_names_its_line(env):
    root, mod, cache = env
    before = sorted(p.name for p in (cache / "compiled").iterdir()) if (cache / "compiled").exists() else []
    with pytest.raises(ImportFailed) as e:
        # the top module's class is in this file: the line is found in the file of the block it calls
        kgen.compile(Outer(mod.CumProd()), torch.randn(2, 3, 4, 4), verbose=False)
    line = MODEL.splitlines().index("        return torch.cumprod(x, 1)  # UNSUPPORTED") + 1
    message = str(e.value)
    assert f"model_for_compile.py:{line}: torch.cumprod is not supported" in message, message
    assert len(message.splitlines()) == 1
    after = sorted(p.name for p in (cache / "compiled").iterdir()) if (cache / "compiled").exists() else []
    assert after == before  # nothing written


def test_refusals_are_one_line(env):
    _, mod, _ = env
    model = mod.Net()
    model.features[1].eval()  # one batch norm in eval mode while the model trains
    with pytest.raises(ImportFailed, match="one mode"):
        kgen.compile(model, torch.randn(2, 3, 12, 12), verbose=False)
    with pytest.raises(ImportFailed, match="example inputs"):
        kgen.compile(mod.Net())
    with pytest.raises(KgenError, match="precision"):
        kgen.compile(mod.Net(), torch.randn(2, 3, 12, 12), precision="fp8")


def test_intermediates_is_the_specs_key(env):
    """kgen.compile's ``intermediates`` (the backend's option of that name goes the same way) lands in the spec: Net's
    chain of training-mode batch norms (a convolution between two) runs as eager's calls by default, with kgen's own
    statistics under float32; a value the spec does not know is refused before anything is traced."""
    from kgen.compiler import SPEC_FILE, compile_module
    from kgen.ir import load_pipeline

    _, mod, _ = env
    for value, eager in ((None, True), ("float32", False)):
        module_dir = compile_module(mod.Net(), torch.randn(2, 3, 12, 12), intermediates=value, verbose=False, build=False)
        assert load_pipeline(module_dir.parent / SPEC_FILE).eager_batch_norms == eager, value
    with pytest.raises(KgenError, match="intermediates='fp16'; expected one of eager, float32"):
        kgen.compile(mod.Net(), torch.randn(2, 3, 12, 12), intermediates="fp16")


def test_import_kgen_does_not_import_torch():
    code = "import sys, kgen; assert callable(kgen.compile); print(any(m == 'torch' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_compile_measures_eager_precision_on_the_gpu_it_renders_for(env, monkeypatch):
    """On the CUDA GPU the module is rendered for, kgen.compile measures eager's cuDNN precision of the model's
    convolutions first (`kgen tune --precision-only`, into the cache folder's tuning file: a stand-in measurement
    here) and plans with it; such an entry is not a tuning that max-autotune would skip."""
    from kgen import compiler, tune, tunefile
    from kgen.compiler import compile_module
    from kgen.ir import Conv, load_pipeline
    from kgen.plan import choose_plans
    from kgen.target import DEFAULT

    _, mod, _ = env
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: DEFAULT.name)
    calls = []
    monkeypatch.setattr(tune, "measure_eager_conv_tf32", lambda pipe, batch: calls.append(batch) or tuple(
        sorted({(op.module, True) for op in pipe.ops if isinstance(op, Conv)})))
    module_dir = compile_module(mod.Net().eval(), torch.randn(3, 3, 12, 12), name="measured_net", verbose=False,
                                build=False)
    spec = module_dir.parent / compiler.SPEC_FILE
    (entry,) = tunefile.read(tunefile.path_for(spec))["entries"]
    assert calls == [3] and "candidates" not in entry
    assert entry["eager_conv_tf32"] and all(entry["eager_conv_tf32"].values())
    sel = choose_plans(load_pipeline(spec), DEFAULT)
    assert sel.source == "cost model" and dict(sel.pipeline.eager_conv_tf32) == entry["eager_conv_tf32"]
    ran = []
    monkeypatch.setattr(tune, "run_tune", lambda *a, **k: ran.append(a) or [])
    monkeypatch.setattr(compiler, "_plan_and_render", lambda *a: None)
    monkeypatch.setattr(compiler, "build_module", lambda *a, **k: None)
    assert compiler.tune_module(module_dir, [3], verbose=False) and ran  # not "tuned already"


WITHOUT_NUMPY = '''
import sys
sys.modules["numpy"] = None  # torch runs without NumPy (a CPU wheel does not require it)
import torch
sys.path.insert(0, {dir!r})
from kgen import compiler
from model_for_compile import Net

graph = torch.fx.symbolic_trace(Net()).eval()
x = torch.randn(2, 3, 12, 12)
first = compiler.compile_module(graph, x, name="no_numpy_net", verbose=False, build=False)
assert compiler.compile_module(graph, x, name="no_numpy_net", verbose=False, build=False) == first
print("KEYED", compiler._traced_key(graph, [x], "no_numpy_net", {{}}))
'''


def test_a_graph_is_keyed_and_compiled_without_numpy(env):
    """kgen needs no NumPy: a traced graph's key (its batch norms' running statistics, small buffers whose bytes are
    keyed) and its compile work where NumPy cannot be
    imported, as on a machine with torch's CPU wheel alone."""
    root, _, _ = env
    done = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY.format(dir=str(root))], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(kgen.__file__).parents[1]),
                                                                          os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KEYED " in done.stdout


def test_a_graph_compiled_before_is_found_without_tracing_it_again(env, monkeypatch):
    """A torch.fx GraphModule (the Dynamo backend's partitions) compiled once is found by a key of what the importer
    reads from it, without the importer's trace. A graph that differs in a submodule's setting, its mode, a
    parameter's values or the example's shape is traced again (the stride and the shape compile into another
    folder; the mode and a module's weights are run-time values of the same spec), and then found too."""
    from kgen import compiler

    _, mod, _ = env
    torch.manual_seed(0)
    graph = torch.fx.symbolic_trace(mod.Net()).eval()
    x = torch.randn(2, 3, 12, 12)
    first = compiler.compile_module(graph, x, name="traced_net", verbose=False, build=False)
    traced = []
    real_import = compiler.import_instance
    monkeypatch.setattr(compiler, "import_instance", lambda *a: traced.append(a) or real_import(*a))
    assert compiler.compile_module(graph, x, name="traced_net", verbose=False, build=False) == first and not traced
    strided = copy.deepcopy(graph)
    strided.get_submodule("features.0").stride = (2, 2)
    constant_bias = copy.deepcopy(graph)
    with torch.no_grad():
        constant_bias.get_submodule("head.1").bias.fill_(1.0)
    cases = [(strided, x, False), (copy.deepcopy(graph).train(), x, True), (constant_bias, x, True),
             (graph, torch.randn(2, 3, 10, 10), False)]
    for other, example, same in cases:
        traced.clear()
        module_dir = compiler.compile_module(other, example, name="traced_net", verbose=False, build=False)
        assert len(traced) == 1 and (module_dir == first) == same
        assert compiler.compile_module(other, example, name="traced_net", verbose=False, build=False) == module_dir
        assert len(traced) == 1
    # a constant the graph reads (fx's _tensor_constant0, a small buffer): its value is in the key
    scaled = torch.fx.symbolic_trace(Scaled()).eval()
    keys = set()
    for value in (2.0, 3.0):
        scaled._tensor_constant0 = torch.tensor(value)
        keys.add(compiler._traced_key(scaled, [x], "scaled", {}))
    assert len(keys) == 2
