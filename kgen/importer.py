"""`kgen import`: a PyTorch model file -> specs/NAME.yaml.

The model is a file in KernelBench's layout (``class Model``, ``get_inputs()``,
``get_init_inputs()``) or ``package.module:Class`` with input shapes. It is
constructed with its constructor arguments, traced with ``torch.fx``
(symbolic tracing keeps the submodules as calls, so ``nn.Conv2d`` arrives as a
module with its fields, and records each call's source line), its shapes are
evaluated on the meta device (no computation) at two batch sizes, and each
call becomes one spec op. A value read twice (``x * torch.sigmoid(x)``,
``x + original_x``) gets a name (``as:``, from the source's assignment where
there is one); a second input is an input of the spec.

Before anything is written the spec is checked three ways: it loads and plans
(every op has a family), the model built from it initializes like the original
under the same seed (free parameters: randn, ones, zeros or a constant; the
torch.nn.init calls __init__ makes after creating its layers are recorded and
replayed), and it computes what the original computes (float64, batch 1,
training and eval mode). An unsupported call is one error naming the call and its file:line;
nothing is written then.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import keyword
import math
import operator
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn.functional as F
import yaml
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import KgenError, one_line
from .fields import IDENT, MAX_NAME, MAX_PATH, PATH
from .names import module_name_reason, path_reason, reserved_reason
from .ops import masked_fill_nonzero
from .spec import DTYPES, MAX_RANK

MAX_CHECKED_PARAMS = 2**26  # parameter elements up to which the equivalence check runs in float64 (else float32)
MAX_REAL_PARAMS = 2**28  # parameter elements up to which the model is built for real to check its init and output


class ImportFailed(KgenError):
    """A model kgen cannot import; one line naming the call and where it is."""


# ------------------------------------------------------------------ loading


@dataclass
class Source:
    """The model to import: its class, constructor arguments, example inputs and file."""

    cls: type
    init_args: list
    inputs: list[torch.Tensor]
    file: str  # the file its forward is in (for file:line in errors)
    shown: str  # how the spec and messages name it
    stem: str
    # kgen.compile: the live model (its constructor arguments unknown; its weights are its own) and
    # the files of its modules' classes besides ``file`` (a call in any of them is the user's line)
    instance: nn.Module | None = None
    files: tuple = ()


def load_source(source: str, input_shapes: list[tuple[int, ...]] | None = None) -> Source:
    """``FILE.py`` (KernelBench layout) or ``package.module:Class``."""
    if ":" in source and not source.endswith(".py"):
        modname, _, clsname = source.partition(":")
        try:
            mod = importlib.import_module(modname)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's: say which
            raise ImportFailed(f"{source}: cannot import {modname}: {type(e).__name__}: {one_line(e, 200)}") from None
        cls = getattr(mod, clsname, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ImportFailed(f"{source}: {modname} has no nn.Module class {clsname}")
        file = inspect.getsourcefile(cls) or source
        stem = clsname
    else:
        path = Path(source)
        if not path.is_file():
            raise ImportFailed(f"{source}: no such file")
        name = f"_kgen_import_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001
            raise ImportFailed(f"{_where_in(e, path)}: the model file fails to load: {type(e).__name__}: {one_line(e, 200)}") from None
        cls = getattr(mod, "Model", None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ImportFailed(f"{source}: no nn.Module class named Model (KernelBench layout: Model, get_inputs, get_init_inputs)")
        file, stem = str(path.resolve()), path.stem
    init_args = list(mod.get_init_inputs()) if hasattr(mod, "get_init_inputs") else []
    if input_shapes:
        inputs = [torch.empty(s, device="meta") for s in input_shapes]
    elif hasattr(mod, "get_inputs"):
        inputs = _meta_inputs(mod.get_inputs)
    else:
        raise ImportFailed(f"{source}: no get_inputs(); give the input shapes with --input-shape")
    return Source(cls, init_args, inputs, file, source, stem)


def _meta_inputs(get_inputs) -> list[torch.Tensor]:
    """The example inputs' shapes and dtypes, without allocating them (they may be huge)."""
    with torch.device("meta"):
        try:
            inputs = get_inputs()
        except Exception:  # noqa: BLE001 - some code needs real tensors: make them
            inputs = None
    if inputs is None:
        inputs = get_inputs()
    return list(inputs)


def _where_in(e: BaseException, path: Path) -> str:
    """file:line of the innermost frame of ``e`` in ``path`` (the file itself if none)."""
    target = str(Path(path).resolve())
    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        if str(Path(frame.filename).resolve()) == target:
            line = frame.lineno
    if isinstance(e, SyntaxError) and e.lineno:
        line = e.lineno
    return f"{path}:{line}" if line else str(path)


@contextlib.contextmanager
def _registrations(events: list):
    """Within: each parameter and buffer any module registers is appended to ``events`` as
    (module, name), in order (``self.w = nn.Parameter(...)`` registers through register_parameter)."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module, name, param):
        if param is not None:
            events.append((module, name))
        return register_parameter(module, name, param)

    def buffer(module, name, tensor, persistent=True):
        if tensor is not None:
            events.append((module, name))
        return register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


# Tensor methods that re-initialize a tensor, as the torch.nn.init function they equal (the same
# draws: nn.init.normal_ is Tensor.normal_ under no_grad) with their argument names
_INIT_METHODS = {"normal_": ("normal_", ("mean", "std")), "uniform_": ("uniform_", ("a", "b")),
                 "fill_": ("constant_", ("val",)), "zero_": ("zeros_", ())}
_METHOD_KWARGS = {"from": "a", "to": "b", "value": "val"}
_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                       "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
_NOT_CHANGES = {"requires_grad_", "share_memory_", "retain_grad"}


class _InitRecorder(TorchFunctionMode):
    """Within (while the model is constructed): each re-initialization of a registered parameter or
    buffer after its module was built: ``torch.nn.init`` functions (patched in torch.nn.init) and
    ``Tensor.normal_/uniform_/fill_/zero_`` (also through ``.data``), appended to ``calls`` as
    (module, name, fn, {arg: value}, where, registrations so far). A torch.nn layer initializing
    itself (its reset_parameters) is its own construction, which kgen reproduces by building the
    layer. Other in-place changes of a member, and arguments that are not numbers or strings, are
    refused naming the line."""

    def __init__(self, events: list, file: str):
        super().__init__()
        self.events, self.file = events, file
        self.calls: list = []
        self.owners: dict = {}  # id(tensor) -> (module, name, tensor): registered tensors and their .data
        self.indexed = 0
        self.depth = 0  # > 0 inside a recorded call (its own tensor methods are not calls of the model)
        self.patched: dict = {}

    def __enter__(self):
        from .spec import INIT_ARGS

        for fn in INIT_ARGS:
            original = getattr(nn.init, fn)
            self.patched[fn] = original
            setattr(nn.init, fn, self._wrap(fn, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for fn, original in self.patched.items():
            setattr(nn.init, fn, original)
        return super().__exit__(*exc)

    def _wrap(self, fn, original):
        sig = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if self.depth == 0:
                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError:
                    bound = None  # torch itself says what is wrong
                if bound is not None:
                    given = dict(bound.arguments)
                    self._record(given.pop("tensor", None), fn, given, f"nn.init.{fn}")
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapper

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth == 0 and args and isinstance(args[0], torch.Tensor):
            name = getattr(func, "__name__", "")
            prop = getattr(func, "__self__", None)
            if prop is torch._C.TensorBase.data and name == "__set__" and self._owner(args[0]):
                self._refuse(args[0], "assigns .data of")
            elif name in _INIT_METHODS and getattr(torch.Tensor, name, None) is func:
                fn, names = _INIT_METHODS[name]
                given = dict(zip(names, args[1:]))
                given.update({_METHOD_KWARGS.get(k, k): v for k, v in kwargs.items()})
                self._record(args[0], fn, given, f"Tensor.{name}")
            elif (name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_")
                                                  and name not in _NOT_CHANGES)) \
                    and getattr(torch.Tensor, name, None) is func and self._changes(args[0]):
                self._refuse(args[0], f"changes with Tensor.{name}")
        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        if getattr(func, "__self__", None) is torch._C.TensorBase.data and getattr(func, "__name__", "") == "__get__":
            owner = self._owner(args[0])
            if owner is not None:
                self.owners[id(out)] = (*owner, out, self.owners[id(args[0])][3])
        return out

    def _owner(self, t):
        """(module, name) of the registered parameter or buffer ``t`` is (or is the .data of)."""
        for m, name in self.events[self.indexed:]:
            held = m._parameters.get(name) if name in m._parameters else m._buffers.get(name)
            if held is not None:
                self.owners[id(held)] = (m, name, held, held)
        self.indexed = len(self.events)
        entry = self.owners.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is None or entry[2] is not t:
            return None
        m, name, _, base = entry
        held = m._parameters.get(name) if name in m._parameters else m._buffers.get(name)
        return (m, name) if held is base else None  # still the member (not replaced since)

    def _changes(self, t) -> bool:
        """Whether changing ``t`` now is a change of a member after its module was built."""
        owner = self._owner(t)
        if owner is None:
            return False
        m = owner[0]
        if type(m).__module__.startswith("torch.nn."):  # a torch.nn layer building itself
            f = sys._getframe(1)
            while f is not None:
                if f.f_locals.get("self") is m:
                    return False
                f = f.f_back
        return True

    def _where(self) -> str:
        """file:line of the innermost frame in the model's file (else the innermost outside torch and kgen)."""
        target = str(Path(self.file).resolve())
        outside = None
        for frame in reversed(traceback.extract_stack()):
            if str(Path(frame.filename).resolve()) == target:
                return f"{_shown_path(frame.filename)}:{frame.lineno}"
            if outside is None and not any(s in frame.filename for s in (f"{os.sep}torch{os.sep}", f"{os.sep}kgen{os.sep}")):
                outside = f"{_shown_path(frame.filename)}:{frame.lineno}"
        return outside or _shown_path(self.file)

    def _refuse(self, t, what: str):
        m, name = self._owner(t)
        raise ImportFailed(f"{self._where()}: __init__ {what} the {type(m).__name__}'s '{name}' after creating it; kgen "
                           "replays torch.nn.init functions and Tensor.normal_, uniform_, fill_ and zero_ only")

    def _record(self, t, fn, given: dict, call: str) -> None:
        from .spec import INIT_ARGS

        if not self._changes(t):
            return
        m, name = self._owner(t)
        args = {}
        for k, v in given.items():
            if k == "generator" and v is None:
                continue
            if k not in INIT_ARGS[fn]:
                raise ImportFailed(f"{self._where()}: {call} of the {type(m).__name__}'s '{name}' is given {k}=; kgen "
                                   f"replays it with {', '.join(INIT_ARGS[fn]) or 'no arguments'} only")
            plain = isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
            if not plain:
                shown = f"a {type(v).__name__}" if not isinstance(v, (int, float)) else repr(v)
                raise ImportFailed(f"{self._where()}: {call} of the {type(m).__name__}'s '{name}' has the argument "
                                   f"{k} = {shown}; kgen replays re-initializations whose arguments are finite numbers "
                                   "or strings")
            args[k] = float(v) if isinstance(v, float) else v
        self.calls.append((m, name, fn, args, self._where(), len(self.events), call))


# ------------------------------------------------------------------ the importer


def split_einsums(gm: fx.GraphModule) -> int:
    """Each einsum of three or more operands as einsums of two, left to right (as torch.einsum contracts them
    without opt_einsum): each step keeps the indices a later operand or the result has and sums the others, its
    result ordered as the product gives it (batch dims, the first's, the second's). Mamba2's
    ``bclhn,bhcl,bclhp->bchpn`` becomes ``bclhn,bhcl->bclhn`` (a product, nothing summed) then
    ``bclhn,bclhp->bchpn``. Returns the number of einsums split."""
    split = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.einsum or n.kwargs or not n.args:
            continue
        eq, operands = _einsum_operands(n)
        if not isinstance(eq, str) or len(operands) < 3 or "..." in eq or "->" not in eq:
            continue
        lhs, out = eq.replace(" ", "").split("->")
        subs = lhs.split(",")
        if len(subs) != len(operands):
            continue
        value, have = operands[0], subs[0]

        def call(fn, args):
            made = gm.graph.call_function(fn, args)
            made.meta = dict(n.meta)  # (the source line, for errors)
            return made

        def alone_summed(v, indices: str, beside: str, later: set):
            """``v`` (of ``indices``) with the indices neither ``beside`` nor ``later`` has summed first."""
            alone = [d for d, k in enumerate(indices) if k not in beside and k not in later]
            if not alone:
                return v, indices
            return call(torch.sum, (v, alone)), "".join(k for d, k in enumerate(indices) if d not in alone)

        with gm.graph.inserting_before(n):
            for i in range(1, len(operands)):
                later = set(out).union(*subs[i + 1:])
                value, have = alone_summed(value, have, subs[i], later)
                operand, other = alone_summed(operands[i], subs[i], have, later)
                if i == len(operands) - 1:
                    result = out
                else:
                    both = [k for k in have if k in other and k in later]
                    result = "".join(both + [k for k in have if k not in other and k in later]
                                     + [k for k in other if k not in have and k in later])
                value = call(torch.einsum, (f"{have},{other}->{result}", value, operand))
                have = result
        n.replace_all_uses_with(value)
        gm.graph.erase_node(n)
        split += 1
    if split:
        gm.recompile()
    return split


def _einsum_operands(n: fx.Node) -> tuple:
    """torch.einsum's equation and operands, given one by one or as one list."""
    eq, operands = n.args[0], list(n.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return eq, operands


class _StackTracer(fx.Tracer):
    """torch.fx's tracer, each node's stack trace (from forward on) recorded with Python's traceback
    module: torch's own recording (``record_stack_traces``) imports torch._dynamo on first use, 1.5-3 s
    on a CPU machine, most of a cached ``kgen.compile`` in a new process."""

    # a buffer is a node (get_attr), as a parameter is: MinGPT's ``self.bias[:, :, :T, :T]`` slices its mask by a
    # size of the input, which a real tensor cannot take from a traced value
    proxy_buffer_attributes = True

    def __init__(self):
        # kgen's own calls in a graph the Dynamo backend rewrote are calls, not traced into
        super().__init__(autowrap_functions=(masked_fill_nonzero,))

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        stack = traceback.extract_stack()
        first = next((i for i, f in enumerate(stack) if f.name == "forward"), None)
        if first is not None:
            node.stack_trace = "".join(traceback.StackSummary.from_list(stack[first:]).format()).strip()
        return node



@dataclass(frozen=True)
class _Other:
    """A traced result that is not a tensor (a size, a device, a tuple of tensors)."""

    value: object


@dataclass
class _Value:
    """A traced value: the op that made it (its spec dict), or an input."""

    node: fx.Node
    op: dict | None  # None for an input
    name: str | None = None  # its spec name, once something reads it by name


@dataclass
class Importer:
    src: Source
    name: str
    model: nn.Module = None
    gm: fx.GraphModule = None
    shapes: dict = field(default_factory=dict)  # node -> shape (batch B) or value
    shapes2: dict = field(default_factory=dict)  # the same at batch B + 1
    values: dict = field(default_factory=dict)  # node -> _Value (tensor results and inputs)
    aliases: dict = field(default_factory=dict)  # node -> the node it is the same value as
    ops: list = field(default_factory=list)
    chain: fx.Node | None = None  # the node whose value the last op made
    params: dict = field(default_factory=dict)  # free parameter name -> spec
    used_params: set = field(default_factory=set)
    modules_used: set = field(default_factory=set)
    taken: set = field(default_factory=set)  # names of inputs, values, params, modules
    creation: list = field(default_factory=list)  # (module path, name, index) of each parameter and buffer, as registered
    init_calls: list = field(default_factory=list)  # the re-initializations after creation (_InitRecorder.calls)
    batch: int = 1
    active: set = field(default_factory=set)  # nodes that depend on an input
    real: nn.Module | None = None  # the model with its values (None when it is too large to build here)
    numel: int = 0  # its parameters' elements
    pending: dict = field(default_factory=dict)  # torch.max/min(x, dim) node -> "max" | "min", until its getitem
    transposed: set = field(default_factory=set)  # x.transpose(-2, -1) nodes only a matmul reads, as its operand
    splits: dict = field(default_factory=dict)  # torch.split/chunk node -> (its input, dim, piece bounds), until its getitems
    device: str = "meta"  # where the traced model's tensors are
    outputs: list = field(default_factory=list)  # the values forward returns where it returns several (spec `outputs:`)

    # ---------------------------------------------------------------- entry

    def run(self) -> dict:
        self._construct()
        self._trace()
        self._evaluate_shapes()
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.src.inputs):
            raise ImportFailed(f"{self.src.shown}: forward takes {len(placeholders)} inputs, get_inputs() gives {len(self.src.inputs)}")
        for n in placeholders:
            self._input(n)
        for n in self.gm.graph.nodes:
            constant = n.op == "call_function" and n.target is torch.tensor  # torch.tensor(c, device=x.device)
            if n.op == "placeholder" or (any(a in self.active for a in n.all_input_nodes) and not constant):
                self.active.add(n)
        for n in self.gm.graph.nodes:
            if n.op in ("call_module", "call_function", "call_method"):
                self._node(n)
            elif n.op == "output":
                self._output(n)
        return self._spec()

    # ---------------------------------------------------------------- construction

    def _construct(self) -> None:
        if self.src.instance is not None:
            self._adopt()
            self._check_inputs(DTYPES)
        else:
            self._build()
            self._check_inputs(("float32",))

    def _adopt(self) -> None:
        """kgen.compile: the instance's copy on the meta device, traced and shaped without memory (each
        parameter and buffer replaced by an empty float32 one, so the float32 shape inputs fit; the
        instance keeps its own). Its weights are not drawn: the compiled module takes the instance's."""
        inst = self.src.instance
        memo = {}
        for t in list(inst.parameters()) + list(inst.buffers()):
            meta = torch.empty_like(t, device="meta", dtype=torch.float32 if t.is_floating_point() else t.dtype)
            memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
        try:
            self.model = copy.deepcopy(inst, memo)
        except Exception as e:  # noqa: BLE001 - a member deepcopy refuses (a lock, a file handle)
            raise ImportFailed(f"{self.src.shown}: the model cannot be copied to trace it: {type(e).__name__}: "
                               f"{one_line(e, 200)}") from None
        self.numel = sum(p.numel() for p in inst.parameters())
        self.device = "meta"

    def _build(self) -> None:
        """The model on the meta device (traced and shaped without memory), and built for real
        below if it is not huge; a model whose __init__ needs values (``.item()``) is built on
        the CPU and traced as it is. The order in which parameters and buffers are registered
        while it is built is the order the leaf modules holding them are constructed (their
        __init__ registers them, and draws their init, before a parent stores them)."""
        events = []
        recorder = _InitRecorder(events, self.src.file)  # the re-initializations after members are built
        try:
            with _registrations(events), torch.device("meta"), recorder:
                self.model = self.src.cls(*self.src.init_args)
            on_meta = True
        except ImportFailed:
            raise
        except Exception:  # noqa: BLE001 - e.g. Tensor.item() in __init__: meta tensors have no values
            on_meta = False
        try:
            if on_meta:
                self.numel = sum(p.numel() for p in self.model.parameters())
                if self.numel <= MAX_REAL_PARAMS:
                    torch.manual_seed(0)
                    self.real = self.src.cls(*self.src.init_args)
            else:
                events.clear()
                recorder = _InitRecorder(events, self.src.file)
                torch.manual_seed(0)
                with _registrations(events), recorder:
                    self.model = self.real = self.src.cls(*self.src.init_args)
                self.numel = sum(p.numel() for p in self.model.parameters())
        except ImportFailed:
            raise
        except Exception as e:  # noqa: BLE001
            raise ImportFailed(f"{self._where_exc(e)}: constructing Model(*get_init_inputs()) fails: {type(e).__name__}: "
                               f"{one_line(e, 200)}") from None
        self.device = "meta" if on_meta else "cpu"
        paths = {id(m): p for p, m in self.model.named_modules()}
        self.creation = [(paths[id(m)], name, i) for i, (m, name) in enumerate(events) if id(m) in paths]
        self.init_calls = recorder.calls

    def _check_inputs(self, dtypes) -> None:
        """Tensors of one of ``dtypes`` (all the same), 2 to 5 dims, the batch first and the same in each."""
        for t in self.src.inputs:
            if not isinstance(t, torch.Tensor) or str(t.dtype).removeprefix("torch.") not in dtypes or \
                    t.dtype != self.src.inputs[0].dtype:
                raise ImportFailed(f"{self.src.shown}: every input must be a {' or '.join(dtypes)} tensor (all of one "
                                   f"dtype), got {getattr(t, 'dtype', type(t).__name__)}")
            if t.dim() < 2 or t.dim() > MAX_RANK:
                raise ImportFailed(f"{self.src.shown}: inputs must have 2 to {MAX_RANK} dims (batch first), got shape {list(t.shape)}")
        batches = {t.shape[0] for t in self.src.inputs}
        if len(batches) != 1:
            shapes = ", ".join(str(list(t.shape)) for t in self.src.inputs)
            raise ImportFailed(f"{self.src.shown}: get_inputs() gives inputs of shapes {shapes}; kgen imports models whose "
                               "inputs all have the batch as their first dim (the same size in each)")
        self.batch = batches.pop()

    def _trace(self) -> None:
        tracer = _StackTracer()
        try:
            graph = tracer.trace(self.model)
        except Exception as e:  # noqa: BLE001 - control flow on values, unsupported Python
            raise ImportFailed(f"{self._where_exc(e)}: torch.fx cannot trace forward: {type(e).__name__}: "
                               f"{one_line(e, 200)}") from None
        self.gm = fx.GraphModule(self.model, graph)
        split_einsums(self.gm)
        # an in-place call whose result is not used (`x.relu_()` as a statement) still changes x
        self.gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or self._in_place(n) is not None)

    def _evaluate_shapes(self) -> None:
        """Each node's result on the meta device at batch B and B + 1: shapes for tensors,
        values for sizes; a size that follows the batch is the batch."""
        meta = self.gm.eval()
        for batch, out in ((self.batch, self.shapes), (self.batch + 1, self.shapes2)):
            make = torch.empty if self.device == "meta" else torch.randn  # meta: no values (randn costs 0.3 s there once)
            inputs = [make((batch,) + tuple(t.shape[1:]), device=self.device) for t in self.src.inputs]
            recorder = self

            class Shapes(fx.Interpreter):
                def run_node(self, n):
                    try:
                        r = super().run_node(n)
                    except Exception as e:  # noqa: BLE001
                        raise ImportFailed(f"{recorder._where(n)}: {recorder._call(n)} fails on the example inputs: "
                                           f"{type(e).__name__}: {one_line(e, 160)}") from None
                    out[n.name] = tuple(r.shape) if isinstance(r, torch.Tensor) else _Other(r)
                    return r

            Shapes(meta).run(*inputs)
        for table in (self.shapes, self.shapes2):  # by the traced graph's own nodes
            by_name = dict(table)
            table.clear()
            table.update({n: by_name[n.name] for n in self.gm.graph.nodes if n.name in by_name})

    # ---------------------------------------------------------------- values

    def _input(self, n: fx.Node) -> None:
        name = str(n.target)
        if not IDENT.match(name) or len(name) > MAX_NAME or (name != "x" and reserved_reason(name)):
            raise ImportFailed(f"{self._where(n)}: forward's argument '{name}' cannot name a spec input; rename it "
                               "(lower case, not a name the generated code uses)")
        self.values[n] = _Value(n, None, name)
        self.taken.add(name)
        if self.chain is None:
            self.chain = n

    def _resolve(self, n):
        while isinstance(n, fx.Node) and n in self.aliases:
            n = self.aliases[n]
        return n

    def _tensor(self, n) -> bool:
        return isinstance(n, fx.Node) and isinstance(self.shapes.get(self._resolve(n)), tuple) and \
            self._resolve(n) in self.values

    def _shape(self, n) -> tuple:
        return self.shapes[self._resolve(n)]

    def _name_of(self, n: fx.Node, part: str | None = None) -> str:
        """The spec name of value ``n``, naming it (``as:`` on the op that made it) if it has none; ``part``: what
        the value is on the way to ``n`` (an op of several computing n: its operand, its norm)."""
        v = self.values[self._resolve(n)]
        if v.name is None:
            v.name = self._fresh(f"{v.node.name}_{part}" if part else self._assigned_name(v.node) or v.node.name)
            v.op[next(iter(v.op))]["as"] = v.name
            self.taken.add(v.name)
        return v.name

    def _fresh(self, base: str) -> str:
        base = re.sub(r"[^a-z0-9_]", "_", base.lower()).strip("_") or "v"
        if not base[0].isalpha():
            base = "v_" + base
        base = base[: MAX_NAME - 4]
        name, i = base, 1
        while name in self.taken or reserved_reason(name) or name == "x":
            name, i = f"{base}_{i}", i + 1
        return name

    def _assigned_name(self, n: fx.Node) -> str | None:
        """The variable the source assigns the call to (``x_conv = self.conv(x)``), when it is
        one plain name other than the chain's usual ``x``."""
        line = self._source_line(n)
        m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=[^=]", line or "")
        if m and m.group(1) not in self.taken and m.group(1) not in ("x", "out"):
            return m.group(1)
        return None

    # ---------------------------------------------------------------- ops

    def _emit(self, n: fx.Node, kind: str, fields: dict | None = None, src: fx.Node | None = None) -> None:
        """Append spec op ``kind`` computing node ``n`` from ``src`` (default: the chain)."""
        src = self._resolve(src if src is not None else self.chain)
        args = dict(fields or {})
        if src is not self.chain:
            args["from"] = self._name_of(src)
        op = {kind: args}
        self.ops.append(op)
        self.values[n] = _Value(n, op)
        self.chain = n
        shape = self.shapes[n]
        if not isinstance(shape, tuple) or not shape or self.shapes2[n][0] != shape[0] + 1 or \
                shape[1:] != self.shapes2[n][1:]:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} gives shape {list(shape) if isinstance(shape, tuple) else shape}, "
                               "which does not keep the batch as its first dim")

    def _alias(self, n: fx.Node, of) -> None:
        self.aliases[n] = self._resolve(of)
        if isinstance(self.shapes.get(n), tuple) and self._resolve(of) in self.values:
            pass

    def _node(self, n: fx.Node) -> None:
        if n not in self.active:
            return  # parameters, their views, constants: read where they are used
        if not isinstance(self.shapes.get(n), tuple):
            self._nontensor(n)
            return
        if n.op == "call_module":
            self._module(n, self.gm.get_submodule(n.target))
        else:
            self._function(n)
        self._mutated(n)

    def _in_place(self, n: fx.Node):
        """The operand an in-place call changes (``x.relu_()``, ``x.add_(y)``, ``F.relu(x, inplace=True)``,
        ``nn.ReLU(inplace=True)``, ``out += y``), or None."""
        x = n.args[0] if n.args else None
        if not isinstance(x, fx.Node):
            return None
        if n.op == "call_method":
            return x if _in_place_name(n.target) else None
        if n.op == "call_module":
            return x if getattr(self.gm.get_submodule(n.target), "inplace", False) is True else None
        if n.op != "call_function":
            return None
        if n.target in _IN_PLACE_OPERATORS or _in_place_name(getattr(n.target, "__name__", "")):
            return x
        try:
            return x if _arguments(n).get("inplace") is True else None
        except TypeError:
            return None

    def _mutated(self, n: fx.Node) -> None:
        """After an in-place call, the operand it changed reads as its result (the result is a new
        value of the spec; later reads of the operand take it)."""
        target = self._in_place(n)
        if target is None or n not in self.active:
            return
        t, r = self._resolve(target), self._resolve(n)
        if t is not r and t in self.values and r in self.values:
            self.aliases[t] = r

    def _args(self, n: fx.Node) -> dict:
        """``n``'s arguments by parameter name (``_arguments``); a call they do not fit is named."""
        try:
            return _arguments(n)
        except TypeError as e:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)}: its arguments do not fit it: {one_line(e, 120)}") from None

    def _nontensor(self, n: fx.Node) -> None:
        """Sizes, devices, dtypes and tuples: fine as long as they only feed shapes and constants;
        a tuple of tensors (torch.max with a dim) is resolved by its getitem."""
        fn = n.target
        if fn in (torch.max, torch.min, "max", "min") and self._tensor(n.args[0]) and self._dim_arg(n) is not None:
            self.pending[n] = "max" if fn in (torch.max, "max") else "min"  # values and indices: the getitem picks
        elif fn in _SPLITS and self._tensor(n.args[0]):
            self._split(n)

    def _function(self, n: fx.Node) -> None:
        fn, args, kw = n.target, list(n.args), dict(n.kwargs)
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", str(fn))
        # the values of torch.max(x, dim) / x.max(dim): getitem 0 or .values
        if (fn is operator.getitem or fn is getattr) and len(args) == 2 and args[0] in self.pending:
            if args[1] in (0, "values"):
                self._reduce(n, args[0], self.pending[args[0]])
                return
            raise ImportFailed(f"{self._where(n)}: the indices of torch.max/torch.min are not supported")
        if fn is operator.getitem and len(args) == 2 and args[0] in self.splits:
            self._split_piece(n, args[0], args[1])
            return
        x = args[0] if args else None
        if self._layout(n, fn, name, args, kw):
            return
        if n.op == "call_method" and name in _ALIAS_METHODS or (n.op == "call_function" and fn in _ALIAS_FUNCTIONS):
            self._alias(n, x)
            return
        if n.op == "call_method" and name in _VIEW_METHODS or fn in (torch.flatten, torch.reshape, torch.squeeze,
                                                                         torch.unsqueeze):
            if not self._tensor(x):
                return self._unsupported(n)
            self._reshape(n, x)
            return
        if _elementwise_binary(n):
            self._binary(n)
            return
        if fn is masked_fill_nonzero or fill_mask(n) is not None or n.op == "call_method" and name == "masked_fill_":
            self._masked_fill(n)
            return
        if _nonzero_of(n) is not None and n.users and all(fill_mask(u) is n for u in n.users):
            return  # ``t != 0`` as a masked_fill's mask: the masked_fill reads t
        unary = _UNARY.get(fn) if n.op == "call_function" else _UNARY_METHODS.get(name)
        if unary is not None and self._tensor(x):
            kind, fields = unary(self._args(n))
            self._emit(n, kind, fields, src=x)
            return
        if (fn in (torch.clamp, torch.clip, torch.clamp_, torch.clip_) or
                (n.op == "call_method" and _base_name(name) in ("clamp", "clip", "clamp_min", "clamp_max"))):
            self._clamp(n, _base_name(name))
            return
        if fn is torch.einsum:
            self._einsum(n)
            return
        if fn is F.normalize and self._tensor(x):
            self._normalize(n, x)
            return
        if (fn in _POWERS or (n.op == "call_method" and _base_name(name) in ("pow", "square"))) and self._tensor(x):
            exponent = 2 if _base_name(getattr(fn, "__name__", name)) == "square" else \
                n.args[1] if len(n.args) > 1 else n.kwargs.get("exponent")  # (operator.pow's are a, b)
            self._power(n, x, exponent)
            return
        if (fn in _NORMS or (n.op == "call_method" and name == "norm")) and self._tensor(x):
            self._norm2(n, x)
            return
        if (fn is torch.cumsum or n.op == "call_method" and name == "cumsum") and self._tensor(x):
            self._cumsum(n, x)
            return
        if fn in _REDUCTIONS or (n.op == "call_method" and name in _REDUCTION_METHODS):
            self._reduce(n, n, _REDUCTIONS.get(fn) or _REDUCTION_METHODS[name])
            return
        if fn in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax) or \
                (n.op == "call_method" and name in ("softmax", "log_softmax")):
            dim = self._args(n).get("dim")
            if not isinstance(dim, int):
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} needs an integer dim")
            self._emit(n, "log_softmax" if "log" in name else "softmax", {"dim": dim}, src=x)
            return
        if _is_matmul(n):
            self._matmul(n)
            return
        if fn in _POOLS:
            self._pool_function(n, fn)
            return
        if fn in _ADAPTIVE:
            bound = self._args(n)
            self._adaptive(n, x, _ADAPTIVE[fn], bound.get("output_size"), bound.get("return_indices", False))
            return
        if fn is F.dropout:
            a = self._args(n)
            if a.get("training", True) is False:  # F.dropout(x, p, training=False) is x
                self._alias(n, x)
                return
            self._emit(n, "dropout", {"p": float(a.get("p", 0.5))}, src=x)
            return
        self._unsupported(n)

    def _module(self, n: fx.Node, m: nn.Module) -> None:
        x = n.args[0] if n.args else None
        if not self._tensor(x) or len(n.args) != 1 or n.kwargs:
            return self._unsupported(n)
        attr = str(n.target)  # its path: `conv`, or `layer1.0.conv1` in a nested model
        owns_state = any(True for _ in m.parameters()) or any(True for _ in m.buffers())
        if owns_state:
            reason = _path_reason(attr)
            if reason:
                raise ImportFailed(f"{self._where(n)}: the submodule name '{attr}' cannot be used ({reason})")
            if attr in self.modules_used:
                raise ImportFailed(f"{self._where(n)}: self.{attr} is called twice; kgen gives every op its own weights")
            self.modules_used.add(attr)
            self.taken.update({attr, attr.replace(".", "_")})
        t = type(m)
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            self._conv(n, m, attr)
        elif isinstance(m, nn.Linear):
            self._emit(n, "linear", _drop_defaults({"out_features": m.out_features, "bias": m.bias is not None, "name": attr},
                                                   {"bias": True}), src=x)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            self._emit(n, "batch_norm", _drop_defaults({
                "eps": m.eps, "momentum": m.momentum, "affine": m.affine, "track_running_stats": m.track_running_stats,
                "name": attr}, {"eps": 1e-5, "momentum": 0.1, "affine": True, "track_running_stats": True}), src=x)
        elif isinstance(m, nn.GroupNorm):
            self._emit(n, "group_norm", _drop_defaults({"num_groups": m.num_groups, "eps": m.eps, "affine": m.affine,
                                                        "name": attr}, {"eps": 1e-5, "affine": True}), src=x)
        elif isinstance(m, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
            if m.track_running_stats:
                raise ImportFailed(f"{self._where(n)}: instance norm with track_running_stats=True is not supported")
            self._emit(n, "instance_norm", _drop_defaults({"eps": m.eps, "affine": m.affine, "name": attr},
                                                          {"eps": 1e-5, "affine": False}), src=x)
        elif isinstance(m, nn.LayerNorm):
            self._emit(n, "layer_norm", _drop_defaults({
                "normalized_shape": list(m.normalized_shape), "eps": m.eps, "elementwise_affine": m.elementwise_affine,
                "bias": m.bias is not None or not m.elementwise_affine, "name": attr},
                {"eps": 1e-5, "elementwise_affine": True, "bias": True}), src=x)
        elif isinstance(m, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
            self._pool(n, t.__name__, m.kernel_size, m.stride, m.padding, getattr(m, "dilation", 1), m.ceil_mode,
                       getattr(m, "count_include_pad", True), getattr(m, "return_indices", False),
                       getattr(m, "divisor_override", None))
        elif isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                            nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
            self._adaptive(n, x, "max" if "Max" in t.__name__ else "avg", m.output_size, getattr(m, "return_indices", False))
        elif isinstance(m, nn.Upsample):
            self._interpolate(n, x, m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor)
        elif isinstance(m, (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d)):
            self._pad(n, x, list(m.padding), m.value)
        elif isinstance(m, nn.Flatten):  # a view: its shape says what it keeps
            self._reshape(n, x)
        elif isinstance(m, nn.Dropout):
            self._emit(n, "dropout", {"p": float(m.p)}, src=x)
        elif isinstance(m, (nn.Softmax, nn.LogSoftmax)):
            if m.dim is None:
                raise ImportFailed(f"{self._where(n)}: {t.__name__} without a dim")
            self._emit(n, "softmax" if isinstance(m, nn.Softmax) else "log_softmax", {"dim": m.dim}, src=x)
        elif isinstance(m, nn.Identity):
            self._alias(n, x)
        elif t in _UNARY_MODULES:
            kind, fields = _UNARY_MODULES[t](m)
            self._emit(n, kind, fields, src=x)
        else:
            self._unsupported(n)

    def _conv(self, n, m, attr) -> None:
        if m.padding_mode != "zeros":
            raise ImportFailed(f"{self._where(n)}: {type(m).__name__} with padding_mode={m.padding_mode!r} is not supported")
        if isinstance(m.padding, str):
            if m.padding != "valid":
                raise ImportFailed(f"{self._where(n)}: {type(m).__name__} with padding={m.padding!r} is not supported")
            padding = [0] * len(m.kernel_size)
        else:
            padding = list(m.padding)
        transposed = "Transpose" in type(m).__name__
        rank = len(m.kernel_size)
        kind = f"conv_transpose{rank}d" if transposed else f"conv{rank}d"
        fields = {"out_channels": m.out_channels, "kernel_size": _one(m.kernel_size), "stride": _one(m.stride),
                  "padding": _one(padding), "dilation": _one(m.dilation), "groups": m.groups, "bias": m.bias is not None,
                  "name": attr}
        defaults = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1, "bias": True}
        if transposed:
            fields["output_padding"] = _one(m.output_padding)
            defaults["output_padding"] = 0
        self._emit(n, kind, _drop_defaults(fields, defaults), src=n.args[0])

    def _pool(self, n, cls_name, kernel, stride, padding, dilation, ceil_mode, count_include_pad, return_indices,
              divisor_override) -> None:
        if return_indices or divisor_override:
            raise ImportFailed(f"{self._where(n)}: {cls_name} with return_indices or divisor_override is not supported")
        rank = int(cls_name[-2])
        kind = f"{'max' if 'Max' in cls_name or 'max' in cls_name else 'avg'}_pool{rank}d"
        fields = {"kernel_size": _one(kernel), "stride": None if stride in (None, [], ()) else _one(stride),
                  "padding": _one(padding), "ceil_mode": bool(ceil_mode)}
        defaults = {"stride": None, "padding": 0, "ceil_mode": False}
        if kind.startswith("max"):
            fields["dilation"], defaults["dilation"] = _one(dilation), 1
        else:
            fields["count_include_pad"], defaults["count_include_pad"] = bool(count_include_pad), True
        if fields["stride"] == fields["kernel_size"]:
            fields["stride"] = None
        self._emit(n, kind, _drop_defaults(fields, defaults), src=n.args[0])

    def _pool_function(self, n, fn) -> None:
        get = self._args(n).get
        cls = fn.__name__.replace("max_pool", "MaxPool").replace("avg_pool", "AvgPool")
        self._pool(n, cls, get("kernel_size"), get("stride"), get("padding", 0), get("dilation", 1),
                   get("ceil_mode", False), get("count_include_pad", True), get("return_indices", False),
                   get("divisor_override"))

    def _reshape(self, n, x) -> None:
        shape, shape2 = self.shapes[n], self.shapes2[n]
        if self._shape(x) == shape:
            self._alias(n, x)
            return
        if shape2[0] != shape[0] + 1 or shape2[1:] != shape[1:]:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} gives shape {list(shape)}: the batch must stay the "
                               "first dim of a view")
        prev = self.values.get(self._resolve(x))
        if self._resolve(x) is self.chain and prev is not None and prev.op is not None and "reshape" in prev.op \
                and prev.name is None:  # a view of a view: one view
            prev.op["reshape"]["shape"] = list(shape[1:])
            self.values[n] = prev
            self.aliases.pop(n, None)
            self.chain = n
            return
        self._emit(n, "reshape", {"shape": list(shape[1:])}, src=x)

    # ---- ops that move or resample values: cat, permute/transpose, indexing, split, pad, interpolate, expand

    def _layout(self, n: fx.Node, fn, name: str, args: list, kw: dict) -> bool:
        """Maps ``n`` if it is one of these calls; False when it is not."""
        method = n.op == "call_method"
        x = args[0] if args else None
        if fn in (torch.cat, torch.concat, torch.concatenate):
            self._cat(n, kw.get("tensors", x), kw.get("dim", kw.get("axis", args[1] if len(args) > 1 else 0)))
        elif fn is torch.stack:
            self._stack(n, kw.get("tensors", x), kw.get("dim", args[1] if len(args) > 1 else 0))
        elif method and name in ("expand", "expand_as"):  # of a value, or of a parameter (broadcast over the batch)
            self._expand(n, x)
        elif not self._tensor(x):
            return False
        elif (method and name == "permute") or fn is torch.permute:
            dims = kw.get("dims", args[1] if len(args) == 2 else args[1:])
            self._permute(n, x, list(dims) if isinstance(dims, (tuple, list)) else [dims])
        elif (method and name in ("transpose", "swapaxes", "swapdims")) or fn in (torch.transpose, torch.swapaxes,
                                                                                    torch.swapdims):
            self._transpose(n, x, kw.get("dim0", args[1] if len(args) > 1 else None),
                            kw.get("dim1", args[2] if len(args) > 2 else None))
        elif (method and name == "t") or fn is torch.t or (fn is getattr and len(args) == 2 and args[1] == "mT"):
            self._transpose(n, x, -2, -1)
        elif fn is getattr and len(args) == 2 and args[1] == "T":  # every dim reversed: the batch moves
            self._permute(n, x, list(range(len(self._shape(x))))[::-1])
        elif fn is operator.getitem:
            self._index(n, x, args[1])
        elif method and name == "unfold":
            self._unfold(n, x, kw.get("dimension", args[1] if len(args) > 1 else None),
                         kw.get("size", args[2] if len(args) > 2 else None), kw.get("step", args[3] if len(args) > 3 else None))
        elif (method and name == "narrow") or fn is torch.narrow:
            dim = kw.get("dim", args[1] if len(args) > 1 else None)
            start = kw.get("start", args[2] if len(args) > 2 else None)
            length = kw.get("length", args[3] if len(args) > 3 else None)
            self._slices(n, x, [(dim, slice(start, start + length if start >= 0 or start + length < 0 else None))])
        elif fn is F.pad:
            mode = kw.get("mode", args[2] if len(args) > 2 else "constant")
            if mode != "constant":
                raise ImportFailed(f"{self._where(n)}: F.pad with mode={mode!r} is not supported (only 'constant')")
            self._pad(n, x, list(kw.get("pad", args[1] if len(args) > 1 else ())), kw.get("value", args[3] if len(args) > 3 else None))
        elif fn in (F.interpolate, F.upsample):
            b = inspect.signature(F.interpolate).bind(*args, **kw).arguments
            if b.get("antialias"):
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} with antialias=True is not supported")
            self._interpolate(n, x, b.get("size"), b.get("scale_factor"), b.get("mode", "nearest"), b.get("align_corners"),
                              b.get("recompute_scale_factor"))
        else:
            return False
        return True

    def _norm_dim(self, n, x, dim, what: str) -> int:
        rank = len(self._shape(x))
        if not isinstance(dim, int) or not -rank <= dim < rank:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} needs an integer dim of a {rank}-d value, got {dim!r}")
        if dim % rank == 0:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} {what} the batch (dim 0); kgen keeps the batch first "
                               "and whole")
        return dim % rank

    def _cat(self, n, pieces, dim) -> None:
        if not isinstance(pieces, (tuple, list)) or not pieces or not all(self._tensor(p) for p in pieces):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} concatenates something that is not a value of the "
                               "forward (a parameter or a constant)")
        dim = self._norm_dim(n, pieces[0], dim, "concatenates along")
        if len(pieces) == 1:
            self._alias(n, pieces[0])
            return
        names = [self._name_of(p) for p in pieces[1:]]
        self._emit(n, "cat", {"dim": dim, "tensors": names}, src=pieces[0])

    def _stack(self, n, pieces, dim) -> None:
        """torch.stack = a cat along the dim (the last one for a new last dim) viewed with the new dim, then
        for a new last dim the two last dims swapped."""
        if not isinstance(pieces, (tuple, list)) or not pieces or not all(self._tensor(p) for p in pieces):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} stacks something that is not a value of the forward")
        rank = len(self._shape(pieces[0]))
        if not isinstance(dim, int) or not -rank - 1 <= dim <= rank or dim % (rank + 1) == 0:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} must stack along a dim after the batch, got {dim!r}")
        dim %= rank + 1
        shape = self.shapes[n]
        if len(pieces) > 1:
            self._emit(n, "cat", {"dim": min(dim, rank - 1), "tensors": [self._name_of(p) for p in pieces[1:]]}, src=pieces[0])
        if dim < rank:
            self._emit(n, "reshape", {"shape": list(shape[1:])}, src=n if len(pieces) > 1 else pieces[0])
        else:
            self._emit(n, "reshape", {"shape": list(shape[1:-2]) + [shape[-1], shape[-2]]}, src=n if len(pieces) > 1 else pieces[0])
            self._emit(n, "transpose", {"dim0": rank - 1, "dim1": rank}, src=n)

    def _permute(self, n, x, dims) -> None:
        rank = len(self._shape(x))
        if len(dims) != rank or not all(isinstance(d, int) and -rank <= d < rank for d in dims) or \
                sorted(d % rank for d in dims) != list(range(rank)):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} needs a permutation of the {rank} dims, got {dims}")
        dims = [d % rank for d in dims]
        if dims[0] != 0:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} moves the batch (dim 0); kgen keeps it first")
        if dims == list(range(rank)):
            self._alias(n, x)
            return
        moved = [d for d, p in enumerate(dims) if d != p]
        if len(moved) == 2:
            self._emit(n, "transpose", {"dim0": moved[0], "dim1": moved[1]}, src=x)
        else:
            self._emit(n, "permute", {"dims": dims}, src=x)

    def _unfold(self, n, x, dim, size, step) -> None:
        """``x.unfold(dim, size, size)``: windows side by side (ViT's patches) are a view: the dim split into
        (windows, size) and the window's positions moved last, after a slice where the last window would not
        fill. Overlapping or spaced windows (step != size) gather; refused."""
        dim = self._norm_dim(n, x, dim, "unfolds")
        if not isinstance(size, int) or not isinstance(step, int) or size < 1 or step != size:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with size {size!r} and step {step!r}: only windows "
                               "side by side (step == size) are supported")
        shape = list(self._shape(x))
        windows = shape[dim] // size
        if windows < 1:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)}: a window of {size} in a dim of {shape[dim]}")
        src = x
        if windows * size != shape[dim]:
            self._emit(n, "slice", {"dim": dim, "start": 0, "end": windows * size}, src=x)
            src = n
        rank = len(shape)
        self._emit(n, "reshape", {"shape": shape[1:dim] + [windows, size] + shape[dim + 1:]}, src=src)
        if dim + 1 < rank:  # (the window's dim is last already where the unfolded dim was)
            self._emit(n, "permute", {"dims": list(range(dim + 1)) + list(range(dim + 2, rank + 1)) + [dim + 1]}, src=n)

    def _transpose(self, n, x, a, b) -> None:
        a, b = (self._norm_dim(n, x, d, "moves") for d in (a, b))
        rank = len(self._shape(x))
        if a == b:
            self._alias(n, x)
            return
        users = list(n.users)
        if {a, b} == {rank - 2, rank - 1} and len(users) == 1 and _is_matmul(users[0]) and \
                len(users[0].args) == 2 and users[0].args[1] is n and users[0].args[0] is not n:
            # k.transpose(-2, -1) read by q @ it alone: the product takes k transposed (no copy of it)
            self._alias(n, x)
            self.transposed.add(n)
            return
        self._emit(n, "transpose", {"dim0": min(a, b), "dim1": max(a, b)}, src=x)

    def _index(self, n, x, idx) -> None:
        """Basic indexing: slices (a step > 0), integers (a slice of one, the dim dropped), None (a new dim of 1)
        and one Ellipsis; the batch whole."""
        items = list(idx) if isinstance(idx, tuple) else [idx]
        rank = len(self._shape(x))
        if any(not (isinstance(i, (slice, int)) or i is None or i is Ellipsis) or isinstance(i, bool) for i in items) or \
                any(isinstance(v, fx.Node) for i in items if isinstance(i, slice) for v in (i.start, i.stop, i.step)):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)}: only basic indexing (constant slices, integers, None, "
                               "...) is supported")
        if items.count(Ellipsis) > 1:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} has more than one '...'")
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        if Ellipsis in items:
            k = items.index(Ellipsis)
            items[k:k + 1] = [slice(None)] * (rank - used)
        items += [slice(None)] * (rank - sum(1 for i in items if i is not None))
        cuts, d = [], 0
        for i in items:
            if i is None:
                continue
            if d == 0 and i != slice(None):
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} indexes the batch (dim 0); kgen keeps it whole")
            if isinstance(i, int):
                size = self._shape(x)[d]
                if not -size <= i < size:
                    raise ImportFailed(f"{self._where(n)}: index {i} is out of range for dim {d} of size {size}")
                i = slice(i % size, i % size + 1)
            if i != slice(None):
                cuts.append((d, i))
            d += 1
        self._slices(n, x, cuts)

    def _slices(self, n, x, cuts) -> None:
        """A slice op per cut (dim, slice) that is not the whole dim, then a view to ``n``'s shape if it differs."""
        shape, src, emitted = list(self._shape(x)), x, False
        for dim, sl in cuts:
            dim = self._norm_dim(n, x, dim, "slices")
            if sl.step is not None and (not isinstance(sl.step, int) or sl.step < 1):
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} with step {sl.step} (only positive steps)")
            start, end, step = sl.indices(shape[dim])
            if (start, end, step) == (0, shape[dim], 1):
                continue
            count = len(range(start, end, step))
            if count < 1:
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} gives an empty slice of dim {dim}")
            fields = {"dim": dim, "start": start, "end": end}
            if step != 1:
                fields["step"] = step
            self._emit(n, "slice", fields, src=src)
            shape[dim], src, emitted = count, n, True
        if tuple(shape) != self.shapes[n]:
            if emitted:
                self._emit(n, "reshape", {"shape": list(self.shapes[n][1:])}, src=n)
            else:
                self._reshape(n, x)
        elif not emitted:
            self._alias(n, x)

    def _split(self, n) -> None:
        """torch.split / torch.chunk (and the methods): each piece a getitem reads becomes a slice op."""
        x = n.args[0]
        dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
        dim = self._norm_dim(n, x, dim, "splits")
        pieces = self.shapes[n].value
        bounds, at = [], 0
        for p in pieces:
            bounds.append((at, at + p.shape[dim]))
            at += p.shape[dim]
        self.splits[n] = (x, dim, bounds)

    def _split_piece(self, n, split, i) -> None:
        x, dim, bounds = self.splits[split]
        if not isinstance(i, int) or not -len(bounds) <= i < len(bounds):
            raise ImportFailed(f"{self._where(n)}: piece {i!r} of a split of {len(bounds)} pieces")
        start, end = bounds[i]
        self._slices(n, x, [(dim, slice(start, end))])

    def _pad(self, n, x, pad, value) -> None:
        rank = len(self._shape(x))
        if not pad or len(pad) % 2 or not all(isinstance(p, int) for p in pad) or len(pad) // 2 > rank - 1:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with pad {pad}: expected pairs of integers for at most "
                               f"the {rank - 1} dims after the batch")
        if not any(pad):
            self._alias(n, x)
            return
        self._emit(n, "pad", _drop_defaults({"pad": list(pad), "value": float(value or 0.0)}, {"value": 0.0}), src=x)

    def _interpolate(self, n, x, size, scale, mode, align_corners, recompute) -> None:
        if mode not in ("nearest", "bilinear"):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with mode={mode!r} is not supported (nearest, bilinear)")
        if recompute and scale is not None:  # PyTorch maps coordinates by the sizes then
            size, scale = list(self.shapes[n][2:]), None
        fields = {"mode": mode}
        if size is not None:
            fields["size"] = _one(size)
        else:
            fields["scale_factor"] = _one([float(v) for v in scale] if isinstance(scale, (tuple, list)) else float(scale))
        if mode == "bilinear" and align_corners:
            fields["align_corners"] = True
        self._emit(n, "interpolate", _drop_defaults(fields, {"mode": "nearest"}), src=x)

    def _adaptive(self, n, x, kind: str, size, return_indices) -> None:
        if return_indices:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with return_indices=True is not supported")
        if size is None:  # (an argument read under the wrong name would keep every size: refuse instead)
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} needs its output_size")
        spatial = self._shape(x)[2:]
        size = list(size) if isinstance(size, (tuple, list)) else [size] * len(spatial)
        size = [L if s is None else s for s, L in zip(size, spatial)]  # None keeps the input's size
        self._emit(n, f"adaptive_{kind}_pool{len(spatial)}d", {"output_size": _one(size)}, src=x)

    def _expand(self, n, x) -> None:
        """x.expand / expand_as: where every reader is an elementwise op whose other operand has its shape, the
        operand broadcasts as it is (x * s.expand_as(x): `mul: {tensor: s}`); otherwise an expand op."""
        shape = self.shapes[n]
        def broadcasts(user) -> bool:
            if not _elementwise_binary(user) or self.shapes.get(user) != shape:
                return False
            others = [a for a in list(user.args) + list(user.kwargs.values()) if a is not n]
            return len(others) == 1 and self._tensor(others[0]) and self._shape(others[0]) == shape
        if not self._tensor(x):
            self._expand_param(n, x)
            return
        if len(self._shape(x)) == len(shape) and n.users and all(broadcasts(u) for u in n.users):
            self._alias(n, x)
            return
        src_shape = self._shape(x)
        if len(src_shape) != len(shape):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} adds dims in front of the batch")
        self._emit(n, "expand", {"shape": [-1 if a == b else b for a, b in zip(src_shape[1:], shape[1:])]}, src=x)

    def _expand_param(self, n, x) -> None:
        """``self.p.expand(B, ...)`` with B the batch (ViT's class token): the parameter broadcast over the batch,
        an expand op reading the parameter; the first input gives it the batch."""
        param, transpose = self._param_of(x)
        if param is None:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} expands something that is not a value of the forward "
                               "or a parameter of the model")
        if transpose or tuple(self.shapes.get(x, ())) != tuple(self.params[param]["shape"]):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} expands a view of the parameter self.{param}; kgen "
                               "expands the parameter as it is")
        first = next(v.node for v in self.values.values() if v.op is None)
        self._emit(n, "expand", {"param": param, "shape": list(self.shapes[n][1:])}, src=first)

    def _clamp(self, n, name) -> None:
        a = self._args(n)
        lo, hi = a.get("min"), a.get("max")
        for b in (lo, hi):
            if b is not None and not isinstance(b, (int, float)):
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} with tensor bounds is not supported")
        fields = {k: float(v) for k, v in (("min", lo), ("max", hi)) if v is not None}
        self._emit(n, "clamp", fields, src=n.args[0])

    def _dim_arg(self, n):
        if "dim" in n.kwargs:
            return n.kwargs["dim"]
        return n.args[1] if len(n.args) > 1 else None

    def _reduce(self, n, call, kind) -> None:
        """A reduction ``kind`` over ``call``'s dims (``n`` is the node the value comes out as)."""
        x = call.args[0]
        dim = self._dim_arg(call)
        keepdim = call.kwargs.get("keepdim", call.args[2] if len(call.args) > 2 else False)
        if dim is None or dim == () or dim == []:
            raise ImportFailed(f"{self._where(call)}: {self._call(call)} reduces over every dim, the batch too; "
                               "give the dims")
        dims = [dim] if isinstance(dim, int) else list(dim)
        if not all(isinstance(d, int) for d in dims) or not isinstance(keepdim, bool):
            raise ImportFailed(f"{self._where(call)}: {self._call(call)} needs integer dims")
        rank = len(self._shape(x))
        if any(d % rank == 0 for d in dims):
            raise ImportFailed(f"{self._where(call)}: {self._call(call)} reduces over the batch (dim 0)")
        fields = {"dim": dims[0] if len(dims) == 1 else dims}
        if keepdim:
            fields["keepdim"] = True
        self._emit(n, kind, fields, src=x)

    def _cumsum(self, n, x) -> None:
        """torch.cumsum(x, dim) / x.cumsum(dim), in x's dtype."""
        a = self._args(n)
        if a.get("dtype") is not None or a.get("out") is not None:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with dtype= or out= is not supported (x's dtype)")
        self._emit(n, "cumsum", {"dim": self._norm_dim(n, x, a.get("dim"), "sums along")}, src=x)

    def _normalize(self, n, x) -> None:
        """F.normalize(x, p=2, dim, eps) as PyTorch computes it: x / max(sqrt(sum(x * x, dim)), eps)."""
        a = self._args(n)
        p, dim, eps = a.get("p", 2.0), a.get("dim", 1), a.get("eps", 1e-12)
        if p != 2 or a.get("out") is not None or not isinstance(dim, int) or not isinstance(eps, (int, float)):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)}: only p=2 over one integer dim is supported")
        if dim % len(self._shape(x)) == 0:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} normalizes over the batch (dim 0)")
        self._two_norm(n, x, [dim], True)
        self._emit(n, "clamp", {"min": float(eps)}, src=n)
        self._emit(n, "div", {"tensor": self._name_of(n, "norm")}, src=x)  # x / the norm, broadcast over dim

    def _einsum(self, n) -> None:
        """torch.einsum of two values, the batch the first index of both and of the result, as one batched product:
        each operand permuted and reshaped to [batch dims, kept, contracted] (the second taken transposed where that
        is its order: ``bhqd,bhkd->bhqk`` is q @ k^T), the product reshaped and permuted to the result's order."""
        eq, operands = _einsum_operands(n)
        where = f"{self._where(n)}: torch.einsum({eq!r})"
        if not isinstance(eq, str) or len(operands) != 2 or not all(self._tensor(o) for o in operands):
            raise ImportFailed(f"{where}: only an einsum of two values of the forward is supported")
        eq = eq.replace(" ", "")
        if "..." in eq or "->" not in eq:
            raise ImportFailed(f"{where}: give the result's indices ('->'), without '...'")
        lhs, out = eq.split("->")
        (a, sa), (b, sb) = zip(operands, lhs.split(",")) if lhs.count(",") == 1 else ((None, ""), (None, ""))
        if a is None or len(sa) != len(self._shape(a)) or len(sb) != len(self._shape(b)) or \
                any(len(set(t)) != len(t) for t in (sa, sb, out)) or not set(out) <= set(sa) | set(sb):
            raise ImportFailed(f"{where}: the indices do not fit the operands (or repeat within one)")
        if (set(sa) ^ set(sb)) - set(out):
            raise ImportFailed(f"{where}: an index of one operand alone is summed; only indices of both are")
        if not sa[0] == sb[0] == out[0]:
            raise ImportFailed(f"{where}: the batch must be the first index of both operands and of the result")
        size = {k: v for t, x in ((sa, a), (sb, b)) for k, v in zip(t, self._shape(x))}
        if not set(sa) & set(sb) - set(out):  # nothing summed: a product of values, one broadcast to the other
            self._einsum_product(n, where, (a, sa), (b, sb), out, size)
            return
        batch = [k for k in out if k in sa and k in sb]
        left, right = [k for k in out if k not in sb], [k for k in out if k not in sa]
        summed = [k for k in sa if k in sb and k not in out]

        def arranged(x, subs, order, groups) -> bool:
            """Emit x permuted to ``order`` and reshaped to [batch dims, *groups' sizes]; whether anything was."""
            perm, src = [subs.index(k) for k in order], x
            if perm != list(range(len(perm))):
                self._emit(n, "permute", {"dims": perm}, src=src)
                src = n
            shape = [size[k] for k in batch[1:]] + [math.prod(size[k] for k in g) for g in groups]
            reshaped = shape != [size[k] for k in order[1:]]
            if reshaped:
                self._emit(n, "reshape", {"shape": shape}, src=src)
            return src is n or reshaped

        transpose = [k for k in sb if k not in batch] == right + summed and right + summed != summed + right
        order_b = batch + (right + summed if transpose else summed + right)
        b_name = self._name_of(n, "operand") if arranged(b, sb, order_b, [right, summed] if transpose else
                                                          [summed, right]) else self._name_of(b)
        a_src = n if arranged(a, sa, batch + left + summed, [left, summed]) else a
        self._emit(n, "matmul", _drop_defaults({"tensor": b_name, "transpose": transpose}, {"transpose": False}),
                   src=a_src)
        kept = batch + left + right
        if [math.prod(size[k] for k in left), math.prod(size[k] for k in right)] != [size[k] for k in left + right]:
            self._emit(n, "reshape", {"shape": [size[k] for k in kept[1:]]}, src=n)
        if kept != list(out):
            self._emit(n, "permute", {"dims": [kept.index(k) for k in out]}, src=n)

    def _einsum_product(self, n, where: str, first, second, out: str, size: dict) -> None:
        """An einsum that sums no index (``bclhn,bhcl->bclhn``): the operand holding every index of the result
        times the other, permuted to its order and given size-1 dims where it lacks an index, then permuted to
        the result's order."""
        (a, sa), (b, sb) = (first, second) if set(first[1]) == set(out) else (second, first)
        if set(sa) != set(out):
            raise ImportFailed(f"{where}: an outer product (neither operand holds every index of the result)")
        src = b
        dims = [sb.index(k) for k in sa if k in sb]
        if dims != list(range(len(sb))):
            self._emit(n, "permute", {"dims": dims}, src=src)
            src = n
        if len(sb) < len(sa):
            self._emit(n, "reshape", {"shape": [size[k] if k in sb else 1 for k in sa[1:]]}, src=src)
            src = n
        operand = self._name_of(n, "operand") if src is n else self._name_of(b)
        self._emit(n, "mul", {"tensor": operand}, src=a)
        if sa != out:
            self._emit(n, "permute", {"dims": [sa.index(k) for k in out]}, src=n)

    def _power(self, n, x, exponent) -> None:
        """x ** e for the exponents ATen computes by products and roots (its pow_tensor_scalar special cases: x * x,
        x * x * x, sqrt, rsqrt, 1 / x, 1 / (x * x)), as ATen computes them."""
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or \
                float(exponent) not in (1.0, 2.0, 3.0, 0.5, -0.5, -1.0, -2.0):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with exponent {exponent!r}: only 1, 2, 3, 0.5, -0.5, "
                               "-1 and -2 are supported")
        e = float(exponent)
        if e == 1.0:
            self._alias(n, x)
            return
        if e in (0.5, -0.5):
            self._emit(n, "sqrt" if e > 0 else "rsqrt", {}, src=x)
            return
        if e == -1.0:
            self._emit(n, "div", {"scalar": 1.0, "reverse": True}, src=x)
            return
        name = self._name_of(x)
        self._emit(n, "mul", {"tensor": name}, src=x)
        if e == 3.0:
            self._emit(n, "mul", {"tensor": name}, src=n)
        elif e == -2.0:
            self._emit(n, "div", {"scalar": 1.0, "reverse": True}, src=n)

    def _norm2(self, n, x) -> None:
        """The 2-norm over given dims (torch.norm, Tensor.norm, torch.linalg.vector_norm): sqrt(sum(x * x))."""
        a = self._args(n)
        p = a.get("ord", 2) if "ord" in a or n.target is torch.linalg.vector_norm else a.get("p", "fro")
        dim, keepdim = a.get("dim"), a.get("keepdim", False)
        if p not in (2, 2.0, "fro") or a.get("dtype") is not None or a.get("out") is not None:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)}: only the 2-norm is supported")
        dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (tuple, list)) else None
        if not dims or not all(isinstance(d, int) for d in dims) or not isinstance(keepdim, bool):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} needs integer dims (over every dim it takes the batch)")
        if any(d % len(self._shape(x)) == 0 for d in dims):
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} reduces over the batch (dim 0)")
        self._two_norm(n, x, dims, keepdim)

    def _two_norm(self, n, x, dims: list, keepdim: bool) -> None:
        """Emit sqrt(sum(x * x, dims)) as ``n``'s value: the 2-norm as ATen's norm kernels compute it (F.normalize's
        denominator, torch.norm)."""
        self._emit(n, "mul", {"tensor": self._name_of(x)}, src=x)
        self._emit(n, "sum", _drop_defaults({"dim": dims[0] if len(dims) == 1 else dims, "keepdim": keepdim},
                                            {"keepdim": False}), src=n)
        self._emit(n, "sqrt", {}, src=n)

    def _matmul(self, n) -> None:
        a, b = n.args[0], n.args[1]
        if not self._tensor(a):
            return self._unsupported(n)
        param, transpose = self._param_of(b)
        if param is not None:
            shape = self.params[param]["shape"]
            if len(shape) != 2:
                raise ImportFailed(f"{self._where(n)}: {self._call(n)} with a {len(shape)}-d parameter (only 2-d)")
            self._emit(n, "matmul", _drop_defaults({"param": param, "transpose": transpose}, {"transpose": False}), src=a)
        elif self._tensor(b):
            fields = {"tensor": self._name_of(b)}
            if b in self.transposed:
                fields["transpose"] = True
            self._emit(n, "matmul", fields, src=a)
        else:
            self._unsupported(n)

    def _binary(self, n) -> None:
        kind = _binary_kind(n)
        a, b = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
        if n.kwargs.get("alpha", 1) != 1 or n.kwargs.get("rounding_mode") is not None:
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} with alpha or rounding_mode is not supported")
        ta, tb = self._tensor(a), self._tensor(b)
        if not ta and not tb:
            return self._unsupported(n)
        src = None  # what the op reads: the primary operand, or its expansion to the result's shape
        if ta and tb:
            primary, other = (a, b) if self._resolve(b) is not self.chain or self._resolve(a) is self.chain else (b, a)
            # the primary is the operand with the result's shape: the other broadcasts to it
            if self._shape(primary) != self.shapes[n]:
                primary, other = other, primary
            if self._shape(primary) != self.shapes[n]:
                # both broadcast ([B, 1, C] * [B, N, 1]): the first expanded to the result's shape, the other then
                # broadcasting to it as a value operand does
                if not (len(self._shape(a)) == len(self._shape(b)) == len(self.shapes[n])):
                    raise ImportFailed(f"{self._where(n)}: {self._call(n)} broadcasts both operands "
                                       f"{list(self._shape(a))} and {list(self._shape(b))} of different ranks; kgen "
                                       "broadcasts operands of the result's rank")
                name = self._name_of(b)
                self._emit(n, "expand", {"shape": list(self.shapes[n][1:])}, src=a)
                self._emit(n, kind, {"tensor": name}, src=n)
                return
            fields = {"tensor": self._name_of(other)}
        else:
            primary, other = (a, b) if ta else (b, a)
            fields = self._operand(n, other)
            if self._shape(primary) != self.shapes[n]:
                # the operand broadcasts the value (NetVLAD's [B, 1, K] * a [1, D, K] parameter): the value
                # expanded to the result's shape first, as where both operands broadcast
                if len(self._shape(primary)) != len(self.shapes[n]) or self._shape(primary)[0] != self.shapes[n][0]:
                    raise ImportFailed(f"{self._where(n)}: {self._call(n)}: the operand "
                                       f"{list(self._shape_of_operand(other))} broadcasts the value "
                                       f"{list(self._shape(primary))} to {list(self.shapes[n])}; kgen broadcasts a "
                                       "value to the result's shape where both have one rank and one batch")
                self._emit(n, "expand", {"shape": list(self.shapes[n][1:])}, src=primary)
                src = n
        if primary is not a and kind in ("sub", "div"):
            fields["reverse"] = True
        self._emit(n, kind, fields, src=primary if src is None else src)

    def _masked_fill(self, n) -> None:
        """``x.masked_fill(t != 0, value)`` (or ``t.bool()``, or ``masked_fill_nonzero(x, t, value)`` of kgen.ops,
        as the Dynamo backend writes a constant boolean mask): t a value or a parameter broadcast to x."""
        x, mask, value = (list(n.args) + [n.kwargs.get(k) for k in ("mask", "value")[len(n.args) - 1:]])[:3]
        if n.target is not masked_fill_nonzero:
            mask = _nonzero_of(mask)
        in_place = n.op == "call_method" and n.target == "masked_fill_"
        if (mask is None or not self._tensor(x) or self._shape(x) != self.shapes[n] or in_place
                or not isinstance(value, (int, float)) or isinstance(value, bool)):
            return self._unsupported(n)
        fields = {"tensor": self._name_of(mask)} if self._tensor(mask) else self._operand(n, mask)
        if "scalar" in fields:
            return self._unsupported(n)
        self._emit(n, "masked_fill", {**fields, "value": float(value)}, src=x)

    def _shape_of_operand(self, o):
        return self.shapes.get(o, ()) if isinstance(o, fx.Node) else ()

    def _operand(self, n, o) -> dict:
        """A scalar, a constant 0-d tensor, or a free parameter (maybe viewed) as a binary op's operand."""
        if isinstance(o, (int, float)) and not isinstance(o, bool):
            return {"scalar": float(o)}
        const = self._constant(o)
        if const is not None:
            return {"scalar": const}
        param, transpose = self._param_of(o)
        if param is not None and not transpose:
            fields = {"param": param}
            pshape = tuple(self.params[param]["shape"])
            if self.shapes[o] != pshape:
                fields["view"] = list(self.shapes[o])
            return fields
        raise ImportFailed(f"{self._where(n)}: {self._call(n)}: its operand must be a number, a parameter of the model "
                           "or a value of the forward")

    def _constant(self, o) -> float | None:
        """The value of ``torch.tensor(c)``, a constant 0-d tensor attribute, or a number computed from sizes other
        than the batch (MinGPT's ``1.0 / math.sqrt(k.size(-1))``: the same at two batches)."""
        if not isinstance(o, fx.Node):
            return None
        if (literal := tensor_literal(o)) is not None:
            return literal
        here, there = self.shapes.get(o), self.shapes2.get(o)
        if isinstance(here, _Other) and here == there and isinstance(here.value, (int, float)) and \
                not isinstance(here.value, bool):
            return float(here.value)
        if o.op == "get_attr":
            t = _attr(self.gm, o.target)
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.dim() == 0:
                return float(t)
        return None

    def _param_of(self, o) -> tuple[str | None, bool]:
        """(free parameter name, transposed) of ``o``: self.p, or a view/.T/.t() of it."""
        o, transpose = viewed_from(o)
        if not (isinstance(o, fx.Node) and o.op == "get_attr"):
            return None, False
        attr = str(o.target)
        t = _attr(self.gm, attr)
        if not isinstance(t, nn.Parameter):
            return None, False
        reason = _path_reason(attr)
        if reason:
            raise ImportFailed(f"{self._where(o)}: the parameter name '{attr}' cannot be used ({reason})")
        owner = attr.rpartition(".")[0]
        if owner in self.modules_used:
            raise ImportFailed(f"{self._where(o)}: self.{attr} is a parameter of the submodule self.{owner}, which "
                               "forward also calls; kgen gives a called submodule's parameters to its op only")
        if attr not in self.params:
            self.params[attr] = {"shape": list(t.shape)}
            self.taken.update({attr, attr.replace(".", "_")})
        self.used_params.add(attr)
        return attr, transpose

    def _output(self, n: fx.Node) -> None:
        out = n.args[0]
        if isinstance(out, (tuple, list)):
            if len(out) > 1:
                self._outputs(n, out)
                return
            if not out:
                raise ImportFailed(f"{self._where(n)}: forward returns an empty {type(out).__name__}; nothing to compute")
            out = out[0]
        out = self._resolve(out)
        if out not in self.values or self.values[out].op is None:
            raise ImportFailed(f"{self.src.shown}: forward returns an input unchanged; nothing to compute")
        if out is not self.chain:  # the result was made before the last op: read it back (x * 1 is x exactly)
            self.ops.append({"mul": {"scalar": 1.0, "from": self._name_of(out)}})

    def _outputs(self, n: fx.Node, outs) -> None:
        """``return a, b`` (a tuple or list of tensors): the spec's ``outputs:``, each value named; the
        last op's result must be one (ops after the last output compute nothing returned), so where it
        is not, the last output is read back (x * 1 is x exactly) under a name of its own."""
        from .spec import MAX_OUTPUTS

        if len(outs) > MAX_OUTPUTS:
            raise ImportFailed(f"{self._where(n)}: forward returns {len(outs)} values; kgen imports at most {MAX_OUTPUTS}")
        nodes = []
        for i, o in enumerate(outs):
            o = self._resolve(o)
            if not self._tensor(o):
                raise ImportFailed(f"{self._where(n)}: forward's result {i} is not a tensor the model computes; kgen imports "
                                   "a tuple of tensors")
            if self.values[o].op is None:
                raise ImportFailed(f"{self._where(n)}: forward's result {i} is an input returned unchanged; kgen imports "
                                   "outputs that ops compute")
            if o in nodes:
                raise ImportFailed(f"{self._where(n)}: forward returns the same tensor as results {nodes.index(o)} and {i}; "
                                   "kgen returns each value once")
            nodes.append(o)
        names = [self._name_of(o) for o in nodes]
        if self.chain not in nodes:
            last = self._fresh(f"{names[-1]}_out")
            self.taken.add(last)
            self.ops.append({"mul": {"scalar": 1.0, "from": names[-1], "as": last}})
            names[-1] = last
        self.outputs = names

    # ---------------------------------------------------------------- the spec

    def _spec(self) -> dict:
        self._unused_members()
        for name, spec in self.params.items():
            spec["init"] = init_of(self.real.get_parameter(name)) if self.real is not None else "randn"
        inputs = [v for v in self.values.values() if v.op is None]
        batch = "N"
        shapes = {v.name: [batch] + list(self.shapes[v.node][1:]) for v in inputs}
        data = {"name": self.name,
                "description": f"Imported by `kgen import` from {self.src.shown} (class {self.src.cls.__name__}).\n"}
        dtype = str(self.src.inputs[0].dtype).removeprefix("torch.")
        typed = {} if dtype == "float32" else {"dtype": dtype}  # kgen.compile of a 16-bit model
        if len(inputs) == 1 and inputs[0].name == "x":
            data["input"] = {"shape": shapes["x"], **typed, "example": {batch: self.batch}}
        else:
            data["inputs"] = {n: {"shape": s, **typed} for n, s in shapes.items()}
            data["example"] = {batch: self.batch}
        if self.src.instance is None:  # an instance's Model() takes no arguments: its weights come with it
            data["constructor"] = self._constructor()
        if self.params:
            data["params"] = {n: {k: self.params[n][k] for k in ("shape", "init", "unused") if k in self.params[n]}
                              for n in self.params}
        data["ops"] = [_compact(op) for op in self.ops]
        if self.outputs:
            data["outputs"] = list(self.outputs)
        return data

    def _unused_members(self) -> None:
        """What forward does not use: a free parameter (of the model or of a module of the
        model's own classes) is created for the state_dict only (``unused``); a torch.nn layer
        with parameters or buffers, or a buffer of the model's own, cannot be made."""
        for path, m in self.model.named_modules():
            if path in self.modules_used:
                continue
            prefix = f"{path}." if path else ""
            layer = type(m).__module__.startswith("torch.nn.") and path
            own = [n for n, _ in m.named_parameters(recurse=False) if prefix + n not in self.params]
            if layer and (own or any(True for _ in m.buffers(recurse=False))) and \
                    not any(prefix + n in self.params for n, _ in m.named_parameters(recurse=False)):
                raise ImportFailed(f"{self.src.shown}: the submodule self.{path} ({type(m).__name__}) has parameters but "
                                   "forward does not use it; kgen cannot create it")
            if any(True for _ in m.buffers(recurse=False)):
                where = f"the submodule self.{path} ({type(m).__name__})" if path else "the model"
                raise ImportFailed(f"{self.src.shown}: {where} registers buffers that no op of forward owns; kgen does "
                                   "not import them")
            for n in own:
                name = prefix + n
                reason = _path_reason(name)
                if reason:
                    raise ImportFailed(f"{self.src.shown}: the parameter name '{name}' cannot be used ({reason})")
                self.params[name] = {"shape": list(m.get_parameter(n).shape), "unused": True}

    def _constructor(self) -> dict:
        sig = inspect.signature(self.src.cls.__init__)
        params = list(sig.parameters.values())[1:]
        try:
            bound = sig.bind(None, *self.src.init_args)
        except TypeError as e:
            raise ImportFailed(f"{self.src.shown}: get_init_inputs() does not fit Model.__init__: {e}") from None
        bound.apply_defaults()
        args = {}
        for p in params:
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY):
                raise ImportFailed(f"{self.src.shown}: Model.__init__ takes *args, **kwargs or keyword-only arguments "
                                   f"({p.name}); kgen reproduces plain arguments only")
            value = _plain_value(bound.arguments[p.name])
            if value is _NOT_PLAIN:
                raise ImportFailed(f"{self.src.shown}: the constructor argument {p.name}={one_line(repr(bound.arguments[p.name]), 60)} "
                                   "is not a number, a boolean, None or a tuple of them")
            if p.default is inspect.Parameter.empty:
                args[p.name] = value
            else:
                default = _plain_value(p.default)
                if default is _NOT_PLAIN:
                    raise ImportFailed(f"{self.src.shown}: the default of {p.name} is not a number, a boolean, None "
                                       "or a tuple of them")
                args[p.name] = {"default": default} if value == default else {"value": value, "default": default}
            if keyword.iskeyword(p.name) or p.name in ("self", "torch", "super"):
                raise ImportFailed(f"{self.src.shown}: the constructor argument name {p.name!r} cannot be used")
        members = []  # the used leaf modules and the free parameters, in the order they were created
        created = {}  # member -> index of its first registration
        for path, name, i in self.creation:
            full = f"{path}.{name}" if path else name
            member = path if path in self.modules_used else full if full in self.params else None
            if member is not None and member not in members:
                members.append(member)
                created[member] = i
        out = {"args": args, "members": members}
        init = self._init(created)
        if init:
            out["init"] = init
        source = os.path.relpath(self.src.file) if not self.src.file.startswith("<") else None
        if source and re.fullmatch(r"[A-Za-z0-9_./+-]{1,200}", source):
            out = {"source": source, **out}
        return out

    def _init(self, created: dict) -> list:
        """``constructor.init``: the recorded re-initializations by state_dict name. kgen's models
        replay them after creating every member, so one made before a member is created (which
        would draw random numbers in another order) is refused."""
        paths = {id(m): p for p, m in self.model.named_modules()}
        out = []
        for m, name, fn, args, where, at, call in self.init_calls:
            path = paths.get(id(m))
            full = f"{path}.{name}" if path else name
            if path is None or not (path in self.modules_used or full in self.params):
                raise ImportFailed(f"{where}: {call} re-initializes '{full if path is not None else name}' of a "
                                   f"{type(m).__name__} that forward does not use; kgen does not create it")
            later = next((k for k, i in created.items() if i >= at), None)
            if later is not None:
                raise ImportFailed(f"{where}: {call} re-initializes '{full}' before '{later}' is created; kgen "
                                   "replays re-initializations after creating every member (move it after them)")
            out.append({"member": full, "fn": fn, **({"args": args} if args else {})})
        return out

    # ---------------------------------------------------------------- errors

    def _source_frame(self, n: fx.Node) -> tuple[str, int, str] | None:
        st = n.meta.get("stack_trace") or ""
        found = None
        lines = st.splitlines()
        targets = {str(Path(f).resolve()) for f in (self.src.file, *self.src.files)}
        for i, line in enumerate(lines):
            m = re.match(r'\s*File "(.+)", line (\d+)', line)
            if m and str(Path(m.group(1)).resolve()) in targets:
                code = lines[i + 1].strip() if i + 1 < len(lines) else ""
                found = (m.group(1), int(m.group(2)), code)
        return found

    def _source_line(self, n: fx.Node) -> str | None:
        f = self._source_frame(n)
        return f[2] if f else None

    def _where(self, n: fx.Node) -> str:
        f = self._source_frame(n)
        return f"{_shown_path(f[0])}:{f[1]}" if f else self.src.shown

    def _where_exc(self, e: BaseException) -> str:
        return _where_in(e, Path(self.src.file)) if Path(self.src.file).exists() else self.src.shown

    def _call(self, n: fx.Node) -> str:
        if n.op == "call_module":
            return f"self.{n.target} ({type(self.gm.get_submodule(n.target)).__name__})"
        if n.op == "call_method":
            return f"Tensor.{n.target}"
        fn = n.target
        mod = getattr(fn, "__module__", None) or ""
        name = getattr(fn, "__name__", str(fn))
        if mod in ("torch.nn.functional",):
            return f"F.{name}"
        if mod.startswith("torch") or fn in vars(torch).values():
            return f"torch.{name}"
        if mod == "_operator":
            return {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "matmul": "@", "neg": "unary -",
                    "pow": "**", "floordiv": "//", "mod": "%"}.get(name, f"operator.{name}")
        return name

    def _unsupported(self, n: fx.Node) -> None:
        code = self._source_line(n)
        shown = f" (in `{one_line(code, 80)}`)" if code else ""
        buffers = [a for a in n.all_input_nodes if a.op == "get_attr" and isinstance(_attr(self.gm, a.target), torch.Tensor)
                   and not isinstance(_attr(self.gm, a.target), nn.Parameter)]
        if buffers:  # (MinGPT's causal mask, sliced to the sequence)
            raise ImportFailed(f"{self._where(n)}: {self._call(n)} reads the buffer self.{buffers[0].target}{shown}: "
                               "kgen imports a buffer only as a batch norm's running statistics; "
                               "torch.compile(model, backend=\"kgen\") computes such a model (PyTorch computes what kgen "
                               "does not)")
        raise ImportFailed(f"{self._where(n)}: {self._call(n)} is not supported{shown}; `kgen ops` lists what is")


# ------------------------------------------------------------------ op tables


# Positional parameters of the calls whose signature Python cannot read (ATen builtins, Tensor
# methods: ``input`` is the tensor), by name without an in-place ``_``; any other such call takes
# (input, other). Max pools dispatch on return_indices through (*args, **kwargs).
_POSITIONAL = {
    "softmax": ("input", "dim", "dtype"), "log_softmax": ("input", "dim", "dtype"),
    "sum": ("input", "dim", "keepdim", "dtype"), "mean": ("input", "dim", "keepdim", "dtype"),
    "cumsum": ("input", "dim", "dtype"),
    "amax": ("input", "dim", "keepdim"), "amin": ("input", "dim", "keepdim"), "logsumexp": ("input", "dim", "keepdim"),
    "max": ("input", "dim", "keepdim"), "min": ("input", "dim", "keepdim"),
    "clamp": ("input", "min", "max"), "clip": ("input", "min", "max"), "clamp_min": ("input", "min"),
    "clamp_max": ("input", "max"), "pow": ("input", "exponent"), "square": ("input",), "rsqrt": ("input",),
    "norm": ("input", "p", "dim", "keepdim", "dtype"), "linalg_vector_norm": ("input", "ord", "dim", "keepdim", "dtype"),
    "gelu": ("input", "approximate"), "softplus": ("input", "beta", "threshold"),
    "hardtanh": ("input", "min_val", "max_val"), "leaky_relu": ("input", "negative_slope"), "elu": ("input", "alpha"),
    **{f"max_pool{r}d": ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
       for r in (1, 2, 3)},
    "avg_pool1d": ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"),
    **{f"adaptive_avg_pool{r}d": ("input", "output_size") for r in (1, 2, 3)},
    **{f"adaptive_max_pool{r}d": ("input", "output_size", "return_indices") for r in (1, 2, 3)},
    **{f"avg_pool{r}d": ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                         "divisor_override") for r in (2, 3)},
}
for _name in ("relu", "sigmoid", "tanh", "exp", "log", "abs", "neg"):
    _POSITIONAL[_name] = ("input",)
_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv)


def _in_place_name(name) -> bool:
    """``relu_``, ``add_``: PyTorch's in-place variants (not ``__add__``)."""
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__") and len(name) > 1


def _base_name(name: str) -> str:
    return name[:-1] if _in_place_name(name) else name


def _arguments(n: fx.Node) -> dict:
    """The arguments of call ``n`` by parameter name (defaults not filled in): bound to the
    function's signature, or by ``_POSITIONAL`` where Python cannot read it; TypeError if they
    do not fit."""
    fn = n.target
    sig = None
    if n.op == "call_function" and callable(fn):
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
            sig = None
    if sig is not None:
        return dict(sig.bind(*n.args, **n.kwargs).arguments)
    name = _base_name(fn if isinstance(fn, str) else getattr(fn, "__name__", ""))
    names = _POSITIONAL.get(name, ("input", "other"))
    if len(n.args) > len(names):
        raise TypeError(f"{name} takes at most {len(names)} positional arguments ({', '.join(names)}), got {len(n.args)}")
    out = dict(zip(names, n.args))
    for k, v in n.kwargs.items():
        if k in out:
            raise TypeError(f"{name} got multiple values for argument '{k}'")
        out[k] = v
    return out


def _no_fields(a):
    return {}


def _gelu(a):
    return ("gelu_tanh" if a.get("approximate", "none") == "tanh" else "gelu"), {}


def _const(name, fields_of):
    def make(a):
        return name, fields_of(a)
    return make


def _num(a, key, default):
    return float(a.get(key, default))


_SOFTPLUS = _const("softplus", lambda a: _drop_defaults(
    {"beta": _num(a, "beta", 1.0), "threshold": _num(a, "threshold", 20.0)}, {"beta": 1.0, "threshold": 20.0}))
_HARDTANH = _const("hardtanh", lambda a: _drop_defaults(
    {"min_val": _num(a, "min_val", -1.0), "max_val": _num(a, "max_val", 1.0)}, {"min_val": -1.0, "max_val": 1.0}))
_RELU6 = _const("hardtanh", lambda a: {"min_val": 0.0, "max_val": 6.0})  # F.relu6 is hardtanh(x, 0, 6)
_LEAKY_RELU = _const("leaky_relu", lambda a: _drop_defaults(
    {"negative_slope": _num(a, "negative_slope", 0.01)}, {"negative_slope": 0.01}))
_ELU = _const("elu", lambda a: _drop_defaults({"alpha": _num(a, "alpha", 1.0)}, {"alpha": 1.0}))
_UNARY = {
    torch.relu: _const("relu", _no_fields), F.relu: _const("relu", _no_fields), torch.relu_: _const("relu", _no_fields),
    torch.sigmoid: _const("sigmoid", _no_fields), F.sigmoid: _const("sigmoid", _no_fields),
    torch.tanh: _const("tanh", _no_fields), F.tanh: _const("tanh", _no_fields),
    F.gelu: _gelu, F.silu: _const("silu", _no_fields), F.mish: _const("mish", _no_fields),
    F.hardswish: _const("hardswish", _no_fields), F.hardsigmoid: _const("hardsigmoid", _no_fields),
    torch.exp: _const("exp", _no_fields), torch.log: _const("log", _no_fields), torch.abs: _const("abs", _no_fields),
    torch.sqrt: _const("sqrt", _no_fields), torch.rsqrt: _const("rsqrt", _no_fields),
    torch.neg: _const("neg", _no_fields), operator.neg: _const("neg", _no_fields),
    F.softplus: _SOFTPLUS, F.hardtanh: _HARDTANH, F.hardtanh_: _HARDTANH, F.relu6: _RELU6,
    F.leaky_relu: _LEAKY_RELU, F.leaky_relu_: _LEAKY_RELU, F.elu: _ELU, F.elu_: _ELU,
}
_UNARY_METHODS = {"relu": _UNARY[torch.relu], "sigmoid": _UNARY[torch.sigmoid], "tanh": _UNARY[torch.tanh],
                  "exp": _UNARY[torch.exp], "log": _UNARY[torch.log], "abs": _UNARY[torch.abs], "neg": _UNARY[torch.neg],
                  "sqrt": _UNARY[torch.sqrt], "rsqrt": _UNARY[torch.rsqrt]}
_UNARY_METHODS.update({f"{k}_": v for k, v in list(_UNARY_METHODS.items())})  # x.relu_(): in place
_UNARY_MODULES = {
    nn.ReLU: lambda m: ("relu", {}), nn.Sigmoid: lambda m: ("sigmoid", {}), nn.Tanh: lambda m: ("tanh", {}),
    nn.GELU: lambda m: ("gelu_tanh" if m.approximate == "tanh" else "gelu", {}), nn.SiLU: lambda m: ("silu", {}),
    nn.Mish: lambda m: ("mish", {}), nn.Hardswish: lambda m: ("hardswish", {}), nn.Hardsigmoid: lambda m: ("hardsigmoid", {}),
    nn.Softplus: lambda m: ("softplus", _drop_defaults({"beta": float(m.beta), "threshold": float(m.threshold)},
                                                       {"beta": 1.0, "threshold": 20.0})),
    nn.Hardtanh: lambda m: ("hardtanh", _drop_defaults({"min_val": float(m.min_val), "max_val": float(m.max_val)},
                                                       {"min_val": -1.0, "max_val": 1.0})),
    nn.LeakyReLU: lambda m: ("leaky_relu", _drop_defaults({"negative_slope": float(m.negative_slope)}, {"negative_slope": 0.01})),
    nn.ELU: lambda m: ("elu", _drop_defaults({"alpha": float(m.alpha)}, {"alpha": 1.0})),
    nn.ReLU6: lambda m: ("hardtanh", {"min_val": 0.0, "max_val": 6.0}),
}
_POWERS = (torch.pow, operator.pow, torch.square)
_NORMS = (torch.norm, torch.linalg.vector_norm)
_REDUCTIONS = {torch.sum: "sum", torch.mean: "mean", torch.amax: "max", torch.amin: "min", torch.logsumexp: "logsumexp"}
_REDUCTION_METHODS = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min", "logsumexp": "logsumexp"}
_SPLITS = (torch.split, torch.chunk, "split", "chunk")
_ADAPTIVE = {F.adaptive_avg_pool1d: "avg", F.adaptive_avg_pool2d: "avg", F.adaptive_avg_pool3d: "avg",
             F.adaptive_max_pool1d: "max", F.adaptive_max_pool2d: "max", F.adaptive_max_pool3d: "max"}
_ALIAS_METHODS = ("clone", "detach", "contiguous")
_ALIAS_FUNCTIONS = (torch.clone, torch.detach)
_VIEW_METHODS = ("view", "reshape", "flatten", "squeeze", "unsqueeze")
_POOLS = (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)
_BINARY = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
           torch.add: "add", torch.sub: "sub", torch.subtract: "sub", torch.mul: "mul", torch.multiply: "mul",
           torch.div: "div", torch.divide: "div", torch.true_divide: "div", torch.minimum: "minimum",
           torch.maximum: "maximum", torch.min: "minimum", torch.max: "maximum",
           operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div"}
_BINARY_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "multiply": "mul", "subtract": "sub",
                   "divide": "div", "minimum": "minimum", "maximum": "maximum", "__add__": "add", "__sub__": "sub",
                   "__mul__": "mul", "__truediv__": "div"}
_BINARY_METHODS.update({f"{k}_": v for k, v in list(_BINARY_METHODS.items()) if not k.startswith("_")})  # x.add_(y)


def _elementwise_binary(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _BINARY_METHODS and (len(n.args) == 2 or "other" in n.kwargs)
    if n.target in (torch.min, torch.max):  # with a second tensor (with a dim it is a reduction, see _nontensor)
        return len(n.args) == 2 and isinstance(n.args[1], fx.Node)
    return n.target in _BINARY and len(n.args) + len([k for k in n.kwargs if k == "other"]) == 2


_LAYOUT_FUNCTIONS = (torch.cat, torch.concat, torch.concatenate, torch.stack, torch.permute, torch.transpose,
                     torch.swapaxes, torch.swapdims, torch.t, torch.narrow, F.pad, F.interpolate, F.upsample,
                     operator.getitem)
_LAYOUT_METHODS = ("permute", "transpose", "swapaxes", "swapdims", "t", "narrow", "expand", "expand_as", "unfold")


def viewed_from(o) -> tuple:
    """(node, transposed): the node ``o`` views through view/reshape/squeeze/unsqueeze/contiguous/clone/detach
    and 2-d transposes (.T, .t(), transpose of the last two dims), and whether they transpose it: what a
    parameter operand may be (``self.w.T``); ``(None, False)`` where another call is in the way."""
    transpose = False
    while isinstance(o, fx.Node) and o.op in ("call_method", "call_function"):
        name = o.target if isinstance(o.target, str) else getattr(o.target, "__name__", "")
        if name in ("view", "reshape", "squeeze", "unsqueeze", "contiguous", "clone", "detach"):
            o = o.args[0]
        elif (name == "getattr" and len(o.args) == 2 and o.args[1] == "T") or name in ("t",) or \
                (name == "transpose" and tuple(o.args[1:]) in ((0, 1), (1, 0), (-1, -2), (-2, -1))):
            transpose = not transpose
            o = o.args[0]
        else:
            return None, False
    return o, transpose


def tensor_literal(n) -> float | None:
    """c where ``n`` is ``torch.tensor(c)`` of a number (a 0-d constant a binary op takes as a scalar), else None."""
    if isinstance(n, fx.Node) and n.op == "call_function" and n.target is torch.tensor and n.args and \
            isinstance(n.args[0], (int, float)):
        return float(n.args[0])
    return None


def _nonzero_of(m):
    """t where ``m`` is ``t != 0``, ``t.ne(0)`` or ``t.bool()`` of a node t (a masked_fill's mask as kgen reads it:
    t nonzero where filled), else None."""
    if not isinstance(m, fx.Node) or m.op not in ("call_function", "call_method"):
        return None
    if m.target in (operator.ne, torch.ne, "ne") and len(m.args) == 2 and isinstance(m.args[0], fx.Node) and m.args[1] == 0:
        return m.args[0]
    if m.target == "bool" and len(m.args) == 1 and isinstance(m.args[0], fx.Node):
        return m.args[0]
    return None


def fill_mask(n: fx.Node):
    """The mask node of a masked_fill call ``n`` (``x.masked_fill(mask, v)``, ``torch.masked_fill``; as written, before
    ``_nonzero_of``), else None."""
    if n.op == "call_method" and n.target == "masked_fill" or n.op == "call_function" and n.target is torch.masked_fill:
        return n.args[1] if len(n.args) > 1 else n.kwargs.get("mask")
    return None


def maps_call(n: fx.Node) -> bool:
    """Whether ``Importer._function`` maps call ``n`` to spec ops (its arguments may still be refused
    there): the Dynamo backend (kgen.backend) asks it which nodes of a graph kgen computes."""
    fn = n.target
    if n.op == "call_method":
        return fn in _UNARY_METHODS or fn in _REDUCTION_METHODS or fn in _ALIAS_METHODS or fn in _VIEW_METHODS or \
            fn in _LAYOUT_METHODS or _elementwise_binary(n) or \
            _base_name(fn) in ("clamp", "clip", "clamp_min", "clamp_max", "softmax", "log_softmax", "matmul", "mm", "bmm",
                               "pow", "square", "norm", "cumsum")
    if n.op != "call_function":
        return False
    if fn is getattr:
        return len(n.args) == 2 and n.args[1] in ("T", "mT")
    return fn is masked_fill_nonzero or fn in _UNARY or fn in _REDUCTIONS or fn in _POOLS or fn in _ADAPTIVE or fn in _ALIAS_FUNCTIONS or \
        fn in _LAYOUT_FUNCTIONS or _elementwise_binary(n) or fn in (F.dropout, F.normalize, torch.einsum) or \
        fn in _POWERS or \
        fn in _NORMS or \
        _is_matmul(n) or \
        fn in (torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.clamp, torch.clip, torch.clamp_,
               torch.clip_, torch.softmax, F.softmax, torch.log_softmax, F.log_softmax, torch.cumsum)


def _is_matmul(n: fx.Node) -> bool:
    """A product: torch.matmul, mm, bmm, ``@`` or their methods."""
    return (n.op == "call_function" and n.target in (torch.matmul, torch.mm, torch.bmm, operator.matmul)) or \
        (n.op == "call_method" and n.target in ("matmul", "mm", "bmm"))


def _binary_kind(n: fx.Node) -> str:
    return _BINARY_METHODS[n.target] if n.op == "call_method" else _BINARY[n.target]


def _one(v):
    """A size as the spec writes it: one number when all dims agree."""
    v = list(v) if isinstance(v, (tuple, list)) else [v]
    return v[0] if len(set(v)) == 1 else v


def _drop_defaults(fields: dict, defaults: dict) -> dict:
    """``fields`` without those that have their default (sizes compare per dim: [1, 1] is 1)."""
    def same(v, d):
        if isinstance(v, bool) or isinstance(d, bool) or v is None or d is None:
            return v is d or (type(v) is type(d) and v == d)
        return _one(v) == _one(d)

    return {k: v for k, v in fields.items() if k not in defaults or not same(v, defaults[k])}


def _compact(op: dict) -> dict | str:
    (kind, fields), = op.items()
    return kind if not fields else {kind: fields}


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_NOT_PLAIN = object()


def _plain_value(v):
    """A constructor value the spec can hold (None, bool, int, float, lists/tuples of them), as a list-free copy."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v if abs(v) <= 2**63 else _NOT_PLAIN
    if isinstance(v, float):
        return v if math.isfinite(v) else _NOT_PLAIN
    if isinstance(v, (tuple, list, torch.Size)) and len(v) <= 16:
        items = [_plain_value(e) for e in v]
        return _NOT_PLAIN if any(e is _NOT_PLAIN for e in items) else list(items)
    return _NOT_PLAIN


def init_of(p: torch.Tensor) -> str | float:
    """How a free parameter was made, as far as its values tell: ones, zeros, a constant
    (torch.tensor(c), or several equal elements), or (anything else) randn; the seed check
    in ``import_model`` confirms it. One element that is not 0 or 1 is randn(1, ...)."""
    flat = p.detach().reshape(-1)
    if flat.numel() and bool((flat == flat[0]).all()):
        v = float(flat[0])
        if p.dim() == 0:
            return v
        if v in (0.0, 1.0):
            return "ones" if v == 1.0 else "zeros"
        if flat.numel() > 1:
            return v
    return "randn"


def _path_reason(path: str) -> str | None:
    """Why a submodule or parameter path of the model cannot name a member of the spec."""
    if not PATH.match(path):
        return "expected lower-case names: [a-z][a-z0-9_]*, parts of a path joined by dots"
    if len(path) > (MAX_NAME if "." not in path else MAX_PATH):
        return "too long"
    return path_reason(path)


def _shown_path(p: str) -> str:
    try:
        rel = os.path.relpath(p)
        return rel if not rel.startswith("..") else p
    except ValueError:
        return p


def default_name(stem: str) -> str:
    name = re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_") or "model"
    if not name[0].isalpha():
        name = "model_" + name
    name = name[:MAX_NAME].rstrip("_")
    if module_name_reason(name):
        name = f"{name}_model"
    return name


# ------------------------------------------------------------------ checks and writing


class _Dumper(yaml.SafeDumper):
    pass


def _represent_list(dumper, data):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


def _represent_dict(dumper, data):
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(dict, _represent_dict)


def _flow(v) -> str:
    """One YAML value on one line."""
    text = yaml.dump(v, Dumper=_Dumper, default_flow_style=True, width=10**6, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def spec_text(data: dict) -> str:
    """The spec as YAML: top-level keys in block style, each op on one line."""
    out = []
    for key, value in data.items():
        if key == "ops":
            out.append("ops:")
            out += [f"  - {op}" if isinstance(op, str) else f"  - {next(iter(op))}: {_flow(next(iter(op.values())))}"
                    for op in value]
        elif isinstance(value, dict) and key != "example":
            out.append(f"{key}:")
            for k, v in value.items():
                if key == "constructor" and k == "init":  # one re-initialization a line
                    out += [f"  {k}:"] + [f"    - {_flow(e)}" for e in v]
                else:
                    out.append(f"  {k}: {_flow(v)}")
        else:
            out.append(f"{key}: {_flow(value.strip() if isinstance(value, str) else value)}")
    return "\n".join(out) + "\n"


def _same_in_modes(original: nn.Module, reference: nn.Module, example_inputs, pipe, modes, device, dtype,
                   shown: str) -> None:
    """``reference`` (the model built from the spec) computes what ``original`` computes, on random normal
    inputs shaped as ``example_inputs`` (batch 2 where a batch norm is, else 1), in each of ``modes``
    (training mode skipped where a dropout with p > 0 makes it random), every output compared (``outputs:``),
    and the state (running statistics) updated alike; at 1e-9 in float64, 1e-4 in float32 (huge models)."""
    has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in original.modules())
    g = torch.Generator(device=device).manual_seed(2)
    inputs = [torch.randn((2 if has_norm else 1,) + tuple(t.shape[1:]), generator=g, device=device, dtype=dtype)
              for t in example_inputs]
    train_ok = not any(o.op_name == "dropout" and o.p > 0 for o in pipe.ops)  # nn.Dropout or F.dropout: random
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    # each mode starts from the models' state: copies where a forward updates buffers (running statistics), the
    # models themselves where none has any (a copy apiece is the model's size again: 2.7 GB each for an MLP of
    # 671M parameters, whose check then ran out of a 23 GB machine's memory)
    stateful = any(True for m in (original, reference) for _ in m.buffers())
    for training in modes:
        if training and not train_ok:
            continue
        a = b = None  # (the last mode's copies go before the next ones are made)
        a, b = (copy.deepcopy(original), copy.deepcopy(reference)) if stateful else (original, reference)
        a.train(training)
        b.train(training)
        with torch.no_grad():
            try:
                want = a(*inputs)
            except Exception:  # noqa: BLE001 - the model itself refuses these inputs (batch norm of one value)
                continue
            got = b(*inputs)
        mode = "training" if training else "eval"
        got, want = (tuple(v) if isinstance(v, (tuple, list)) else (v,) for v in (got, want))  # `outputs:`
        if len(got) != len(want) or not all(isinstance(w, torch.Tensor) for w in want) or \
                any(g.shape != w.shape or not torch.allclose(g, w, rtol=tol, atol=tol, equal_nan=True)
                    for g, w in zip(got, want)):
            raise ImportFailed(f"{shown}: the imported spec computes differently from the model ({mode} mode); "
                               "please report it")
        ours = b.state_dict()
        for k, v in a.state_dict().items():
            if not torch.allclose(v.to(ours[k].dtype), ours[k], rtol=tol, atol=tol):
                raise ImportFailed(f"{shown}: '{k}' is updated differently in {mode} mode; please report it")


def _check_spec(text: str, path: str, imp: Importer):
    """The spec loads, plans, initializes like the model, and computes what it computes."""
    from .ir import build_pipeline
    from .plan import make_plan
    from .reference import ReferenceModel
    from .spec import parse_spec
    from .target import DEFAULT

    try:
        pipe = build_pipeline(parse_spec(text, path))
        make_plan(pipe, target=DEFAULT)
    except KgenError as e:
        raise ImportFailed(f"{imp.src.shown}: the imported spec is refused: {e}") from None
    if imp.real is None:
        return pipe  # too large to build twice here; `kgen all` checks the module against the spec
    big = imp.numel > MAX_CHECKED_PARAMS
    imp.real = None  # free its memory before two more copies
    torch.manual_seed(1)
    original = imp.src.cls(*imp.src.init_args)
    torch.manual_seed(1)
    reference = ReferenceModel(pipe)
    ours, theirs = reference.state_dict(), original.state_dict()
    if set(ours) != set(theirs):
        raise ImportFailed(f"{imp.src.shown}: the spec's model has state_dict keys {sorted(set(ours) ^ set(theirs))} "
                           "where the original differs")
    for k in theirs:
        if ours[k].shape != theirs[k].shape or not torch.equal(ours[k], theirs[k]):
            raise ImportFailed(f"{imp.src.shown}: after torch.manual_seed, '{k}' is initialized differently from the "
                               "original; kgen creates free parameters with torch.randn, ones, zeros or a constant, "
                               "in the order __init__ creates them, then replays the torch.nn.init calls after them")
    dtype = torch.float32 if big else torch.float64
    _same_in_modes(original.to(dtype), reference.to(dtype), imp.src.inputs, pipe, (True, False), torch.device("cpu"),
                   dtype, imp.src.shown)
    return pipe


def import_model(source: str, name: str | None = None, input_shapes=None, out_dir: Path | str = "specs",
                 check: bool = True) -> Path:
    """Import ``source`` into ``out_dir/NAME.yaml``; returns the path. Nothing is written on failure."""
    src = load_source(source, input_shapes)
    name = name or default_name(src.stem)
    reason = None if IDENT.match(name) and len(name) <= MAX_NAME else "expected [a-z][a-z0-9_]*, at most 64 characters"
    reason = reason or module_name_reason(name)
    if reason:
        raise ImportFailed(f"--name {one_line(name, 80)}: {reason}")
    imp = Importer(src, name)
    data = imp.run()
    text = (f"# Imported by `kgen import {src.shown}`; to change it, change the model and import it again.\n"
            + spec_text(data))
    out_dir = Path(out_dir)
    path = out_dir / f"{name}.yaml"
    if check:
        _check_spec(text, str(path), imp)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise KgenError(f"{name}: cannot write {e.filename or path}: {e.strerror or e}") from None
    return path


# ------------------------------------------------------------------ a live instance (kgen.compile)


def instance_source(model: nn.Module, example_inputs) -> Source:
    """The Source of a live model: its class, the example inputs' shapes and dtype (batch first),
    and the files of its own module classes (for file:line in errors)."""
    if not isinstance(model, nn.Module):
        raise ImportFailed(f"kgen.compile takes an nn.Module, got {type(model).__name__}")
    cls = type(model)

    def file_of(c):
        """The file of the class's forward (its code's own file: a class whose module is not in
        sys.modules has no file to inspect)."""
        try:
            return inspect.getsourcefile(getattr(c, "forward", c))
        except (TypeError, OSError):  # defined in the interpreter
            return None

    file = file_of(cls) or f"<{cls.__name__}>"
    torch_dir = str(Path(torch.__file__).resolve().parent)
    files = tuple(sorted({f for m in model.modules() for f in [file_of(type(m))]
                          if f and not str(Path(f).resolve()).startswith(torch_dir)}))  # the user's own
    shown = f"{cls.__name__} ({_shown_path(file)})" if not file.startswith("<") else cls.__name__
    if not example_inputs:
        raise ImportFailed(f"{shown}: kgen.compile needs example inputs (model, *example_inputs)")
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise ImportFailed(f"{shown}: example input {i} is a {type(t).__name__}, not a tensor")
    modes = {m.training for m in model.modules()}
    if len(modes) > 1:
        raise ImportFailed(f"{shown}: some submodules are in training mode and others in eval mode; kgen runs the "
                           "whole model in one mode (call .train() or .eval() on the model first)")
    inputs = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in example_inputs]
    return Source(cls, [], inputs, file, shown, cls.__name__, instance=model, files=files)


def import_instance(src: Source, name: str) -> tuple[Importer, dict]:
    """The spec data of a live model (``instance_source``): no constructor (the generated Model() takes no
    arguments), free parameters drawn with randn (the instance's weights replace them)."""
    imp = Importer(src, name)
    data = imp.run()
    data["description"] = f"Compiled by kgen.compile from {src.shown}.\n"
    return imp, data


def check_instance(text: str, path: str, imp: Importer):
    """The spec loads and plans, and the model built from it with the instance's state_dict (strict)
    computes what the instance computes: float64 copies (float32 for huge models) on the instance's
    device, in the instance's mode and then the other one (not training mode with a dropout), the
    running statistics updated alike. Returns the pipeline."""
    from .reference import ReferenceModel

    pipe = _check_spec(text, path, imp)  # without the model's values (imp.real is None): loads and plans
    inst = imp.src.instance
    shown = imp.src.shown
    device = next((t.device for t in [*inst.parameters(), *inst.buffers()]), torch.device("cpu"))
    dtype = torch.float32 if imp.numel > MAX_CHECKED_PARAMS else torch.float64
    reference = ReferenceModel(pipe)
    try:
        reference.load_state_dict(inst.state_dict(), strict=True)
    except RuntimeError as e:
        raise ImportFailed(f"{shown}: the spec's model does not take the model's state_dict: {one_line(e, 300)}") from None
    _same_in_modes(copy.deepcopy(inst).to(device, dtype), reference.to(device, dtype), imp.src.inputs, pipe,
                   (inst.training, not inst.training), device, dtype, shown)
    return pipe
