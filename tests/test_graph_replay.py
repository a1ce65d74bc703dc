"""CUDA-graph replay of a generated op's kernels (kgen.runtime.GraphReplay): where no autograd graph is
recorded, the second call of a signature captures the op's kernels and later calls replay them. The
decision (the host dispatch the GPU waits for, saved, against the bytes a replay copies), the signature and the CPU path run
everywhere; the replay itself (marked cuda) on a GPU: outputs equal to the kernels launched one by one,
training-mode running statistics equal to eager's, parameters updated in place seen, one graph per batch,
and no replay inside a caller's own capture."""

import pytest
import torch

from conftest import HAS_CUDA, conv_bn_blocks_model, load_model_file, write_model_file
from kgen.runtime import GraphReplay, launches_one_by_one, replay_pays
from kgen.target import DEFAULT

BLOCKS = conv_bn_blocks_model(blocks=8, size=6)  # a call of ~16 short kernels


def test_replay_pays_where_dispatch_outweighs_the_copies():
    many, few = 60 * DEFAULT.launch_s, 3 * DEFAULT.launch_s  # the host's dispatch of 60 and of 3 launches
    # argument bytes: each read and written once by a replay at most
    assert replay_pays(many, argument_bytes=5_000_000, target=DEFAULT)  # 240 us of dispatch, ~3 us of copies
    assert not replay_pays(few, argument_bytes=67_000_000, target=DEFAULT)  # a large input copied for 3 launches
    assert not replay_pays(few, argument_bytes=0, target=DEFAULT)  # the replay's own launch and copies cost as much


def test_a_replay_saves_the_dispatch_the_gpu_waits_for():
    """ResNet's basic block in training mode, its convolutions and batch norms eager's calls
    (Pipeline.eager_batch_norms). At KernelBench's size (batch 10 at 224 x 224) each kernel runs longer than the
    host takes to issue the next, so only the first call's dispatch (a cuDNN convolution's,
    kgen.families.conv_aten.CUDNN_CALL_S) is waited for: a replay would copy the 128 MB output for nothing. At
    16 x 16 the kernels are shorter than their dispatch, which adds up, library calls included, and a replay pays."""
    from conftest import pipeline_of, spec_text
    from kgen.cost import estimate, replay_terms
    from kgen.families.conv_aten import CUDNN_CALL_S
    from kgen.plan import choose_plans

    conv = {"out_channels": 64, "kernel_size": 3, "padding": 1, "bias": False}
    ops = [{"conv2d": conv | {"name": "conv1"}}, {"batch_norm": {"name": "bn1"}}, "relu",
           {"conv2d": conv | {"name": "conv2"}}, {"batch_norm": {"name": "bn2"}}, "relu"]
    for size, batch, pays in ((224, 10, False), (16, 2, True)):
        sel = choose_plans(pipeline_of(spec_text([3, size, size], ops, batch=batch)), DEFAULT)
        plan = sel.variant_for(batch, training=True).plan
        waited, nbytes = replay_terms(plan, batch)
        work = [w for e in estimate(plan, batch) for w in e.work]
        launches = sum(w.launches for w in work)
        assert sum(w.calls for w in work) == 2
        if pays:
            assert waited > launches * DEFAULT.launch_s + CUDNN_CALL_S and replay_pays(waited, nbytes, DEFAULT)
        else:
            assert CUDNN_CALL_S <= waited < CUDNN_CALL_S + launches * DEFAULT.launch_s and not replay_pays(waited, nbytes, DEFAULT)
    # the module decides per mode: eval mode's plan (the norms folded into generated convolutions) issues less
    from kgen.render import host_dispatch_us

    per_mode = host_dispatch_us(sel)
    assert per_mode["train"] == pytest.approx(1e6 * waited, abs=0.1) and per_mode["eval"] < per_mode["train"]


def test_explain_says_a_model_of_many_short_kernels_replays(tmp_path):
    from kgen.explain import explain_text
    from kgen.importer import import_model
    from kgen.ir import load_pipeline

    spec = import_model(str(write_model_file(tmp_path, "blocks_model", BLOCKS)), name="replay_blocks",
                        out_dir=tmp_path / "specs")
    line = explain_text(load_pipeline(spec), training=True).splitlines()[-1]
    assert line.startswith("CUDA-graph replay without autograd (at batch 2): yes: "), line


def test_cpu_calls_launch_directly_and_keep_no_graph():
    calls = []

    def op(x, params, training, factors):
        calls.append(torch.is_grad_enabled())
        return x + params[0]

    replay = GraphReplay("kgen::test", {"any": 100 * DEFAULT.launch_s})
    x, p = torch.ones(3), [torch.full((3,), 2.0)]
    for _ in range(3):
        assert torch.equal(replay(op, x, p, False, [0.1]), torch.full((3,), 3.0))
    assert len(calls) == 3 and not replay.graphs and not replay.seen
    assert GraphReplay("kgen::few", {"any": 3 * DEFAULT.launch_s}).never["any"]  # its launch and copies cost as much


def test_each_mode_decides_on_its_own_dispatch():
    """A module whose eval mode has a plan of its own: each mode's call is weighed on that mode's dispatch."""
    replay = GraphReplay("kgen::modes", {"train": 100 * DEFAULT.launch_s, "eval": 3 * DEFAULT.launch_s})
    assert replay.never == {"train": False, "eval": True}

    def op(x, params, buffers, training, factors):
        return x * (2.0 if training else 3.0)

    x = torch.ones(2)
    assert torch.equal(replay(op, x, [], [], True, [], mode="train"), torch.full((2,), 2.0))
    assert torch.equal(replay(op, x, [], [], False, [], mode="eval"), torch.full((2,), 3.0))
    assert not replay.graphs  # (on the CPU every call launches directly)


def test_signature_tells_strides_storage_and_scalars_apart():
    from kgen.runtime import _signature

    x = torch.randn(2, 3, 4)
    p = [torch.randn(3)]
    base = _signature((x, p, True, [0.1]))
    assert base == _signature((x.clone(), p, True, [0.1]))  # another input of the same layout
    assert base != _signature((x.transpose(1, 2).contiguous().transpose(1, 2), p, True, [0.1]))
    assert base != _signature((x, [p[0].clone()], True, [0.1]))  # a parameter elsewhere
    assert base != _signature((x, p, False, [0.1]))
    assert base != _signature((x, p, True, [0.2]))
    assert base != _signature((x, p, True, []))  # a module without batch norms: empty lists


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """The model imported, rendered, built for CUDA: (generated module, original model file)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    from kgen.build import build_modules
    from kgen.importer import import_model
    from kgen.render import render_spec, write_rendered
    from kgen.validate import import_module_dir

    tmp = tmp_path_factory.mktemp("replay")
    src = write_model_file(tmp, "blocks_model", BLOCKS)
    spec = import_model(str(src), name="replay_blocks", out_dir=tmp / "specs")
    gen = tmp / "gen"
    write_rendered(render_spec(spec, gen), gen)
    build_modules([gen / "replay_blocks"], "cuda")
    mod = import_module_dir(gen / "replay_blocks")
    assert set(mod.HOST_DISPATCH_US) == {"train", "eval"} and min(mod.HOST_DISPATCH_US.values()) >= 8e6 * DEFAULT.launch_s
    return mod, load_model_file(src)


def _pair(blocks, seed=5):
    mod, original = blocks
    torch.manual_seed(seed)
    theirs = original.Model().cuda()
    ours = mod.Model().cuda()
    ours.load_state_dict(theirs.state_dict())
    return mod, ours, theirs


@pytest.mark.cuda
def test_cuda_replay_equals_the_kernels_launched_one_by_one(blocks):
    mod, ours, _ = _pair(blocks)
    mod._REPLAY.graphs.clear(), mod._REPLAY.seen.clear(), mod._REPLAY.direct.clear()
    ours.eval()
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 4, 6, 6, device="cuda") * (10.0 if i == 3 else 1.0)
            if i == 4:
                x[0, 1, 2, 3] = float("nan")
            y = ours(x)
            with launches_one_by_one():
                ref = ours(x)
            torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)
    assert len(mod._REPLAY.graphs) == 1  # captured at the second call, replayed since


@pytest.mark.cuda
def test_cuda_replay_in_training_mode_updates_the_running_statistics_as_eager(blocks):
    _, ours, theirs = _pair(blocks, seed=6)
    ours.train(), theirs.train()
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4, 6, 6, device="cuda")
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.cuda
def test_cuda_replay_sees_parameters_updated_in_place_and_new_batches(blocks):
    mod, ours, theirs = _pair(blocks, seed=7)
    ours.eval(), theirs.eval()
    x = torch.randn(2, 4, 6, 6, device="cuda")
    with torch.no_grad():
        for step in range(4):
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
            for m in (ours, theirs):  # as an optimizer's step: in place
                m.get_submodule(f"body.{step}.0").weight.mul_(-0.5)
                m.get_submodule(f"body.{step}.1").running_var.mul_(3.0)
        before = len(mod._REPLAY.graphs)
        for _ in range(3):
            x3 = torch.randn(3, 4, 6, 6, device="cuda")
            torch.testing.assert_close(ours(x3), theirs(x3), rtol=1e-4, atol=1e-4)
        assert len(mod._REPLAY.graphs) == before + 1  # one graph per batch


@pytest.mark.cuda
def test_cuda_no_replay_inside_a_callers_capture_or_when_switched_off(blocks, monkeypatch):
    mod, ours, theirs = _pair(blocks, seed=8)
    ours.eval(), theirs.eval()
    x = torch.randn(2, 4, 6, 6, device="cuda")
    with torch.no_grad():
        for _ in range(2):  # warm-up outside the capture, as CUDA graphs want
            ours(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = ours(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, theirs(x), rtol=1e-4, atol=1e-4)
        monkeypatch.setenv("KGEN_CUDA_GRAPHS", "0")
        mod._REPLAY.graphs.clear(), mod._REPLAY.seen.clear(), mod._REPLAY.direct.clear()
        for _ in range(3):
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
        assert not mod._REPLAY.graphs


@pytest.mark.cuda
def test_cuda_replay_captured_in_inference_mode_serves_no_grad_calls(blocks):
    mod, ours, theirs = _pair(blocks, seed=9)
    ours.eval(), theirs.eval()
    mod._REPLAY.graphs.clear(), mod._REPLAY.seen.clear(), mod._REPLAY.direct.clear()
    x = torch.randn(2, 4, 6, 6, device="cuda")
    with torch.inference_mode():
        for _ in range(3):  # captured here: the graph's own inputs must stay normal tensors
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)
    assert len(mod._REPLAY.graphs) == 1


# ---- a whole compiled graph measured in its forms (kgen.runtime.MeasuredGraph: the backend's graphs)

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@needs_cuda
def test_a_failed_capture_leaves_the_stream_and_the_random_generator_usable():
    """A capture that fails (a call that waits for the GPU) is no replay, and leaves behind neither the capture's
    stream as the current one nor the CUDA generator in its capture: random draws go on as before."""
    from kgen import runtime

    x = torch.randn(4, device="cuda")
    stream = torch.cuda.current_stream()

    def waits(args):
        return args[0] * float(args[0].sum().item())

    with pytest.warns(UserWarning, match="its capture failed"):
        assert runtime._captured(waits, [x], lambda i: True, "a test") is None
    assert torch.cuda.current_stream() == stream
    torch.manual_seed(5)
    drawn = torch.randn(3, device="cuda")  # (failed before: "Offset increment outside graph capture")
    torch.manual_seed(5)
    torch.testing.assert_close(torch.randn(3, device="cuda"), drawn)


def _many_small_calls(x, w, buf):
    """A host-bound graph: many tiny kernels, a parameter ``w`` read and a buffer ``buf`` updated in place."""
    buf.mul_(0.5).add_(x.mean())
    for _ in range(40):
        x = torch.tanh(x * w + 0.1)
    return x + buf, x.shape[0]


def _fewer_calls(x, w, buf):
    """The same, computed another way (kgen's form of the graph beside PyTorch's)."""
    buf.mul_(0.5).add_(x.mean())
    for _ in range(20):
        x = torch.tanh(torch.tanh(x * w + 0.1) * w + 0.1)
    return x + buf, x.shape[0]


def test_a_measured_graph_calls_its_first_form_under_kgen_measure_0(monkeypatch):
    from kgen.runtime import MeasuredGraph

    monkeypatch.setenv("KGEN_MEASURE", "0")
    calls = []
    measured = MeasuredGraph({"kgen": lambda *a: calls.append(1) or _fewer_calls(*a), "eager": _many_small_calls},
                             state=[1, 2], replayable=True)
    w, buf, ref_buf = torch.randn(8), torch.zeros(8), torch.zeros(8)
    for _ in range(8):
        x = torch.randn(4, 8)
        out, n = measured(x, w, buf)
        torch.testing.assert_close(out, _many_small_calls(x, w, ref_buf)[0])
        assert n == 4
    assert len(calls) == 8 and not measured.trials


def test_a_measured_graph_on_the_cpu_times_its_direct_forms_only(monkeypatch, measured_forms):
    """On the CPU a graph that could be replayed is measured in direct calls (no CUDA graph is captured, no queue
    drained), and the faster form runs: kgen's loops that lose to ATen's leave ATen's calls to run."""
    import time

    from kgen import runtime

    def no_gpu(*a, **k):
        raise AssertionError("a CUDA call in a CPU measurement")

    monkeypatch.setattr(runtime.MeasuredGraph, "_capture", no_gpu)
    monkeypatch.setattr(torch.cuda, "synchronize", no_gpu)
    measured = runtime.MeasuredGraph({"kgen": lambda *a: time.sleep(0.01) or _fewer_calls(*a),
                                      "eager": _many_small_calls}, state=[1, 2], replayable=True)
    w, buf, ref_buf = torch.randn(8), torch.zeros(8), torch.zeros(8)
    for _ in range(2 * (1 + runtime.REPLAY_TRIALS) + 2):
        x = torch.randn(4, 8)
        torch.testing.assert_close(measured(x, w, buf)[0], _many_small_calls(x, w, ref_buf)[0], rtol=1e-5, atol=1e-5)
    trial = measured.last
    assert measured.chosen() == ["eager"] and set(trial.ms) == {("kgen", False), ("eager", False)}, trial.ms
    assert all(len(t) == runtime.REPLAY_TRIALS for t in trial.ms.values())


def test_a_measured_graph_times_each_direct_form_then_runs_the_fastest(measured_forms):
    """The measurement's steps (a graph that cannot be replayed: each
    form called once untimed, then timed REPLAY_TRIALS times, the forms in turns); a form that takes longer is not chosen, and each
    call's result is right throughout; a new batch is measured on its own."""
    import time

    from kgen import runtime

    runs = []

    def slow(*a):
        runs.append("slow")
        time.sleep(0.01)
        return _many_small_calls(*a)

    def fast(*a):
        runs.append("fast")
        return _fewer_calls(*a)

    said = []
    measured = runtime.MeasuredGraph({"kgen": slow, "eager": fast}, state=[1, 2], replayable=False, name="graph 7",
                                     on_choice=said.append)
    w, buf, ref_buf = torch.randn(8), torch.zeros(8), torch.zeros(8)
    steps = 2 * (1 + runtime.REPLAY_TRIALS)
    for i in range(steps + 3):
        x = torch.randn(3 if i < steps + 2 else 5, 8)
        torch.testing.assert_close(measured(x, w, buf)[0], _many_small_calls(x, w, ref_buf)[0], rtol=1e-5, atol=1e-5)
    # each form's untimed call before its first timed one, then the forms in turns, a timed call each
    assert runs[:steps] == ["slow", "slow", "fast", "fast"] + ["slow", "fast"] * (runtime.REPLAY_TRIALS - 1)
    assert runs[steps:] == ["fast", "fast", "slow"]  # chosen; then batch 5's first call (the first form, warming)
    assert measured.chosen() == ["eager"] and len(measured.trials) == 2
    assert len(said) == 1 and said[0].startswith("graph 7 (3x8) runs eager's form (median ms of 3 calls: kgen 1"), said


def test_a_measured_graph_waits_for_the_measurements_inside_a_form(measured_forms):
    """A form whose inner measurements are not done (a graph's partitions measuring their own forms) is called
    untimed until they are, at most SETTLING_CALLS times, before its timed calls."""
    from kgen import runtime

    runs = []

    def kgen(*a):
        runs.append("kgen")
        return _fewer_calls(*a)

    def eager(*a):
        runs.append("eager")
        return _many_small_calls(*a)

    inner_done_after = 5  # calls of kgen's form
    measured = runtime.MeasuredGraph({"kgen": kgen, "eager": eager}, state=[1, 2], replayable=False,
                                     settled={"kgen": lambda: runs.count("kgen") >= inner_done_after})
    w, buf, ref_buf = torch.randn(8), torch.zeros(8), torch.zeros(8)
    for _ in range(inner_done_after + 2 + 2 * runtime.REPLAY_TRIALS):  # (the last call chooses)
        x = torch.randn(3, 8)
        torch.testing.assert_close(measured(x, w, buf)[0], _many_small_calls(x, w, ref_buf)[0], rtol=1e-5, atol=1e-5)
    trial = measured.last
    assert trial.settling["kgen"] == inner_done_after and trial.settling["eager"] == 1, trial.settling
    assert measured.is_settled() and measured.chosen()
    never = runtime.MeasuredGraph({"kgen": kgen, "eager": eager}, state=[1, 2], replayable=False,
                                  settled={"kgen": lambda: False})
    for _ in range(runtime.SETTLING_CALLS + 2):
        never(torch.randn(3, 8), w, buf)
    assert never.last.settling["kgen"] == runtime.SETTLING_CALLS and len(never.last.ms[("kgen", False)]) == 1


class _FakeGraph:
    """A CUDA graph on the CPU: the capture runs the function once on the static inputs; a replay runs it again on
    them and writes its results into the captured outputs' memory, as a replay overwrites them."""

    def __init__(self):
        self.fn = None

    def replay(self):
        fresh = self.fn()
        for old, new in zip(self.out if isinstance(self.out, (tuple, list)) else [self.out],
                            fresh if isinstance(fresh, (tuple, list)) else [fresh]):
            if isinstance(old, torch.Tensor):
                old.copy_(new)


def test_a_measured_graph_replays_with_its_inputs_copied_and_its_state_in_place(monkeypatch, measured_as_on_a_gpu):
    """The replay's bookkeeping on the CPU (a stand-in graph, forced to be chosen): each call's input reaches the
    graph's own copy, the buffer is updated where it lies, the returned outputs are copies (a later replay does not
    change them), and a parameter moved elsewhere is measured and captured afresh."""
    from kgen import runtime

    monkeypatch.setattr(runtime, "CHOICE_MARGIN", -1e9)  # (each form measured later is chosen: the last, replayed)
    captures = []

    class Capture:  # (a capture computes nothing: the buffer's update inside it is undone)
        def __init__(self, graph, **kw):
            self.graph = graph

        def __enter__(self):
            captures.append(self.graph)
            self.before = buf.clone()

        def __exit__(self, *exc):
            buf.copy_(self.before)
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    real_capture = runtime.MeasuredGraph._capture

    def capture(self, fn, args):
        graph, static_args, static_out = real_capture(self, fn, args)
        graph.fn, graph.out = (lambda: fn(*static_args)), static_out
        return graph, static_args, static_out

    monkeypatch.setattr(runtime.MeasuredGraph, "_capture", capture)
    measured = runtime.MeasuredGraph({"kgen": _fewer_calls, "eager": _many_small_calls}, state=[1, 2], replayable=True)
    w, buf = torch.randn(8), torch.zeros(8)
    ref_buf = buf.clone()
    kept = []
    steps = 2 + 4 * runtime.REPLAY_TRIALS
    for i in range(steps + 3):
        if i == steps + 2:
            w = w.clone()  # the parameter moved: measured again
        x = torch.randn(3, 8)
        out, _ = measured(x, w, buf)
        torch.testing.assert_close(out, _many_small_calls(x, w, ref_buf)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buf, ref_buf, rtol=1e-6, atol=1e-6)
        kept.append((out, out.clone()))
    assert measured.chosen() == [] and len(captures) == 2  # (kgen's and PyTorch's replays, then measured afresh)
    for out, copy in kept:
        assert torch.equal(out, copy)  # later replays left the returned outputs alone


def test_a_form_measured_later_must_be_faster_by_the_margin():
    """Three timed calls are noisy: kgen's direct calls stay chosen unless another form is CHOICE_MARGIN faster."""
    from kgen.runtime import CHOICE_MARGIN, MeasuredGraph, _Trial

    def chosen(replayed_ms, eager_ms):
        trial = _Trial()
        trial.ms = {("kgen", False): [1.0, 1.1, 0.9], ("kgen", True): [replayed_ms] * 3, ("eager", False): [eager_ms] * 3,
                    ("eager", True): None}
        MeasuredGraph._choose(trial)
        return trial.chosen

    near = 1.0 - CHOICE_MARGIN / 2
    assert chosen(near, near) == ("kgen", False)
    assert chosen(0.9, near) == ("kgen", True)
    assert chosen(0.9, 0.9 * near) == ("kgen", True)  # (not faster than the replay by the margin)
    assert chosen(near, 0.8) == ("eager", False)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("replayable", [True, False])
def test_cuda_measured_graph_equals_each_form_through_the_measurement(replayable, measured_forms):
    """Each call's result and the buffer updated in place equal the direct computation's, through the warm-ups,
    the timed calls, the captures and after the choice (whichever it is: a timing); the parameter is read where
    it lies (an in-place change is seen); a new batch is a signature measured on its own."""
    from kgen.runtime import REPLAY_TRIALS, MeasuredGraph

    measured = MeasuredGraph({"kgen": _fewer_calls, "eager": _many_small_calls}, state=[1, 2], replayable=replayable)
    w, buf = torch.randn(8, device="cuda"), torch.zeros(8, device="cuda")
    ref_buf = buf.clone()
    steps = 2 + 2 * REPLAY_TRIALS * (2 if replayable else 1)  # warm-ups, then each form's timed calls
    for i in range(steps + 4):
        if i == steps + 1:
            w.mul_(-1.0)
        x = torch.randn(3 if i < steps + 3 else 5, 8, device="cuda")
        out, n = measured(x, w, buf)
        ref, _ = _many_small_calls(x, w, ref_buf)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buf, ref_buf, rtol=1e-5, atol=1e-5)
        assert n == x.shape[0]
    chosen = measured.chosen()
    assert len(chosen) == 1 and len(measured.trials) == 2, chosen  # batch 3 chosen, batch 5 still measured
    assert chosen[0] in (["kgen", "eager", "kgen replayed", "eager replayed"] if replayable else ["kgen", "eager"])
    trial = next(iter(measured.trials.values()))
    assert len(trial.entries) == (1 if chosen[0].endswith("replayed") else 0)  # the other graphs' memory back


@pytest.mark.cuda
@needs_cuda
def test_cuda_backend_runs_a_model_as_eager_computes_it(measured_forms):
    """A small transformer layer in training mode (dropout 0) and a batch norm under the backend at batch 2: many
    short calls, the case a replay is for; its results over calls with new inputs, and the batch norm's running
    statistics, equal eager's whichever form the measurement chooses."""
    from kgen import backend
    from kgen.backend import kgen_backend

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True),
        torch.nn.Flatten(0, 1), torch.nn.BatchNorm1d(32)).cuda()
    ours = torch.compile(__import__("copy").deepcopy(model), backend=kgen_backend)
    before = len(backend.GRAPHS)
    with torch.no_grad():
        for _ in range(40):  # (its partitions measure their forms in ~9 calls, then the graph its own in ~14)
            x = torch.randn(2, 5, 32, device="cuda")
            torch.testing.assert_close(ours(x), model(x), rtol=1e-4, atol=1e-4)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ours._orig_mod.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    graphs = backend.GRAPHS[before:]
    assert graphs and all(g["replay"] is None and g["measured"]().chosen() for g in graphs), graphs
