"""What a generated module needs at import: its library, built on first use, and
the autograd formula of its op."""
from __future__ import annotations

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
    the module needs no spec file; ``param_names`` the op's parameter arguments
    in order. The op's arguments are the inputs, the parameters, the running
    statistics, then (batch norm, dropout) the mode and the statistics' update
    weights; gradients flow to the inputs and parameters. Registering again (a
    module imported twice) only replaces the pipeline.
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


class _SetupContext:
    """Saves the inputs and parameters for the backward, and copies of the running statistics
    (the module updates its buffers in place after the op, which saving them would refuse)."""

    def __init__(self, op: str):
        self.op = op

    def __call__(self, ctx, inputs, output):
        pipe, names = _PIPELINES[self.op]
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        k = len(pipe.input_names) + len(names)
        ctx.training = any(v is True for v in inputs if isinstance(v, bool))
        ctx.extra = [v for v in inputs if not isinstance(v, torch.Tensor)]
        ctx.buffers = [t.detach().clone() for t in tensors[k:]]
        ctx.save_for_backward(*tensors[:k])


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
        needs = ctx.needs_input_grad
        grads = pipeline_vjp(pipe, names, inputs[0], params, grad, needs[: k + len(names)], inputs=inputs[1:],
                             buffers=dict(zip(buffer_names, buffers)), training=ctx.training)
        return tuple(grads) + (None,) * len(buffers) + (None,) * len(ctx.extra)


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
