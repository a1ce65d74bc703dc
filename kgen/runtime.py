"""What a generated module needs at import: its library, built on first use, and
the autograd formula of its op."""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import KgenError

def load_library(module_file: str) -> str:
    """Build (if needed) and load the library of the generated module at ``module_file``.

    Loading registers the module's ``kgen::NAME`` ops with the dispatcher.
    """
    from .build import ensure_built

    lib = ensure_built(Path(module_file).resolve().parent)
    torch.ops.load_library(str(lib))
    return str(lib)


# op name -> (the spec's original pipeline, state_dict names of the op's parameter arguments)
_PIPELINES: dict = {}


def register_autograd(op: str, spec_data: dict, param_names) -> None:
    """Give ``op`` (``kgen::NAME``) a backward: the vjp of the spec's ops as written
    (no rewrites), recomputed by PyTorch in the op's dtype on the op's device.

    ``spec_data`` is the module's embedded spec (``kgen.spec.spec_to_data``), so
    the module needs no spec file; ``param_names`` the op's parameter arguments
    in order. Registering again (a module imported twice) only replaces the pipeline.
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
        torch.library.register_autograd(op, _Backward(op), setup_context=_setup_context)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


class _Backward:
    def __init__(self, op: str):
        self.op = op

    def __call__(self, ctx, grad):
        pipe, names = _PIPELINES[self.op]
        x, *params = ctx.saved_tensors
        return pipeline_vjp(pipe, names, x, params, grad, ctx.needs_input_grad)


def pipeline_vjp(pipe, names, x, params, grad, needs) -> tuple:
    """Gradients of ``pipe.run(x, params)`` against ``grad`` for the inputs ``needs`` marks
    (None for the others): the pipeline is run again with autograd on.

    Under ``create_graph`` (grad mode is on in a backward then) the recomputation
    is recorded on the inputs' own graphs, so double backward is correct too.
    """
    create = torch.is_grad_enabled()
    with torch.enable_grad():
        inputs = [x, *params]
        if not create:
            inputs = [t.detach().requires_grad_(bool(n)) for t, n in zip(inputs, needs)]
        y = pipe.run(inputs[0], dict(zip(names, inputs[1:])))
        wanted = [t for t, n in zip(inputs, needs) if n]
        grads = iter(torch.autograd.grad(y, wanted, grad, create_graph=create, allow_unused=True))
    out = []
    for t, n in zip(inputs, needs):
        g = next(grads) if n else None
        out.append(torch.zeros_like(t) if n and g is None else g)  # an input the output ignores
    return tuple(out)
