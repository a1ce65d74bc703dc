"""What a generated module needs at import: its library, built on first use, and
the autograd formula of its op."""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from .errors import KgenError

# module name -> the library that registered its kgen::NAME ops in this process
_LOADED: dict = {}


def load_library(module_file: str) -> str:
    """Build (if needed) and load the library of the generated module at ``module_file``.

    Loading registers the module's ``kgen::NAME`` ops with the dispatcher, which takes one
    definition per name: a second library of the same name (another output folder, another
    build) would abort the process while it loads, so that is refused here with the reason.
    """
    from .build import ensure_built

    here = Path(module_file).resolve().parent
    lib = str(ensure_built(here))
    name = here.name
    prior = _LOADED.get(name)
    if prior is None and hasattr(torch.ops.kgen, name):
        prior = "a library loaded before"
    if prior is not None and prior != lib:
        raise KgenError(f"kgen::{name} is already registered in this process (by {prior}); loading {lib} as well "
                        "would abort it: one module per name and process (give the spec another `name`, or "
                        "import it in a new process)")
    torch.ops.load_library(lib)
    _LOADED[name] = lib
    return lib


def set_member(root: torch.nn.Module, path: str, value) -> None:
    """``root.<path> = value`` for a member path of a nested model (``layer1.0.conv1``): the
    containers on the way (``layer1``, ``layer1.0``) are created as plain ``torch.nn.Module``s
    where missing, so parameter names and state_dict keys are the path's. The reference model
    and generated modules create their members through this."""
    *outer, last = path.split(".")
    owner = root
    for part in outer:
        child = owner._modules.get(part)
        if child is None:
            if hasattr(owner, part):
                raise KgenError(f"cannot create the container '{part}' of {path}: "
                                f"{type(owner).__name__} already has an attribute '{part}'")
            child = torch.nn.Module()
            owner.add_module(part, child)
        owner = child
    setattr(owner, last, value)


def init_members(root: torch.nn.Module, inits) -> None:
    """Re-initialize members as the original model's __init__ did after creating them:
    ``inits`` is ((state_dict name, torch.nn.init function, its keyword arguments), ...), applied
    in order (the same random draws after the same seed). The reference model and generated
    modules with a spec's ``constructor.init`` call this after creating their members."""
    for name, fn, kwargs in inits:
        owner, _, attr = name.rpartition(".")
        module = root.get_submodule(owner)
        tensor = module._parameters.get(attr)
        if tensor is None:
            tensor = module._buffers.get(attr)
        if tensor is None:
            raise KgenError(f"{type(root).__name__} has no parameter or buffer '{name}' to re-initialize")
        getattr(torch.nn.init, fn)(tensor, **kwargs)


# op name -> (the spec's original pipeline, state_dict names of the op's parameter arguments)
_PIPELINES: dict = {}


def register_autograd(op: str, spec_data: dict, param_names) -> None:
    """Give ``op`` (``kgen::NAME``) a backward: the vjp of the spec's ops as written
    (no rewrites), recomputed by PyTorch in the op's dtype on the op's device.

    ``spec_data`` is the module's embedded spec (``kgen.spec.spec_to_data``), so
    the module needs no spec file; ``param_names`` the op's parameters in the
    order of its list. The op's arguments are the inputs, the parameters (one
    list), the running statistics (one list, where the pipeline has them), then
    (batch norm, dropout) the mode and the statistics' update weights; gradients
    flow to the inputs and parameters. Registering again (a module imported
    twice) only replaces the pipeline.
    """
    from .ir import build_pipeline
    from .spec import spec_from_data

    pipe = build_pipeline(spec_from_data(spec_data, f"{op} (embedded spec)"))
    missing = sorted({a.name for a in pipe.tensor_args()} - set(param_names))
    if missing:  # the op must take every tensor the spec's ops read
        raise KgenError(f"{op}: the op takes no argument for {', '.join(missing)}; run `kgen render` again")
    first = op not in _PIPELINES
    _PIPELINES[op] = (pipe, tuple(param_names))
    if first:
        torch.library.register_autograd(op, _Backward(op), setup_context=_SetupContext(op))


def op_result(op: str):
    """How the registered op ``op`` (``kgen::NAME``, its module imported) lays out its result: ``ir.OpResult``."""
    return _PIPELINES[op][0].op_result()


def _op_arguments(pipe, args) -> tuple:
    """The op's arguments as (inputs, parameters, running statistics, the rest: mode, update weights)."""
    named = dict(zip(pipe.op_signature(), args))
    inputs = tuple(named[n] for n in ["x", *pipe.input_names[1:]])
    return inputs, list(named["params"]), list(named.get("buffers", [])), tuple(named[n] for n in ("training", "factors") if n in named)


class _SetupContext:
    """Saves the inputs and parameters for the backward, and copies of the running statistics
    (the module updates its buffers in place after the op, which saving them would refuse)."""

    def __init__(self, op: str):
        self.op = op

    def __call__(self, ctx, inputs, output):
        pipe, _ = _PIPELINES[self.op]
        tensors, params, buffers, rest = _op_arguments(pipe, inputs)
        ctx.training = any(v is True for v in rest if isinstance(v, bool))
        ctx.buffers = [t.detach().clone() for t in buffers]
        ctx.save_for_backward(*tensors, *params)


class _Backward:
    def __init__(self, op: str):
        self.op = op

    def __call__(self, ctx, *out_grads):
        pipe, names = _PIPELINES[self.op]
        # one gradient per output (the running statistics' after them get none)
        out_grads = pipe.op_result().output_grads(out_grads)
        grad = out_grads if pipe.several_outputs else out_grads[0]
        saved = ctx.saved_tensors
        k = len(pipe.input_names)
        inputs, params = saved[:k], saved[k : k + len(names)]
        buffers = ctx.buffers
        buffer_names = [b.name for b in pipe.buffer_args()]
        # needs_input_grad has the op's arguments' structure: a list of flags for each list
        needs_inputs, needs_params, _, rest = _op_arguments(pipe, ctx.needs_input_grad)
        # in the op's dtype, as its forward ran (autocast_call runs it with autocast off)
        with torch.autocast(saved[0].device.type, enabled=False):
            grads = pipeline_vjp(pipe, names, inputs[0], params, grad, [*needs_inputs, *needs_params], inputs=inputs[1:],
                                 buffers=dict(zip(buffer_names, buffers)), training=ctx.training)
        # a gradient per argument, a list of them for a list (none for the running statistics)
        lists = [list(grads[k:])] + ([[None] * len(buffers)] if pipe.buffer_args() else [])
        return (*grads[:k], *lists, *(None for _ in rest))


def pipeline_vjp(pipe, names, x, params, grad, needs, inputs=(), buffers=None, training=False) -> tuple:
    """Gradients of ``pipe.run(x, params)`` against ``grad`` for the tensors ``needs`` marks
    (x, then the other ``inputs``, then ``params``; None for the others): the pipeline
    is run again with autograd on (batch norm on copies of its running statistics).
    With several outputs ``grad`` has one gradient per output (None: the output is unused).

    Under ``create_graph`` (grad mode is on in a backward then) the recomputation
    is recorded on the inputs' own graphs, so double backward is correct too.
    """
    create = torch.is_grad_enabled()
    with torch.enable_grad():
        tensors = [x, *inputs, *params]
        if not create:
            tensors = [t.detach().requires_grad_(bool(n)) for t, n in zip(tensors, needs)]
        k = 1 + len(inputs)
        env = dict(zip(names, tensors[k:]))
        env.update({n: b.clone() for n, b in (buffers or {}).items()})
        y = pipe.run(tensors[0], env, inputs=dict(zip(pipe.input_names[1:], tensors[1:k])), training=training)
        wanted = [t for t, n in zip(tensors, needs) if n]
        ys, gs = ((y,), (grad,)) if not pipe.several_outputs else (y, tuple(grad))
        pairs = [(o, g) for o, g in zip(ys, gs) if g is not None and o.requires_grad]
        if pairs and wanted:
            found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=create,
                                        allow_unused=True)
        else:  # no output with a gradient depends on what needs one
            found = (None,) * len(wanted)
        grads = iter(found)
    out = []
    for t, n in zip(tensors, needs):
        g = next(grads) if n else None
        out.append(torch.zeros_like(t) if n and g is None else g)  # an input the output ignores
    return tuple(out)


# (op, device type, autocast dtype, the tensor arguments' dtypes, training) -> (compute dtype, output dtypes)
_AUTOCAST: dict = {}
_HALF_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def autocast_call(op: str, call, args: tuple, dtypes: tuple, spec_path: str):
    """The module's forward under ``torch.autocast`` for x's device: what eager PyTorch computes
    there, in the dtypes it returns.

    Eager under autocast runs each op of the spec (as written) in the dtype autocast's op lists and
    type promotion give it: a convolution or matmul in the autocast dtype, a norm or softmax in
    float32 where the device's list says so, an op with a float32 parameter operand promoted back
    to float32. Those dtypes come from running the spec's ops on fake tensors under the same
    autocast state (``autocast_plan``, once per argument dtypes). Where every op's result has one
    dtype (the whole chain in the autocast dtype, or none touched by autocast) the op runs the
    module's plans of that dtype, its inputs and parameters cast to it as autocast casts a
    convolution's; where eager mixes dtypes the op computes float32 (at least as accurate as
    eager's rounded intermediates). Each output is then cast to eager's dtype for it. The op runs
    with autocast off, so its ATen calls keep its dtype.
    """
    x = args[0]
    device = x.device.type
    pipe, names = _PIPELINES[op]
    n_tensors = len(pipe.input_names) + len(names) + len(pipe.buffer_args())
    tensors, extra = args[:n_tensors], args[n_tensors:]
    training = any(v is True for v in extra if isinstance(v, bool))
    compute, out_dtypes = autocast_plan(op, device, torch.get_autocast_dtype(device), tuple(t.dtype for t in tensors),
                                        training, dtypes, spec_path)
    with torch.autocast(device, enabled=False):
        out = call(*(t.to(compute) if t.is_floating_point() else t for t in tensors), *extra)
    if isinstance(out, torch.Tensor):
        return out.to(out_dtypes[0])
    k = len(out_dtypes)  # the op's list: the outputs, then the running statistics (Model.forward copies them into its buffers)
    return [*(o.to(d) for o, d in zip(out[:k], out_dtypes)), *out[k:]]


@torch.compiler.assume_constant_result  # torch.compile takes the decision at trace time, as a constant
def autocast_plan(op: str, device: str, autocast_dtype, arg_dtypes: tuple, training: bool, dtypes: tuple,
                  spec_path: str):
    """(the dtype the op computes in, eager's dtype of each output) under autocast to ``autocast_dtype`` for
    ``device``, for arguments of ``arg_dtypes``: see ``autocast_call``. A 16-bit compute dtype the module has no
    plans for is float32's (with a warning naming the spec edit that adds it); where float32 is not rendered
    either, a RuntimeError says what to add. Decided once per arguments (``_AUTOCAST``)."""
    key = (op, device, autocast_dtype, arg_dtypes, training)
    if key not in _AUTOCAST:
        _AUTOCAST[key] = _autocast_plan(op, device, autocast_dtype, arg_dtypes, training, dtypes, spec_path)
    return _AUTOCAST[key]


def _autocast_plan(op, device, autocast_dtype, arg_dtypes, training, dtypes, spec_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    pipe, names = _PIPELINES[op]
    k = len(pipe.input_names)
    shapes = {a.name: a.shape for a in pipe.tensor_args() + pipe.buffer_args()}
    arg_shapes = [pipe.values[n].concrete(2) for n in pipe.input_names] + [shapes[n] for n in names] + \
        [b.shape for b in pipe.buffer_args()]
    results: list = []
    with FakeTensorMode():  # eager's dtypes without computing anything: the spec's ops on fake tensors
        fake = [torch.empty(shape, dtype=d, device=device) for shape, d in zip(arg_shapes, arg_dtypes)]
        env = dict(zip(list(names) + [b.name for b in pipe.buffer_args()], fake[k:]))
        with torch.autocast(device, dtype=autocast_dtype), torch.no_grad():
            outs = pipe.run(fake[0], env, inputs=dict(zip(pipe.input_names[1:], fake[1:k])), training=training,
                            record=results)
    outs = outs if isinstance(outs, tuple) else (outs,)
    flow = {r.dtype for r in results if r.is_floating_point()}
    compute = flow.pop() if len(flow) == 1 else torch.float32
    if pipe.buffer_args() and compute.itemsize < arg_dtypes[-1].itemsize:
        compute = torch.float32  # running statistics kept in 16 bits would lose the small updates
    rendered = [d for d in _HALF_NAMES if _HALF_NAMES[d] in dtypes]
    if compute != arg_dtypes[0] and compute not in rendered:  # (x's own dtype: the op refuses it if unrendered)
        name = _HALF_NAMES.get(compute, str(compute))
        if torch.float32 not in rendered:
            raise RuntimeError(
                f"{op}: under torch.autocast eager PyTorch computes this spec's ops in {name}, but this module was "
                f"rendered for {', '.join(dtypes)} only; add {name} to `dtype:` under `input:` in {spec_path} and "
                f"run `kgen all {spec_path}`")
        warnings.warn(
            f"{op}: under torch.autocast eager PyTorch computes this spec's ops in {name}; this module has no "
            f"{name} plans, so it computes float32 and returns {name} (add {name} to `dtype:` under `input:` in "
            f"{spec_path} and run `kgen all {spec_path}` for 16-bit speed)", stacklevel=4)
        compute = torch.float32
    return compute, tuple(o.dtype for o in outs)


# ---------------------------------------------------------------------------------------------
# CUDA-graph replay of an op's kernels

_GRAPHS_ENV = "KGEN_CUDA_GRAPHS"  # "0": every call launches its kernels one by one
MEASURE_ENV = "KGEN_MEASURE"  # "0": MeasuredGraph runs its first form (kgen's), never measured
_graphs_off = 0  # > 0 inside launches_one_by_one()


class launches_one_by_one:
    """Within this context generated modules launch their kernels one by one (no CUDA-graph
    replay): for profilers that time each stage's kernels."""

    def __enter__(self):
        global _graphs_off
        _graphs_off += 1

    def __exit__(self, *exc):
        global _graphs_off
        _graphs_off -= 1


def replay_saving_s(dispatch_s: float, argument_bytes: int, target=None) -> float:
    """Seconds a call saves by replaying its kernels as one CUDA graph (negative: it loses): the host's
    dispatch of the call that the GPU waits for (``dispatch_s``: the cost model's launches and library calls
    against its kernels' times, kgen.cost.exposed_dispatch_s) against the replay's own launch and the bytes it
    moves besides the op's. ``argument_bytes``: the bytes of the
    op's inputs, outputs, parameters and running statistics; a replay reads and writes each once at most (the
    inputs copied in, the outputs copied out, weights derived afresh inside the graph)."""
    from .target import current

    t = target or current()
    return dispatch_s - (t.launch_s + REPLAY_COPY_LAUNCHES * t.launch_s + 2 * argument_bytes / t.dram_bytes_per_s)


def replay_pays(dispatch_s: float, argument_bytes: int, target=None) -> bool:
    """Whether replaying a call's kernels as one CUDA graph saves time (``replay_saving_s``)."""
    return replay_saving_s(dispatch_s, argument_bytes, target) > 0


REPLAY_COPY_LAUNCHES = 2  # a replay copies its inputs in and its outputs out
MAX_GRAPHS = 8  # graphs kept per op (call signatures); calls of further signatures launch one by one
MAX_SEEN = 256  # signatures remembered as called once, or as launching one by one


class GraphReplay:
    """An op's kernels replayed as one CUDA graph per call signature, where no autograd graph
    is recorded: a call of many small kernels costs one launch instead of one per kernel.

    A signature is the inputs' shapes, strides and dtypes, the parameters' and buffers'
    storage (a replay reads them in place, so an optimizer's in-place step is seen; a
    module moved or reloaded gets a new graph), the scalar arguments and the stream. The
    first call of a signature launches one by one (cuDNN and cuBLAS choose and allocate
    outside the capture); the second captures, if ``replay_pays``; later calls copy the
    inputs into the graph's own, replay, and return copies of its outputs (a later replay
    overwrites the graph's). Weights a stage derives (packed, re-laid) are derived inside
    the graph, so updates of the parameters are seen. Not used while a CUDA graph is being
    captured by someone else, under KGEN_CUDA_GRAPHS=0, or in launches_one_by_one().
    """

    def __init__(self, op_name: str, dispatch_s: dict):
        from .target import DEFAULT  # (the current device's target would initialize CUDA at import)

        self.op_name = op_name
        # per mode (``any``, or ``train`` and ``eval``: the plan a call runs), the host's dispatch of a call one
        # launch at a time that the GPU waits for (the cost model's); a mode with too little is never worth even
        # the signature's time
        self.dispatch_s = dispatch_s
        self.never = {mode: not replay_pays(s, 0, DEFAULT) for mode, s in dispatch_s.items()}
        self.graphs: dict = {}  # signature -> (graph, static inputs, static outputs)
        self.direct: set = set()  # signatures that launch one by one (replay does not pay, or capture failed)
        self.seen: set = set()  # signatures called once
        self.lock = threading.Lock()

    @staticmethod
    def enabled(x) -> bool:
        return isinstance(x, torch.Tensor) and x.is_cuda and _replays_allowed()

    def __call__(self, op, *args, mode: str = "any"):
        if self.never[mode] or not self.enabled(args[0]):
            return _call_below_autograd(op, args)
        key = _signature(args)
        with self.lock:
            entry = self.graphs.get(key)
            if entry is None:
                if key in self.direct or key not in self.seen:
                    out = _call_below_autograd(op, args)
                    if key not in self.direct:
                        _remember(self.seen, key)
                        if len(self.graphs) >= MAX_GRAPHS or \
                                not replay_pays(self.dispatch_s[mode], _argument_bytes(args, out)):
                            _remember(self.direct, key)
                    return out
                entry = self._capture(op, args, key)
                if entry is None:
                    return _call_below_autograd(op, args)
            graph, static_in, static_out = entry
            for s, a in zip(static_in, _inputs(args)):
                s.copy_(a)
            graph.replay()
            return _map_tensors(static_out, torch.Tensor.clone)

    def _capture(self, op, args, key):
        captured = _captured(lambda static_args: _call_below_autograd(op, tuple(static_args)), args,
                             lambda i: True, self.op_name)
        if captured is None:  # an op that cannot be captured (a host sync): launch one by one
            _remember(self.direct, key)
            return None
        graph, static_args, static_out = captured
        entry = (graph, _inputs(static_args), static_out)
        self.graphs[key] = entry
        return entry


def _replays_allowed() -> bool:
    """CUDA-graph replay is on: not KGEN_CUDA_GRAPHS=0, not in launches_one_by_one(), not inside a capture of
    someone else's."""
    return not _graphs_off and os.environ.get(_GRAPHS_ENV, "1") != "0" and not torch.cuda.is_current_stream_capturing()


def _captured(run, args, copied, what: str):
    """``run(static_args)`` captured as one CUDA graph, ``static_args`` being ``args`` with each tensor ``args[i]``
    that ``copied(i)`` names copied into the graph's own (the others read where they lie): (graph, static args,
    static outputs), or None, with a warning, where the capture fails."""
    static_args = []
    with torch.inference_mode(False):  # normal tensors: later calls outside inference mode copy into them
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and copied(i):
                static = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                static.copy_(a)
                a = static
            static_args.append(a)
    graph = torch.cuda.CUDAGraph()
    generator = _generator_of(static_args)
    stream = torch.cuda.current_stream() if generator is not None else None
    spare = generator.clone_state() if generator is not None else None
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may run CUDA meanwhile
            static_out = run(static_args)
    except RuntimeError as e:
        # a capture that fails at its end leaves the capture's stream current and the CUDA generator in its capture
        # (the next random draw fails: "Offset increment outside graph capture"): both put back
        if generator is not None:
            torch.cuda.set_stream(stream)
            generator.graphsafe_set_state(spare)
        warnings.warn(f"{what}: not replayed as a CUDA graph, its capture failed: {str(e).splitlines()[0]}",
                      stacklevel=4)
        return None
    return graph, static_args, static_out


def _generator_of(args):
    """The default CUDA generator of the device of the first CUDA tensor of ``args`` (None without one, or where
    torch cannot swap a generator's state)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if device is None or not hasattr(torch.Generator, "graphsafe_set_state"):
        return None
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def _remember(signatures: set, key) -> None:
    """Add ``key``, forgetting them all first past MAX_SEEN (signatures that never repeat: a batch norm's
    update weight that changes every call)."""
    if len(signatures) > MAX_SEEN:
        signatures.clear()
    signatures.add(key)


def _call_below_autograd(op, args):
    # No graph to record: call the kernels below torch.library's Python autograd kernel, as that
    # kernel itself does without grad mode (it costs ~8 us a call on the host).
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _inputs(args) -> list:
    """The op's input tensors: its tensor arguments outside lists (parameters and buffers come as lists)."""
    return [a for a in args if isinstance(a, torch.Tensor)]


def _signature(args) -> tuple:
    x = args[0]
    key = [torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device))
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            key.append(tuple(map(torch.Tensor.data_ptr, a)))  # parameters or buffers: where they lie
        elif isinstance(a, (list, tuple)):
            key.append(tuple(a))
        else:
            key.append(a)
    return tuple(key)


def _argument_bytes(args, out) -> int:
    """The bytes of the op's tensors (``replay_pays``): its inputs, outputs, parameters and running statistics."""
    tensors = [*_inputs(args), *_flat_tensors(out),
               *(t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat_tensors(out) -> list:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


def _map_tensors(out, fn):
    if isinstance(out, torch.Tensor):
        return fn(out)
    return type(out)(fn(t) if isinstance(t, torch.Tensor) else t for t in out)


# ---------------------------------------------------------------------------------------------
# A whole compiled graph (the backend's): the fastest of its forms, measured

REPLAY_TRIALS = 3  # calls of each form timed, with the queue drained before each, before the fastest is kept
CHOICE_MARGIN = 0.02  # a form measured later is chosen where its median is this much faster than the best before
SETTLING_CALLS = 16  # untimed calls of a form whose inner measurements (its partitions') are not done, at most


class _Trial:
    """One call signature's measurement: each form's times, the captured graphs, the form chosen."""

    def __init__(self):
        self.ms: dict = {}  # (form, replayed) -> milliseconds of its timed calls
        self.entries: dict = {}  # form -> (graph, static inputs, static outputs) once captured
        self.chosen: tuple | None = None  # (form, replayed)
        self.text = ""  # the choice and the times it was made on, in words
        # form -> its untimed calls: the first (cuDNN and cuBLAS choose and allocate outside any capture), then any
        # while the measurements inside it are not done
        self.settling: dict = {}
        self.state: list = []  # where the model's parameters and buffers lay when it was measured


class MeasuredGraph:
    """A graph Dynamo compiled, run in the fastest of its forms, measured per call signature: ``forms`` (name ->
    callable of the graph's arguments: kgen's partitions with the calls left to PyTorch, and the graph as PyTorch
    computes it all), each called directly and, where ``replayable`` and on a GPU, replayed as one CUDA graph. A
    graph of many small calls (a transformer at batch 10) spends more time on the host, issuing each call, than the
    GPU spends computing, and a replay issues them all at once (what torch.compile's ``mode="reduce-overhead"`` does for
    inductor's graphs); a partition whose kernels lose to PyTorch's in place (the cost model's error) loses the
    measurement, and PyTorch's form runs.

    ``state``: the argument indices of the model's parameters and buffers, read in place by a replay (it sees an
    optimizer's in-place step and updates running statistics where they lie); a replay copies the other tensors into the
    graph's own inputs and returns copies of its outputs. Per signature (the inputs' shapes, strides and dtypes,
    the scalars) each form is called once untimed, then ``REPLAY_TRIALS`` times timed (its replay
    captured first), and the fastest median is kept (``CHOICE_MARGIN``; the other graphs' memory goes back; graphs are kept for
    MAX_GRAPHS signatures at most, later ones choose among the direct forms). The signature is the
    inputs' alone (a call of a graph of 100 parameters is keyed in microseconds); where the model's state lies is
    compared where a graph was captured, and a model moved or reloaded is measured afresh. ``replayable`` is the
    caller's: a graph that writes into an input (a copy would take the write) or syncs with the host (a failed
    capture leaves the CUDA generator unusable) is not. Measured on the CPU too (direct calls only: a partition
    whose loops lose to ATen's runs ATen's); not where autograd records, inside a capture by someone else, under
    KGEN_MEASURE=0, or for CUDA tensors under KGEN_CUDA_GRAPHS=0 or in launches_one_by_one(); there the direct
    form chosen for the inputs runs, or where none is, the first form."""

    def __init__(self, forms: dict, state, replayable: bool, name: str = "graph", on_choice=None, settled=None):
        self.forms, self.state, self.replayable, self.name = dict(forms), frozenset(state), replayable, name
        self.on_choice = on_choice  # called with a line saying what was chosen, for each signature
        # form -> whether the measurements inside it are done (a graph's partitions measure their own forms in
        # its first calls): until then the form is called untimed, at most SETTLING_CALLS times
        self.settled = dict(settled or {})
        self.first = next(iter(self.forms.values()))
        self.inputs: list | None = None
        self.trials: dict = {}
        self.last: _Trial | None = None  # the trial of the latest measured call
        self.lock = threading.Lock()

    def _measured(self, args) -> bool:
        tensors = [args[i] for i in self.inputs if isinstance(args[i], torch.Tensor)]
        return (bool(tensors) and os.environ.get(MEASURE_ENV, "1") != "0"
                and (not tensors[0].is_cuda or _replays_allowed())
                and not (torch.is_grad_enabled() and any(a.requires_grad for a in args if isinstance(a, torch.Tensor))))

    def _on_gpu(self, args) -> bool:
        """Whether the inputs are CUDA tensors: their forms are replayed too, and timed with the queue drained."""
        return next(args[i] for i in self.inputs if isinstance(args[i], torch.Tensor)).is_cuda

    def _signature(self, args) -> tuple:
        """The inputs' shapes, strides and dtypes and the scalars (cheap: a graph of 100 parameters is called in
        microseconds); where the state lies is compared only where a graph was captured."""
        return tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                     for a in (args[i] for i in self.inputs))

    def _where_state_lies(self, args) -> list:
        return [args[i].data_ptr() for i in sorted(self.state)]

    def chosen(self) -> list:
        """The form chosen for each signature measured so far: "kgen", "eager replayed", ..."""
        return [_form_name(t.chosen) for t in self.trials.values() if t.chosen]

    def choices(self) -> list:
        """Each measured signature's choice with the times it was made on, in words."""
        return [t.text for t in self.trials.values() if t.chosen]

    def is_settled(self) -> bool:
        """Whether the latest measured call's signature has its form chosen (the measurement is over)."""
        return self.last is None or self.last.chosen is not None

    def __call__(self, *args):
        if self.inputs is None:  # (the graph's arguments that are not the model's state: its inputs and sizes)
            self.inputs = [i for i in range(len(args)) if i not in self.state]
        key = None
        if self.trials:  # a direct form chosen for these inputs runs first of all, the cheapest path (under autograd
            key = self._signature(args)  # too, and inside the capture of an enclosing graph: a partition's)
            trial = self.trials.get(key)
            if trial is not None and trial.chosen is not None and not trial.chosen[1]:
                return self.forms[trial.chosen[0]](*args)
        if not self._measured(args):
            return self.first(*args)
        if key is None:
            key = self._signature(args)
        with self.lock:
            trial = self.trials.get(key)
            if trial is not None and trial.entries and trial.state != self._where_state_lies(args):
                trial = None  # the model moved or reloaded: its graphs read the old tensors
            if trial is None:
                if len(self.trials) >= MAX_SEEN:
                    self.trials.clear()
                trial = self.trials[key] = _Trial()
                trial.state = self._where_state_lies(args)
            self.last = trial
            if trial.chosen is not None:
                return self._run(trial, trial.chosen, args)
            on_gpu = self._on_gpu(args)
            for form, replayed, round_ in self._turns(self.replayable and on_gpu):
                times = trial.ms.setdefault((form, replayed), [])
                if times is None or len(times) > round_:
                    continue
                untimed, settled = trial.settling.get(form, 0), self.settled.get(form)
                if not untimed or (settled is not None and not settled() and untimed < SETTLING_CALLS):
                    trial.settling[form] = untimed + 1
                    return self.forms[form](*args)
                if replayed and form not in trial.entries:
                    if sum(1 for t in self.trials.values() if t.entries and t is not trial) >= MAX_GRAPHS:
                        trial.ms[(form, replayed)] = None  # (graphs kept for MAX_GRAPHS signatures already)
                        continue
                    entry = self._capture(self.forms[form], args)
                    if entry is None:
                        trial.ms[(form, replayed)] = None  # (not capturable: never chosen)
                        return self.forms[form](*args)
                    trial.entries[form] = entry
                out, ms = _timed(lambda: self._run(trial, (form, replayed), args), on_gpu)
                times.append(ms)
                return out
            self._choose(trial)  # (every form measured)
            trial.text = self._choice_text(trial, args)
            if self.on_choice is not None:
                self.on_choice(trial.text)
            return self._run(trial, trial.chosen, args)

    def _turns(self, replayable: bool):
        """(form, replayed, round) in the order of the timed calls: the forms in turns, one timed call each a round,
        so that a drift of the clocks over the first calls weighs on every form alike."""
        for round_ in range(REPLAY_TRIALS):
            for form in self.forms:
                for replayed in ((False, True) if replayable else (False,)):
                    yield form, replayed, round_

    def _choice_text(self, trial: _Trial, args) -> str:
        shapes = ", ".join("x".join(map(str, args[i].shape)) for i in self.inputs if isinstance(args[i], torch.Tensor))
        times = ", ".join(f"{_form_name(k)} {_median(t):.3f}" if t else f"{_form_name(k)} -"
                          for k, t in trial.ms.items())
        kind, replayed = trial.chosen
        return (f"{self.name} ({shapes}) runs {kind}'s form{' replayed as one CUDA graph' if replayed else ''} "
                f"(median ms of {REPLAY_TRIALS} calls: {times})")

    @staticmethod
    def _choose(trial: _Trial) -> None:
        # in the order measured (kgen's form first, direct before replayed): a later form is chosen where it is
        # faster by more than CHOICE_MARGIN, so three timed calls' noise does not trade kgen's direct calls for
        # a replay's copies or for PyTorch's form
        medians = {k: _median(t) for k, t in trial.ms.items() if t}
        best = next(iter(medians))
        for k, ms in medians.items():
            if ms < (1.0 - CHOICE_MARGIN) * medians[best]:
                best = k
        trial.chosen = best
        trial.entries = {f: e for f, e in trial.entries.items() if trial.chosen == (f, True)}

    def _run(self, trial: _Trial, how: tuple, args):
        form, replayed = how
        if not replayed:
            return self.forms[form](*args)
        graph, static_args, static_out = trial.entries[form]
        for i in self.inputs:
            if isinstance(args[i], torch.Tensor):
                static_args[i].copy_(args[i])
        graph.replay()
        return _map_tensors(static_out, torch.Tensor.clone)

    def _capture(self, fn, args):
        return _captured(lambda static_args: fn(*static_args), args, lambda i: i not in self.state, f"kgen: {self.name}")


def _form_name(how: tuple) -> str:
    """``(form, replayed)`` in words: "kgen", "eager replayed", ..."""
    return f"{how[0]}{' replayed' if how[1] else ''}"


def _median(times: list) -> float:
    return sorted(times)[len(times) // 2]


def _timed(fn, on_gpu: bool):
    """``fn()`` and its milliseconds, on a GPU with the queue drained before and after (as KernelBench times a
    call)."""
    import time

    if on_gpu:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if on_gpu:
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3
