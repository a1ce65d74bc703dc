"""What a generated module needs at import: its library, built on first use, and
the autograd formula of its op."""
from __future__ import annotations

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


def _op_arguments(pipe, args) -> tuple:
    """The op's arguments as (inputs, parameters, running statistics, the rest: mode, update weights)."""
    k = len(pipe.input_names)
    n_lists = 2 if pipe.buffer_args() else 1
    buffers = args[k + 1] if n_lists == 2 else []
    return tuple(args[:k]), list(args[k]), list(buffers), tuple(args[k + n_lists:])


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
        grad = out_grads[: len(pipe.outputs)] if pipe.several_outputs else out_grads[0]
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
    k = len(out_dtypes)  # the outputs, then the running statistics (Model.forward copies them into its buffers)
    return tuple(o.to(d) for o, d in zip(out[:k], out_dtypes)) + tuple(out[k:])


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
