"""``torch.compile(model, backend="kgen")``: the Dynamo backend.

Dynamo hands over an FX graph of functional calls (``torch.conv2d(x, w, b, ...)``,
``F.batch_norm(x, running_mean, running_var, w, b, training, momentum, eps)``, ``torch.relu``,
``operator.add``, ...) whose parameters and buffers are graph inputs. Each node kgen can compute
is marked (after attention written out is rewritten as PyTorch's fused call, ``kgen.attention``;
``_Support``: the importer's maps, ``kgen.importer.maps_call``, plus the layers with
weights below), the marked nodes are grouped into partitions (torch.fx's CapabilityBasedPartitioner),
each without the views that only pass a value through it (``_without_passing_views``), cut into its
connected pieces (``_connected_pieces``: the partitioner also joins independent calls) and, where it
returns more values than an op may, in graph order (``_within_output_limit``), and each partition becomes a small ``nn.Module`` in the form the
importer reads (``_partition_model``: a layer call becomes the matching ``torch.nn`` layer holding
the graph's own weight tensors). ``kgen.compiler.compile_module`` imports, checks, renders and
builds it in kgen's cache (a partition seen before, in this process or another, is found there),
and the partition runs as the generated op's functional form, given the partition's inputs,
parameters and running statistics at each call (batch norm's statistics are updated in place, as
``F.batch_norm`` does). Every other node runs as PyTorch runs it; a partition kgen cannot import,
plan or build stays eager, with one line on stderr saying why, and so does one whose fastest plan is its
own ops through ATen unless the op's CUDA-graph replay of them pays (``_refuse_eager_plans``). Graph
breaks are Dynamo's. A value whose
batch (Dynamo's symbol) is not dim 0, a sequence-first [S, B, E], is taken where the calls on it do not
mind the batch moved first (``_Support._moved_ok``): the partition's model is written batch-first (its
permutes renamed, ``_moved_permutation``, and its indexing, ``_index_batch_first``: SwinV2's ``qkv[0]`` of a
``[3, 64 * B, heads, N, d]``) and its runner moves the inputs and results (``_Plan.moved_in``). A tensor without
the batch that a call reads beside its input (a parameter, a float buffer nothing in the graph updates, or a value
computed from them alone: SwinV2's logit scale, a ``torch.cat`` of biases, a standardized weight;
``_Graph.batch_free``) is given to the op at each call as its parameters are; a parameter whose dim 0 is the batch
(Mamba2's, made with the batch size, in a graph Dynamo specialized to it) is one more input of the op
(``_Graph._batch_carrying_state``).

On a GPU the graph runs the fastest of its forms, measured in its first calls per input signature
(``_measured``, kgen.runtime.MeasuredGraph): kgen's (the generated ops and the calls left to PyTorch) or the
graph as Dynamo gave it, each called directly or replayed as one CUDA graph where the graph allows one
(``_not_replayable``); values made from constants alone are computed once (``_fold_constants``).

The batch (dim 0 of the graph's inputs) is the one run-time size: a generated module takes any
batch. A partition's batch is the size its values lead with: the graph's, or a multiple of it in dim 0
where a view folded the batch with another dim (Swin's windows ``[64 * B, 7, 7, C]``; the folding view
itself stays PyTorch's, ``_Graph.lead``). When Dynamo first hands over a graph with a static batch (its default: every size static
until one changes), the backend marks dim 0 of the graph's batch inputs dynamic in Dynamo's
automatic-dynamic state for that frame and has Dynamo trace the frame again (``_ask_dynamic_batch``):
the graph it compiles, and the guards Dynamo installs, take any batch but 1 (which Dynamo
specializes: a graph of its own), so a new batch size does not recompile. Every other size is
compiled in: a new channel count or spatial size fails Dynamo's guards and recompiles, and where
Dynamo then makes that size dynamic, the nodes with it stay eager, with one line saying why. Sizes are compared
by their values at several batches (``_probe``): Dynamo writes ``int(64 * B / 64)`` as an expression sympy does not
reduce to the batch.

Options (``torch.compile(model, backend="kgen", options={...})``): ``verbose`` (default True:
progress of each build on stderr), ``precision`` and ``intermediates`` (the specs' keys), ``mode`` (as
``torch.compile``'s ``mode=``, which torch passes to the backend too; one of the two):
``"max-autotune"`` tunes each partition's plans with `kgen tune` (on a CUDA GPU; the tuning file
stays beside the spec in the cache). ``torch.compile(..., fullgraph=True)``: a partition that
would stay eager, or a node kgen would compute but for a dynamic size, is an error naming why.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import operator
import os
import sys
import weakref
from pathlib import Path
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

try:  # the one restart a backend may raise through Dynamo's compile step (torch >= 2.6)
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis as _Restart
except ImportError:  # then a new batch recompiles once, as Dynamo does (_ask_dynamic_batch)
    _Restart = None

from .attention import rewrite_attention
from .cache import DYNAMIC_BATCH_FILE, kgen_cache
from .compiler import SPEC_FILE
from .errors import KgenError, one_line
from .spec import MAX_OUTPUTS, MAX_RANK
from .runtime import op_result

STATS = {"graphs": 0, "partitions": 0, "kgen": 0, "eager": 0}  # counts since the process started
# per graph compiled: why it cannot be replayed as a CUDA graph (None: it can) and a weak reference to its
# forms measured (kgen.runtime.MeasuredGraph: ``.chosen()``)
GRAPHS: list = []
PARTITIONS: list = []  # per partition since the process started: its calls, and its module or why it stays eager
_LOADED: dict = {}  # module folder -> the imported generated module
_EXAMPLE_BATCHES: dict = {}  # (cache, a partition's code, its inputs' other sizes) -> the batch its spec was made for
_NAME = "partition"  # each partition's spec name; the cache key (its ops and sizes) tells them apart
# A partition's spec gives the batch of the call Dynamo compiled as its example: its plans are chosen for
# it, as `kgen import` chooses them for the file's batch (a GEMM's best plan at 8 rows is not its best at
# 1024). The generated op takes any batch; a process whose first call has another batch renders its own.
# This one where that batch cannot be read (a symbol without a hint).
EXAMPLE_BATCH = 8


def _say(msg: str) -> None:
    print(f"kgen: backend: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ layers with weights

# function -> (nn class, rank, transposed); their weight and bias must be graph inputs (parameters)
_CONVS = {}
for _r in (1, 2, 3):
    for _fn in (getattr(torch, f"conv{_r}d"), getattr(F, f"conv{_r}d")):
        _CONVS[_fn] = (getattr(nn, f"Conv{_r}d"), _r, False)
    for _fn in (getattr(torch, f"conv_transpose{_r}d"), getattr(F, f"conv_transpose{_r}d")):
        _CONVS[_fn] = (getattr(nn, f"ConvTranspose{_r}d"), _r, True)
_LINEARS = (F.linear, torch._C._nn.linear)
_BATCH_NORMS = (F.batch_norm,)
_LAYER_NORMS = (F.layer_norm,)
_GROUP_NORMS = (F.group_norm,)
_INSTANCE_NORMS = (F.instance_norm,)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_LN_ARGS = ("input", "normalized_shape", "weight", "bias", "eps")
_GN_ARGS = ("input", "num_groups", "weight", "bias", "eps")
_IN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")


def _bound(n: fx.Node, names) -> dict:
    """``n``'s arguments by the names ``names`` (positional, then keywords)."""
    if len(n.args) > len(names):
        raise TypeError(f"{len(n.args)} positional arguments")
    out = dict(zip(names, n.args))
    out.update(n.kwargs)
    return out


def _layer(n: fx.Node):
    """(kind, arguments by name, tensor slots) of a call to a layer with weights, else None."""
    if n.op != "call_function":
        return None
    if n.target in _CONVS:
        transposed = _CONVS[n.target][2]
        return "conv", _bound(n, _CONV_T_ARGS if transposed else _CONV_ARGS), ("weight", "bias")
    if n.target in _LINEARS:
        return "linear", _bound(n, ("input", "weight", "bias")), ("weight", "bias")
    if n.target in _BATCH_NORMS:
        return "batch_norm", _bound(n, _BN_ARGS), ("running_mean", "running_var", "weight", "bias")
    if n.target in _LAYER_NORMS:
        return "layer_norm", _bound(n, _LN_ARGS), ("weight", "bias")
    if n.target in _GROUP_NORMS:
        return "group_norm", _bound(n, _GN_ARGS), ("weight", "bias")
    if n.target in _INSTANCE_NORMS:
        return "instance_norm", _bound(n, _IN_ARGS), ("weight", "bias")
    return None


def _max_min_dim(n) -> int | None:
    """The dim of ``torch.max(x, dim)`` / ``x.min(dim)`` (values and indices: the importer takes the values'
    getitem), else None."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method") or \
            n.target not in (torch.max, torch.min, "max", "min") or not isinstance(_example(n), tuple):
        return None
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    return dim if isinstance(dim, int) else None


def _without_empty_pieces(n: fx.Node) -> tuple:
    """n's args, for a torch.cat its 1-d empty pieces left out as torch.cat skips them (a key-value cache's first
    `torch.tensor([])`): a partition does not take them for parameters of shape [0]."""
    if n.target is not torch.cat or not n.args or not isinstance(n.args[0], (tuple, list)):
        return n.args
    pieces = [p for p in n.args[0] if not (isinstance(_example(p), torch.Tensor) and _example(p).shape == (0,))]
    return (pieces, *n.args[1:])


def _split_dim(n) -> int | None:
    """The dim of ``torch.split`` / ``torch.chunk`` (and the methods): pieces the importer takes as slices, each
    where a getitem reads it; else None."""
    from .importer import _SPLITS

    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method") or \
            n.target not in _SPLITS or not isinstance(_example(n), (tuple, list)):
        return None
    dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
    return dim if isinstance(dim, int) else None


def _constant_tensor(n) -> bool:
    """``torch.tensor(c)`` of a number but a bool (a 0-d constant the importer reads as a scalar operand)."""
    from .importer import tensor_literal

    return tensor_literal(n) is not None and not isinstance(n.args[0], bool)


# ------------------------------------------------------------------ what kgen computes


def _size_seen(size, example) -> int:
    """The batch's size in the call being compiled: the example input's (Dynamo passes the call's tensors),
    else the symbol's hint, else EXAMPLE_BATCH."""
    if isinstance(example, torch.Tensor) and example.dim() >= 1 and isinstance(example.shape[0], int):
        return example.shape[0]
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return hint if isinstance(hint, int) else EXAMPLE_BATCH


def _example(n):
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


# Batch sizes at which a size written in the batch symbol is evaluated (Dynamo's symbol is at least 2). Dynamo
# writes Swin's `int(windows.shape[0] / (H * W / 7 / 7))` as TruncToInt(FloatTrueDiv(ToFloat(64*s), 64.0)), which is
# the batch s but which sympy does not simplify, and the `-1` of a view on it as a quotient that is a constant.
_PROBES = (2, 3, 5, 7, 16, 97, 1000, 65537)


@functools.lru_cache(maxsize=4096)
def _probe(expr) -> tuple | None:
    """A size expression of one symbol at each of ``_PROBES``, else None."""
    if len(expr.free_symbols) != 1:
        return None
    (symbol,) = expr.free_symbols
    values = []
    for v in _PROBES:
        try:
            r = expr.xreplace({symbol: v})
        except (TypeError, ValueError, ZeroDivisionError, ArithmeticError):
            return None
        if not (isinstance(r, int) or getattr(r, "is_Integer", False)):  # (a bare symbol gives back the int)
            return None
        values.append(int(r))
    return tuple(values)


def _values(size) -> tuple | None:
    """(symbol, its values at the probes) of a size in one symbol, else None."""
    if not isinstance(size, torch.SymInt):
        return None
    expr = size.node.expr
    values = _probe(expr)
    return None if values is None else (next(iter(expr.free_symbols)), values)


def _static(size):
    """A size as an int where it is one: a symbol Dynamo has specialized to a constant is that constant, and so is
    an expression of the batch that takes one value at every batch."""
    if isinstance(size, torch.SymInt):
        if getattr(size.node.expr, "is_number", False):
            return int(size.node.expr)
        seen = _values(size)
        if seen is not None and len(set(seen[1])) == 1:
            return seen[1][0]
    return size


def _same_size(a, b) -> bool:
    a, b = _static(a), _static(b)
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        if not (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)):
            return False
        return str(a.node.expr) == str(b.node.expr) or (_values(a) is not None and _values(a) == _values(b))
    return a == b


def _batch_multiple(size, batch) -> int | None:
    """``c`` where ``size`` is ``c`` times the batch symbol (c >= 1: Swin's windows ``64 * s`` fold the batch
    with the windows into dim 0, NetVLAD's ``x.view(-1, D)`` its descriptors), else None."""
    size, batch = _static(size), _static(batch)
    if not (isinstance(size, torch.SymInt) and isinstance(batch, torch.SymInt)):
        return None
    ratio = size.node.expr / batch.node.expr
    if ratio.is_Integer:
        return int(ratio) if ratio >= 1 else None
    a, b = _values(size), _values(batch)
    if a is None or b is None or a[0] != b[0] or any(v % w for v, w in zip(a[1], b[1])):
        return None
    ratios = {v // w for v, w in zip(a[1], b[1])}
    return ratios.pop() if len(ratios) == 1 and min(ratios) >= 1 else None


def _runs_on_meta(gm: fx.GraphModule, examples: dict, grown: set, batch: int) -> bool:
    """Whether ``gm``, a graph Dynamo specialized to ``batch``, runs on the meta device (no computation) with the
    placeholders ``grown`` one larger in dim 0, as the backend would run its partitions: a view's or expand's
    leading size equal to the batch follows the batch (``_batch_in_shape``); a tensor made on a device is made on
    the meta device."""
    class OnMeta(fx.Interpreter):
        def run_node(self, n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if "device" in kwargs:
                kwargs = {**kwargs, "device": "meta"}
            if n.target in ("view", "reshape", "expand") or n.target is torch.reshape:
                shape = _size_args(args)
                if shape and shape[0] == batch and (n.target == "expand" or args[0].shape[0] == batch + 1):
                    args = (args[0], (batch + 1, *shape[1:]))
            return getattr(self, n.op)(n.target, args, kwargs)

    args = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        ex = _example(n)
        if isinstance(ex, torch.Tensor):
            shape = [int(_static(s)) for s in ex.shape]
            if n in grown:
                shape[0] += 1
            args.append(torch.empty(shape, dtype=ex.dtype, device="meta"))
        else:
            args.append(examples.get(n, ex))
    try:
        OnMeta(gm).run(*args)
    except Exception:  # noqa: BLE001 - any failure is the answer
        return False
    return True


def _is_state(n: fx.Node, example) -> bool:
    """A parameter or buffer of the model (Dynamo passes them as graph inputs)."""
    if isinstance(example, nn.Parameter):
        return True
    arg = n.meta.get("grapharg")
    src = getattr(arg, "source", None)
    while src is not None:
        if "ParamBuffer" in type(src).__name__:
            return True
        src = getattr(src, "base", None)
    return False


@dataclass
class _Graph:
    """What the partitioner needs to know of Dynamo's graph: its parameters and buffers, the batch."""

    gm: fx.GraphModule
    examples: dict = field(default_factory=dict)  # placeholder -> its example input
    state: set = field(default_factory=set)  # placeholders that are parameters or buffers
    batch: object = None  # dim 0 of the first input that is not a parameter (an int or a SymInt)
    batch_seen: int = EXAMPLE_BATCH  # its size in the call being compiled
    dtype: torch.dtype | None = None
    by_name: dict = field(default_factory=dict)  # node name -> node (fusing copies the graph's nodes)
    parts: dict = field(default_factory=dict)  # fused_i -> partition i's graph (before a generated op replaces it)
    from_inputs: set = field(default_factory=set)  # names of the nodes computed from an input (not from state alone)
    # every parameter and buffer: ``state`` less those that carry the batch, which partitions take as inputs
    model_state: set = field(default_factory=set)
    _batch_dims: dict = field(default_factory=dict)  # node -> batch_dim(node)

    def __post_init__(self):
        self.by_name = {n.name: n for n in self.gm.graph.nodes}
        inputs = []  # the tensor inputs that are not parameters: (node, its example)
        for n in self.gm.graph.nodes:
            if n.op != "placeholder":
                continue
            ex = self.examples.get(n)
            if _is_state(n, ex):
                self.state.add(n)
            elif isinstance(_example(n), torch.Tensor) and _example(n).dim() >= 1:
                inputs.append((n, ex))
        self.model_state = set(self.state)
        if inputs:
            n, ex = self._batch_input(inputs)
            self.batch, self.dtype = _static(_example(n).shape[0]), _example(n).dtype
            if not self.dtype.is_floating_point:  # token ids [B, S]: the values kgen computes are the parameters' dtype
                self.dtype = next((e.dtype for s in self.state if isinstance(e := _example(s), torch.Tensor)
                                   and e.is_floating_point()), self.dtype)
            self.batch_seen = _size_seen(self.batch, ex)
            self.state -= self._batch_carrying_state([n for n, _ in inputs])
        for n in self.gm.graph.nodes:
            if (n.op == "placeholder" and n not in self.state) or any(a.name in self.from_inputs
                                                                      for a in n.all_input_nodes):
                self.from_inputs.add(n.name)

    def _batch_carrying_state(self, inputs: list) -> set:
        """The parameters and buffers whose dim 0 is the batch (Mamba2's ``nn.Parameter(torch.randn(batch_size, L,
        H))``, read beside its input as one more input): where the batch is static (Dynamo specialized it: such a
        model runs at that batch alone) and the graph, run on the meta device with its inputs one batch larger, fails
        unless those grow too. A weight whose dim 0 only equals the batch (16 channels at batch 16) grows nothing."""
        def leads(n) -> bool:
            ex = _example(n)
            return isinstance(ex, torch.Tensor) and ex.dim() >= 1 and _static(ex.shape[0]) == self.batch
        if not isinstance(self.batch, int):
            return set()
        grown = {n for n in inputs if leads(n)}
        candidates = {n for n in self.state if leads(n)}
        if not candidates or not grown or _runs_on_meta(self.gm, self.examples, grown, self.batch) \
                or not _runs_on_meta(self.gm, self.examples, grown | candidates, self.batch):
            return set()
        return candidates

    def _batch_input(self, inputs: list) -> tuple:
        """The input whose dim 0 is the batch: the first input's, unless the graph's values lead with another
        input's dim 0 more often (an RNN's sequence-first ``x`` [S, B, E] beside its state ``h0`` [B, H]: its
        steps ``x[t]`` and everything computed from them lead with B)."""
        def leading(n) -> int:  # sizes compared by value: a symbol Dynamo specialized is its value
            size = _size_seen(_example(n).shape[0], None)
            return sum(1 for v in self.gm.graph.nodes if v.op in ("call_function", "call_method")
                       and isinstance(_example(v), torch.Tensor) and _example(v).dim() >= 1
                       and _size_seen(_example(v).shape[0], None) == size)

        counts = [leading(n) for n, _ in inputs]
        return inputs[counts.index(max(counts))]

    @property
    def on_gpu(self) -> bool:
        """Whether the graph's inputs lie on a CUDA GPU (a model on the CPU of a GPU machine runs on the CPU)."""
        return any(isinstance(e, torch.Tensor) and e.device.type == "cuda" for e in self.examples.values())

    def batch_dim(self, n) -> int | None:
        """Where the batch is in a tensor of the graph's dtype whose other sizes are static: dim 0, or, where the
        batch is Dynamo's symbol, the one dim of that size (a sequence-first [S, B, E]) or a dim 0 that is a
        multiple of it (a batch folded with windows: ``lead``); None for anything else. Kept per node: the
        partitioner asks ~10 times a node (DenseNet-201: 12k calls, 0.36 s of symbolic sizes)."""
        if not isinstance(n, fx.Node):
            return None
        if n not in self._batch_dims:
            self._batch_dims[n] = self._find_batch_dim(n)
        return self._batch_dims[n]

    def _find_batch_dim(self, n: fx.Node) -> int | None:
        ex = _example(n)
        if not (n not in self.state and isinstance(ex, torch.Tensor) and 1 <= ex.dim() <= MAX_RANK
                and ex.dtype == self.dtype and self.batch is not None):
            return None
        if not isinstance(self.batch, torch.SymInt):  # a static batch: a size equal to it elsewhere may be anything
            return 0 if _same_size(ex.shape[0], self.batch) and \
                not any(isinstance(_static(s), torch.SymInt) for s in ex.shape[1:]) else None
        dims = [d for d, s in enumerate(ex.shape) if isinstance(_static(s), torch.SymInt)]
        if len(dims) != 1:
            return None
        # the batch itself (a multiple of 1: a sequence-first [S, B, E]) or a multiple of it, folded with windows
        # in dim 0 or moved (Swin's qkv [3, 64 * B, heads, N, d])
        return dims[0] if _batch_multiple(ex.shape[dims[0]], self.batch) is not None else None

    def batch_free(self, n) -> bool:
        """A tensor of the graph's dtype without the batch, every size static: a parameter or buffer, or a value
        computed from them (Swin's logit scale and position bias); a partition reads it as a parameter given
        at each call."""
        ex = _example(n)
        if not (isinstance(n, fx.Node) and n.name not in self.from_inputs and isinstance(ex, torch.Tensor) and
                ex.dtype == self.dtype and 1 <= ex.dim() <= MAX_RANK and self.batch_dim(n) is None and
                not any(isinstance(_static(s), torch.SymInt) for s in ex.shape)):
            return False
        # a buffer the graph updates (a batch norm's running statistics, `self.count += 1`) is read where the graph
        # reads it: a partition placed after the update would read the new value
        return n not in self.state or isinstance(self.examples.get(n), nn.Parameter) or not any(
            _in_place(u) or _name(u) == "copy_" or (_layer(u) or ("",))[0] == "batch_norm" for u in n.users)

    def lead(self, n):
        """The batch of a value as its partition's op sees it: the size at ``batch_dim`` (the graph's batch, or
        a multiple of it in dim 0); None where there is none. A partition's values all lead with one size."""
        k = self.batch_dim(n)
        return None if k is None else _example(n).shape[k]

    def batch_first(self, n) -> bool:
        """A tensor of the graph's dtype whose dim 0 is the batch and whose other sizes are static."""
        return self.batch_dim(n) == 0

    def is_batch(self, v, lead=None) -> bool:
        """A size argument that is the batch (``lead``, by default the graph's): its symbol (dynamic) or a node
        giving it."""
        lead = self.batch if lead is None else lead
        ex = _example(v) if isinstance(v, fx.Node) else None
        return isinstance(ex, torch.SymInt) and isinstance(lead, torch.SymInt) and _same_size(ex, lead)


def _connected_pieces(parts) -> list:
    """The partitions cut into their connected pieces (nodes joined by the values they pass each other). The
    partitioner puts independent calls in one partition where no cycle results (Mamba2's ``exp`` of its segment sums
    beside the ``exp`` of its cumulative sums, computed much later): one op for both would wait for the later one's
    operands, and so would the earlier one's readers (the host issued Mamba2's first large kernel 0.8 ms into the
    call where eager issues it at 0.6, 2026-12-04, H200). Each piece is a partition too: a path between two pieces,
    or out of one and back, would leave the partition and come back into it."""
    from torch.fx.passes.infra.partitioner import Partition

    out = []
    for p in parts:
        nodes = {n: i for i, n in enumerate(p.nodes)}  # (the partition's own order: pieces come in it)
        piece_of: dict = {}
        pieces: list = []
        for n in nodes:
            if n in piece_of:
                continue
            piece, todo = [], [n]
            piece_of[n] = len(pieces)
            while todo:
                m = todo.pop()
                piece.append(m)
                for k in (*m.all_input_nodes, *m.users):
                    if k in nodes and k not in piece_of:
                        piece_of[k] = len(pieces)
                        todo.append(k)
            pieces.append(sorted(piece, key=nodes.get))
        out += [p] if len(pieces) == 1 else [Partition(nodes=piece) for piece in pieces]
    return out


def _split_at_writes(parts, gm: fx.GraphModule) -> list:
    """The partitions cut where a call outside them writes into a value they read or make, or waits for them. A
    partition runs where its last node stood, and the calls that wait for its values move after it: a read of
    the value before the write would see it, and the write, waiting for a value the partition makes, would move
    after the partition's later reads (``y = x * 2`` and ``y + r`` in kgen around an eager ``y.masked_fill_(m, 0)``:
    the sum read y unwritten) or past an eager read of its own (its mask made by the partition). Cut in graph
    order at each such write, the pieces are partitions too (as _within_output_limit's)."""
    from torch.fx.passes.infra.partitioner import Partition

    taken = set().union(*(p.nodes for p in parts)) if parts else set()
    writes = [n for n in gm.graph.nodes if n not in taken and _writes(n) and n.args and isinstance(n.args[0], fx.Node)]
    if not writes:
        return parts
    all_nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(all_nodes)}
    out = []
    for p in parts:
        nodes = sorted(p.nodes, key=order.get)
        inside = set(nodes)
        cuts = []
        for w in writes:
            if not order[nodes[0]] < order[w] < order[nodes[-1]]:
                continue
            aliases = _aliases(_view_base(w.args[0]))

            def touches(n) -> bool:  # reads or is the value written
                return n in aliases or any(a in aliases for a in n.all_input_nodes)

            # the calls before the write that wait for the partition (they move after it): the write itself, or a
            # read of the value written, among them would move past the write's other side
            waiting = set(inside)
            for m in all_nodes[order[nodes[0]]:order[w] + 1]:
                if m not in inside and any(a in waiting for a in m.all_input_nodes):
                    waiting.add(m)
            if any(touches(n) for n in nodes) or w in waiting or any(touches(m) for m in waiting - inside):
                cuts.append(order[w])
        if not cuts:
            out.append(p)
            continue
        pieces: list = [[]]
        for n in nodes:
            if cuts and order[n] > cuts[0]:
                while cuts and order[n] > cuts[0]:
                    cuts.pop(0)
                pieces.append([])
            pieces[-1].append(n)
        out += [Partition(nodes=piece) for piece in pieces if piece]
    return out


def _aliases(base: fx.Node) -> set:
    """``base`` and the nodes that are it under another name: its views and its in-place updates, transitively."""
    seen, todo = {base}, [base]
    while todo:
        for u in todo.pop().users:
            if u not in seen and u.args and u.args[0] in seen and (_views(u) or _writes(u)):
                seen.add(u)
                todo.append(u)
    return seen


def _name(n: fx.Node) -> str:
    """A call's name: a method's, or a function's or module's ``__name__``."""
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _in_place(n: fx.Node) -> bool:
    """Whether call ``n`` updates its operand: ``relu_``, ``x += y``, ``inplace=True``."""
    from .importer import _IN_PLACE_OPERATORS, _in_place_name

    return _in_place_name(_name(n)) or n.target in _IN_PLACE_OPERATORS or n.kwargs.get("inplace") is True


def _permutation(n: fx.Node) -> list | None:
    """The dims of a permute or transpose call (``x.permute(2, 0, 1)``, ``x.transpose(0, 1)``) as a permutation
    of its operand's, else None."""
    name = _name(n)
    ex = _example(n)
    if n.op not in ("call_method", "call_function") or name not in ("permute", "transpose", "swapaxes", "swapdims") \
            or not isinstance(ex, torch.Tensor) or not n.args:
        return None
    rank = ex.dim()
    rest = list(n.args[1:]) or list(n.kwargs.values())
    if name == "permute":
        dims = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        return [d % rank for d in dims] if len(dims) == rank and all(isinstance(d, int) for d in dims) else None
    if len(rest) != 2 or not all(isinstance(d, int) for d in rest):
        return None
    dims = list(range(rank))
    a, b = rest[0] % rank, rest[1] % rank
    dims[a], dims[b] = dims[b], dims[a]
    return dims


def _moved_permutation(dims: list, k_in: int, k_out: int) -> list:
    """``x.permute(dims)`` where x's batch is at dim ``k_in`` and the result's at ``k_out``, as a permutation of
    x with its batch moved first whose result has its batch first (dims[0] is 0)."""
    order_in = [k_in] + [d for d in range(len(dims)) if d != k_in]  # the moved value's dim i is x's dim order_in[i]
    order_out = [k_out] + [d for d in range(len(dims)) if d != k_out]
    return [order_in.index(dims[j]) for j in order_out]


def _moved_index(n: fx.Node, g: "_Graph") -> tuple | None:
    """The index of ``x[i]`` (integers and slices) for ``x`` with its batch moved first, where x's batch is not
    dim 0 or the result's is not (``qkv[0]`` of ``qkv`` [3, B, heads, N, d] is [B, heads, N, d]); None where the
    index takes part of the batch."""
    x = n.args[0]
    k_in, k_out = g.batch_dim(x), g.batch_dim(n)
    if k_in is None or k_out is None:
        return None
    return _index_batch_first(n.args[1], _example(x).dim(), k_in, k_out)


def _index_batch_first(idx, rank: int, k_in: int, k_out: int) -> tuple | None:
    """``idx`` (integers and slices) of a rank-``rank`` value whose batch is dim ``k_in``, as the index of that value
    with its batch moved first, where the result's batch is dim ``k_out`` of ``x[idx]``: then
    ``x.movedim(k_in, 0)[moved] == x[idx].movedim(k_out, 0)``. None where the index does not leave the batch whole."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if len(items) > rank or any(isinstance(i, bool) or not isinstance(i, (int, slice)) for i in items):
        return None
    items += [slice(None)] * (rank - len(items))
    if items[k_in] != slice(None) or k_out != k_in - sum(isinstance(i, int) for i in items[:k_in]):
        return None
    return (slice(None),) + tuple(i for d, i in enumerate(items) if d != k_in)


def _views(n: fx.Node) -> bool:
    """Whether ``n``'s result may share memory with its operand (a view: an in-place call on it would
    change the operand)."""
    name = _name(n)
    return name in ("view", "reshape", "flatten", "squeeze", "unsqueeze", "permute", "transpose", "t", "expand",
                    "expand_as", "narrow", "getitem", "detach", "contiguous", "swapaxes", "swapdims", "split",
                    "chunk", "unflatten", "view_as", "as_strided", "select", "movedim", "getattr", "alias")


class _Support:
    """Which nodes kgen computes (``OperatorSupportBase`` by duck typing)."""

    def __init__(self, graph: _Graph):
        self.g = graph

    def is_node_supported(self, submodules, n: fx.Node) -> bool:
        try:
            return self._supported(n)
        except (TypeError, ValueError, AttributeError):  # arguments that do not fit what the node is taken for
            return False

    def _supported(self, n: fx.Node) -> bool:
        from .importer import maps_call

        g = self.g
        if any(isinstance(_example(a), torch.Tensor) and _example(a).dim() > MAX_RANK for a in n.all_input_nodes):
            return False  # a value of more dims than kgen's (ViT's unfolded patches): the call stays eager
        if n.op in ("call_function", "call_method") and self._parameter_view(n):
            # ``self.w.T``: taken with the calls reading it (the importer makes it the op's transposed parameter)
            return bool(n.users) and all(self._supported(u) for u in n.users)
        if _constant_tensor(n):  # taken with the calls reading it
            return bool(n.users) and all(self._supported(u) for u in n.users)
        # taken with the getitems reading its results, along a dim after the batch: torch.max(x, dim)'s values, or
        # the pieces of a split or chunk (ShuffleNetV2's x.chunk(2, dim=1))
        for dim, picked in ((_max_min_dim(n), lambda i: i == 0), (_split_dim(n), lambda i: isinstance(i, int))):
            if dim is not None:
                return g.batch_dim(n.args[0]) == 0 and dim % _example(n.args[0]).dim() != 0 and bool(n.users) and all(
                    u.op == "call_function" and u.target is operator.getitem and picked(u.args[1]) for u in n.users)
        if n.op not in ("call_function", "call_method") or g.batch_dim(n) is None:
            return False
        if any(g.batch_dim(a) not in (None, 0) for a in [n, *n.all_input_nodes]) and not self._moved_ok(n):
            return False
        lead = g.lead(n)
        if any(g.batch_dim(a) is not None and not _same_size(g.lead(a), lead) for a in n.all_input_nodes):
            return False  # a view that folds the batch into dim 0 or unfolds it (Swin's windows): PyTorch's, free
        layer = _layer(n)
        if layer is not None:
            kind, args, slots = layer
            if g.batch_dim(args.get("input")) is None:
                return False
            for s in slots:
                t = args.get(s)
                if t is not None and not (isinstance(t, fx.Node) and t in g.state
                                          or kind != "batch_norm" and g.batch_free(t)):
                    return False  # (a batch norm's running statistics are the model's, updated in place)
            for k, v in args.items():
                if k not in slots and k != "input" and isinstance(v, fx.Node):
                    return False  # a size or a flag computed at run time
            if kind == "conv" and isinstance(args.get("padding"), str) and args["padding"] != "valid":
                return False
            if kind == "layer_norm" and (args.get("weight") is None and args.get("bias") is not None
                                         or not isinstance(args.get("eps", 1e-5), float)):
                return False
            if kind == "group_norm" and not (isinstance(args.get("num_groups"), int)
                                             and isinstance(args.get("eps", 1e-5), float)):
                return False
            if kind == "instance_norm" and not (args.get("running_mean") is None and args.get("running_var") is None
                                                and args.get("use_input_stats", True) is True
                                                and isinstance(args.get("eps", 1e-5), float)):
                return False  # running statistics (track_running_stats=True) are not taken
            if kind == "batch_norm":
                if not isinstance(args.get("training", False), bool) or not isinstance(args.get("eps", 1e-5), float):
                    return False
                if args.get("training") and args.get("running_mean") is not None and \
                        not isinstance(args.get("momentum", 0.1), (int, float)):
                    return False  # momentum=None: the factor comes from num_batches_tracked
                if (args.get("running_mean") is None) != (args.get("running_var") is None):
                    return False
            return True
        if not maps_call(n):
            return False
        if n.target is F.dropout:
            drop = _bound(n, ("input", "p", "training", "inplace"))
            if drop.get("training", True) is not False and drop.get("p", 0.5) != 0:
                return False  # random in training mode: PyTorch's (p = 0, DenseNet's nn.Dropout(0.0), is x)
        operands = [a for a in n.all_input_nodes]
        for a in operands:
            ex = _example(a)
            if a in g.state:
                if not (isinstance(g.examples.get(a), nn.Parameter) or g.batch_free(a)):
                    return False  # a buffer of another dtype (an index table)
            elif _constant_tensor(a) or _max_min_dim(a) is not None or _split_dim(a) is not None:
                continue
            elif isinstance(ex, torch.Tensor):
                if g.batch_dim(a) is None and not self._parameter_view(a) and not g.batch_free(a):
                    return False
            elif not g.is_batch(a, lead):
                return False
        if _in_place(n):
            return self._in_place_ok(n)
        return True

    def _moved_ok(self, n: fx.Node) -> bool:
        """A call on values whose batch is not dim 0 (sequence-first attention's [S, B, E]) that kgen computes with
        the batch moved first (``_Plan.moved``: the partition's inputs moved at run time, its outputs moved back),
        where that changes nothing but the dims the call names: elementwise calls on values of one layout (a
        parameter operand broadcasting over dims after the batch), linear and layer norm over dims after the batch,
        and permute/transpose (their dims renamed, ``_moved_permutation``)."""
        from .importer import _UNARY, _UNARY_METHODS, _elementwise_binary

        g = self.g
        k, rank = g.batch_dim(n), _example(n).dim()
        tensors = [a for a in n.all_input_nodes if a not in g.state and isinstance(_example(a), torch.Tensor)]
        dims = _permutation(n)
        if dims is not None:  # one that only moves the batch (MultiheadAttention's transpose(1, 0)) is a view eager
            # PyTorch makes for free, and kgen's op would return its operand (for the batch-first model it is nothing)
            k_in = g.batch_dim(tensors[0]) if len(tensors) == 1 else None
            return k_in is not None and _moved_permutation(dims, k_in, k) != list(range(rank))
        if n.op == "call_function" and n.target is operator.getitem:  # Swin's q, k, v = qkv[0], qkv[1], qkv[2]
            return _moved_index(n, g) is not None
        if any(g.batch_dim(a) != k or _example(a).dim() != rank for a in tensors):
            return False
        layer = _layer(n)
        if layer is not None:
            kind, args, _ = layer
            if kind == "layer_norm":
                shape = args.get("normalized_shape")
                return isinstance(shape, (int, tuple, list)) and (1 if isinstance(shape, int) else len(shape)) < rank - k
            return kind == "linear" and k < rank - 1
        name = n.target if isinstance(n.target, str) else None
        if not (_elementwise_binary(n) or (n.op == "call_function" and n.target in _UNARY) or name in _UNARY_METHODS):
            return False
        others = [a for a in n.all_input_nodes if a not in tensors]  # parameters: over the dims after the batch
        return all(isinstance(_example(a), torch.Tensor) and _example(a).dim() < rank - k for a in others)

    def _parameter_view(self, n) -> bool:
        """Whether ``n`` is a parameter seen through views and 2-d transposes (``self.w.T``, importer.viewed_from)."""
        from .importer import viewed_from

        base, _ = viewed_from(n)
        return base is not n and base in self.g.state and isinstance(self.g.examples.get(base), nn.Parameter)

    def _in_place_ok(self, n: fx.Node) -> bool:
        """kgen computes an in-place call as a new value: only where nothing reads the operand after it
        and the operand is no view of something else (which the call would change too)."""
        t = n.args[0] if n.args else None
        if not isinstance(t, fx.Node) or t.op == "placeholder" or _views(t):
            return False
        order = {m: i for i, m in enumerate(n.graph.nodes)}
        return all(order[u] < order[n] for u in t.users if u is not n)


# ------------------------------------------------------------------ a partition as a model


@dataclass
class _Plan:
    """How a partition's call arguments feed the generated op."""

    model: nn.Module  # the partition in the importer's form, holding the graph's own weights
    inputs: list  # argument index of each input of the op, in order
    examples: list  # their example shapes (meta tensors, the batch the example's)
    batch: int = 0  # the example's batch: the op's dim 0 in the call compiled (a multiple of the graph's)
    members: dict = field(default_factory=dict)  # state_dict name -> argument index
    momentum: dict = field(default_factory=dict)  # batch norm module -> its momentum
    training: bool = False
    # where the batch is in each input and output (0 but for sequence-first values: the op takes them with the batch
    # moved first, and its results are moved back)
    moved_in: list = field(default_factory=list)
    moved_out: list = field(default_factory=list)


def _partition_model(sub: fx.GraphModule, call: fx.Node, g: _Graph) -> _Plan:
    """The partition ``sub`` (called as ``call`` in the partitioned graph) as a GraphModule whose
    layers are ``torch.nn`` layers holding the graph's own weight tensors, its inputs the
    partition's tensor inputs that are not parameters."""
    root = nn.Module()
    graph = fx.Graph()
    env: dict = {}
    places = [n for n in sub.graph.nodes if n.op == "placeholder"]
    outer = {p: _original(a, g) for p, a in zip(places, call.args)}
    plan = _Plan(root, [], [])
    batch_node = device_node = None
    arg_index = {p: i for i, p in enumerate(places)}
    rests = []  # each tensor input's sizes other than the batch, and its dtype
    lead = None  # the partition's batch: dim 0 of its op's values (the graph's batch, or a multiple of it)
    for p in places:  # the tensor inputs first (the op's inputs, x first)
        o = outer[p]
        if isinstance(o, fx.Node) and o not in g.state and isinstance(_example(o), torch.Tensor) and not g.batch_free(o):
            env[p] = graph.placeholder("x" if not plan.inputs else f"input{len(plan.inputs)}")
            plan.inputs.append(arg_index[p])
            ex, k = _example(o), g.batch_dim(o)
            if k is None:
                raise KgenError(f"{o.name}: an input without the batch (shape {list(ex.shape)})")
            lead = ex.shape[k] if lead is None else lead
            if not _same_size(ex.shape[k], lead):
                raise KgenError(f"{o.name}: an input of batch {ex.shape[k]} beside one of {lead}")
            plan.moved_in.append(k)
            rests.append((tuple(_static(s) for d, s in enumerate(ex.shape) if d != k), ex.dtype))
    if not plan.inputs:
        raise KgenError("no tensor input")
    # the same partition compiled again in this process (Dynamo's graph of its own for a batch of 1, a
    # recompile) keeps its first spec, whose module is loaded, not built again for another example batch
    seen = (_batch_multiple(lead, g.batch) or 1) * g.batch_seen
    plan.batch = _EXAMPLE_BATCHES.setdefault((str(kgen_cache()), sub.code, tuple(rests)), seen)
    plan.examples = [torch.empty((plan.batch,) + rest, dtype=dtype, device="meta") for rest, dtype in rests]
    counts: dict = {}

    def fresh(kind: str) -> str:
        counts[kind] = counts.get(kind, 0) + 1
        return f"{kind}{counts[kind] - 1}"

    def state_tensor(p):
        o = outer[p]
        return g.examples[o] if o in g.examples else _stand_in(_example(o))

    def device():
        nonlocal device_node
        if device_node is None:
            device_node = graph.call_function(getattr, (env[places[plan.inputs[0]]], "device"))
        return device_node

    def batch():
        nonlocal batch_node
        if batch_node is None:
            batch_node = graph.call_method("size", (env[places[plan.inputs[0]]], 0))
        return batch_node

    def arg(v):
        """An argument of a copied node: a value of the partition, the batch's size, a free parameter."""
        if isinstance(v, fx.Node):
            if v in env:
                return env[v]
            o = outer.get(v)
            if o is not None and (o in g.state or g.batch_free(o)):
                name = fresh("p")
                t = state_tensor(v)
                root.register_parameter(name, t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False))
                plan.members[name] = arg_index[v]
                env[v] = graph.get_attr(name)
                return env[v]
            if o is not None and g.is_batch(o, lead):
                return batch()
            raise KgenError(f"{v.name}: an input the partition cannot take")
        if isinstance(v, (tuple, list)):
            return type(v)(arg(e) for e in v)
        return v

    # in Dynamo's order (a valid one, and the model's own): fusing may order a partition's nodes otherwise (torch
    # 2.11 puts both of a fire module's convolutions before their ReLUs), and the importer's ops follow the order
    # they are given, which decides what the plan can fuse (a convolution absorbs the stage right after it)
    for n in _in_graph_order(sub, g):
        if n.op == "output":
            outs = n.args[0]
            for o in (outs if isinstance(outs, (tuple, list)) else [outs]):
                k = g.batch_dim(g.by_name.get(o.name)) if isinstance(o, fx.Node) else None
                if k is None:
                    raise KgenError(f"{getattr(o, 'name', o)}: a result without the batch")
                plan.moved_out.append(k)
            graph.output(arg(outs))
            continue
        layer = _layer(n)
        dims = _permutation(n)
        if dims is not None and (g.batch_dim(n) != 0 or g.batch_dim(n.args[0]) != 0):
            dims = _moved_permutation(dims, g.batch_dim(n.args[0]), g.batch_dim(n))
            env[n] = graph.call_method("permute", (arg(n.args[0]), *dims))
            continue
        if n.op == "call_function" and n.target is operator.getitem and (g.batch_dim(n.args[0]) or g.batch_dim(n)):
            env[n] = graph.call_function(operator.getitem, (arg(n.args[0]), _moved_index(n, g)))
            continue
        if layer is None:
            args, kwargs = arg(_without_empty_pieces(n)), arg(n.kwargs)
            viewed = n.args[0] if n.args else None
            viewed = outer.get(viewed) or g.by_name.get(getattr(viewed, "name", None), viewed)
            if n.target == "expand" or (n.target in ("view", "reshape") or n.target is torch.reshape) and \
                    g.batch_dim(viewed) is not None:  # (a parameter's view keeps its sizes, one equal to the batch)
                args = _batch_in_shape(args, n, g, batch)
            if isinstance(kwargs.get("device"), (torch.device, str)):
                # a tensor made on the device Dynamo saw (`torch.tensor(0.0, device=x.device)` becomes a constant
                # cuda:0): made where the partition's input is, as the traced model's own `x.device` does (the
                # importer runs the partition on the meta device, where a cuda value beside it fails)
                kwargs = {**kwargs, "device": device()}
            env[n] = graph.create_node(n.op, n.target, args, kwargs, n.name)
            continue
        kind, a, slots = layer
        if kind == "conv":
            cls, rank, transposed = _CONVS[n.target]
            w = state_tensor(a["weight"])
            groups = a.get("groups", 1)
            kw = dict(stride=a.get("stride", 1), padding=a.get("padding", 0), dilation=a.get("dilation", 1), groups=groups,
                      bias=a.get("bias") is not None)
            if transposed:
                kw["output_padding"] = a.get("output_padding", 0)
                cin, cout = w.shape[0], w.shape[1] * groups
            else:
                cin, cout = w.shape[1] * groups, w.shape[0]
            with torch.device("meta"):
                m = cls(cin, cout, tuple(w.shape[2:]), **kw)
            name = fresh("conv")
        elif kind == "linear":
            w = state_tensor(a["weight"])
            with torch.device("meta"):
                m = nn.Linear(w.shape[1], w.shape[0], bias=a.get("bias") is not None)
            name = fresh("linear")
        elif kind == "layer_norm":
            shape = a["normalized_shape"]
            with torch.device("meta"):
                m = nn.LayerNorm(shape, eps=a.get("eps", 1e-5), elementwise_affine=a.get("weight") is not None,
                                 bias=a.get("bias") is not None)
            name = fresh("ln")
        elif kind in ("group_norm", "instance_norm"):
            channels, rank = _example(n).shape[1], _example(n).dim()
            if (a.get("weight") is None) != (a.get("bias") is None):
                raise KgenError(f"{kind.replace('_', ' ')} with a weight but no bias (or a bias but no weight)")
            affine = a.get("weight") is not None
            with torch.device("meta"):
                if kind == "group_norm":
                    m = nn.GroupNorm(a["num_groups"], channels, eps=a.get("eps", 1e-5), affine=affine)
                else:
                    cls = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}[rank]
                    m = cls(channels, eps=a.get("eps", 1e-5), affine=affine)
            name = fresh("gn" if kind == "group_norm" else "inorm")
        else:
            channels = _example(n).shape[1]
            rank = _example(n).dim()
            cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[rank]
            momentum = a.get("momentum", 0.1)
            with torch.device("meta"):
                m = cls(channels, eps=a.get("eps", 1e-5), momentum=float(momentum if momentum is not None else 0.1),
                        affine=a.get("weight") is not None, track_running_stats=a.get("running_mean") is not None)
            if (a.get("weight") is None) != (a.get("bias") is None):
                raise KgenError("batch norm with a weight but no bias (or a bias but no weight)")
            name = fresh("bn")
            plan.momentum[name] = float(momentum if momentum is not None else 0.1)
            if a.get("training", False) and a.get("running_mean") is not None:
                plan.training = True
            elif not a.get("training", False) and a.get("running_mean") is None:
                raise KgenError("batch norm in eval mode without running statistics")
        for s in slots:
            t = a.get(s)
            if t is None:
                continue
            tensor = state_tensor(t)
            if isinstance(getattr(m, s), nn.Parameter):
                setattr(m, s, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False))
            else:
                setattr(m, s, tensor)
            plan.members[f"{name}.{s}"] = arg_index[t]
        if kind == "batch_norm" and m.track_running_stats:
            m.num_batches_tracked = torch.zeros((), dtype=torch.long)
        root.add_module(name, m)
        env[n] = graph.call_module(name, (arg(a["input"]),))
    modes = {bool(_layer(n)[1].get("training", False)) for n in sub.graph.nodes
             if _layer(n) is not None and _layer(n)[0] == "batch_norm"}
    if len(modes) > 1:
        raise KgenError("batch norms in training and in eval mode in one partition")
    plan.training = modes.pop() if modes else False
    plan.model = fx.GraphModule(root, graph, class_name="KgenPartition").train(plan.training)
    return plan


def _in_graph_order(sub: fx.GraphModule, g: _Graph) -> list:
    """The partition's nodes but its placeholders, in the order of Dynamo's graph where that order is one the
    partition's own dependencies allow (it is, unless fusing renamed a node), else in the partition's order."""
    order = {n.name: i for i, n in enumerate(g.gm.graph.nodes)}
    body = [n for n in sub.graph.nodes if n.op != "placeholder"]
    ranked = sorted(body, key=lambda n: (n.op == "output", order.get(n.name, -1)))
    seen = {n for n in sub.graph.nodes if n.op == "placeholder"}
    for n in ranked:
        if any(a not in seen for a in n.all_input_nodes):
            return body
        seen.add(n)
    return ranked


def _outputs(sub: fx.GraphModule):
    """What a partition's graph returns: a node, or a tuple of them."""
    return next(n for n in sub.graph.nodes if n.op == "output").args[0]


def _original(a, g: _Graph):
    """The node of Dynamo's graph that the partitioned graph's argument ``a`` stands for: itself (fusing
    keeps the names of the nodes it leaves), or, where ``a`` is the output of another partition
    (``fused_3`` or ``getitem(fused_3, k)``), the node that partition returns."""
    if not isinstance(a, fx.Node):
        return a
    index = None
    if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[0], fx.Node) \
            and a.args[0].op == "call_module" and isinstance(a.args[1], int):
        a, index = a.args[0], a.args[1]
    if a.op == "call_module" and isinstance(a.target, str) and a.target.startswith("fused_"):
        sub = g.parts.get(a.target)
        if sub is None:
            return None
        outs = _outputs(sub)
        inner = outs[index] if index is not None and isinstance(outs, (tuple, list)) else outs
        return g.by_name.get(inner.name) if isinstance(inner, fx.Node) else None
    return g.by_name.get(a.name)


def _stand_in(example: torch.Tensor) -> torch.Tensor:
    """A value for a batch-free operand computed in the graph (``Graph.batch_free``) in the partition's model: the
    op is given the graph's value at each call; this one (random normal, the same at every compile) is what the
    import check computes with."""
    gen = torch.Generator().manual_seed(0)
    shape = tuple(int(_static(s)) for s in example.shape)
    return torch.randn(shape, generator=gen, dtype=example.dtype).to(example.device)


def _batch_in_shape(args, n: fx.Node, g: _Graph, batch):
    """``x.view(2, -1)`` (or ``self.cls_token.expand(2, -1, -1)``) in a graph Dynamo specialized to batch 2: the
    batch is the input's dim 0, whatever it is."""
    if g.batch is None or isinstance(g.batch, torch.SymInt) or len(args) < 2:
        return args
    shape = _size_args(args)
    if shape and shape[0] == g.batch and not isinstance(shape[0], fx.Node):
        shape[0] = batch()
        return (args[0], tuple(shape))
    return args


def _size_args(args) -> list:
    """The sizes of ``x.view(...)``, ``x.reshape(...)``, ``x.expand(...)`` or ``torch.reshape(x, ...)`` from its
    arguments: given one by one or as one tuple."""
    return list(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) else list(args[1:])


# ------------------------------------------------------------------ a partition at run time


class KgenPartition(nn.Module):
    """One partition run by its generated op: the call's arguments (the partition's inputs as the
    partitioned graph passes them) go to the op's functional form; its running statistics come back
    updated and are copied into the graph's buffers, as ``F.batch_norm`` updates them in place.

    Given ``pytorch_form`` (the partition's calls as PyTorch computes them), the faster of the two runs,
    measured per call signature in the first calls (kgen.runtime.MeasuredGraph, not replayed: the graph is): the
    cost model's error on one partition costs that partition, not its graph's other partitions."""

    def __init__(self, module, plan: _Plan, several: bool, pytorch_form: nn.Module | None = None, on_choice=None):
        super().__init__()
        self.kgen_sources = Path(module.__file__).parent  # the module's folder, named as its op kgen::NAME
        self.module_name = self.kgen_sources.name
        self._forward = module.forward
        self._inputs = list(plan.inputs)
        self._params = [plan.members[k] for k in module.PARAMETERS]
        self._buffers = [plan.members[k] for k in getattr(module, "BUFFERS", {})]
        sig = inspect.signature(module.forward).parameters
        extra = []
        if "training" in sig:
            extra.append(plan.training)
        if "factors" in sig:
            norms = [next(iter(op.values())) for op in module.SPEC_DATA["ops"] if next(iter(op)) == "batch_norm"]
            extra.append([plan.momentum[f["name"]] for f in norms if f.get("track_running_stats", True)])
        self._extra = extra
        self._update = plan.training and bool(self._buffers)
        self._several = several  # the graph takes a tuple (of one output, maybe)
        self._result = op_result(f"kgen::{self.module_name}")  # how the op lays out its outputs and statistics
        self._moved_in = list(plan.moved_in) if any(plan.moved_in) else None
        self._moved_out = list(plan.moved_out) if any(plan.moved_out) else None
        # the common call (nothing moved, no statistics to copy back, one tensor out) on a short path: the op's
        # arguments gathered in one step, and no nn.Module.__call__ (a Linear + ReLU + scale partition's call on the
        # 2-core CPU machine: 7.9 -> 6.3 us, of which the generated op 5.4; 2026-12-05)
        order = self._inputs + self._params + self._buffers
        self._gather = operator.itemgetter(*order) if len(order) > 1 else (lambda args, i=order[0]: (args[i],))
        self._plain = not (self._moved_in or self._moved_out or self._update or self._result.is_list or several)
        self.measured = None
        if pytorch_form is not None:
            from .runtime import MeasuredGraph

            self.pytorch_form = pytorch_form
            self.measured = MeasuredGraph({"kgen": self._run, "eager": pytorch_form}, self._params + self._buffers,
                                          replayable=False, name=f"partition {self.module_name}", on_choice=on_choice)

    def settled(self) -> bool:
        """Whether the latest call's signature has its form chosen (or nothing is measured)."""
        return self.measured is None or self.measured.is_settled()

    # (called directly, not through nn.Module.__call__: the partitioned graph calls it on every call, and no hook
    # is ever registered on it)
    def __call__(self, *args):
        return self._run(*args) if self.measured is None else self.measured(*args)

    forward = __call__

    def _run(self, *args):
        if self._plain:
            out = self._forward(*self._gather(args), *self._extra)
            if not torch.is_grad_enabled():
                return out
            return tuple(_owned(o) for o in out) if self._several else _owned(out)
        buffers = [args[i] for i in self._buffers]
        inputs = [args[i] for i in self._inputs]
        if self._moved_in:  # sequence-first values: the op takes the batch first
            inputs = [t.movedim(k, 0) if k else t for t, k in zip(inputs, self._moved_in)]
        out, stats = self._result.split(self._forward(*inputs, *(args[i] for i in self._params), *buffers, *self._extra))
        if self._update:
            with torch.no_grad():
                torch._foreach_copy_(buffers, stats)  # one launch for every running statistic
        outs = list(out) if self._result.several else [out]
        if self._moved_out:  # ... and its results go back where the graph has their batch
            outs = [o.movedim(0, k) if k else o for o, k in zip(outs, self._moved_out)]
        if torch.is_grad_enabled():
            outs = [_owned(o) for o in outs]
        return tuple(outs) if self._several else outs[0]


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A partition's result that autograd records as a view of the op's own tensors (its last call a flatten:
    EfficientNet's pooled features), copied: autograd refuses an in-place call on such a view (the graph's
    ``F.dropout(..., inplace=True)`` after it) where the op returns several tensors."""
    return t.clone() if t.requires_grad and t._is_view() else t


def _render_partition(sub: fx.GraphModule, call: fx.Node, g: _Graph, verbose: bool, spec_keys: dict) -> tuple[_Plan, Path]:
    """The partition imported, checked and rendered into kgen's cache (or found there), not built."""
    from .build import default_variant
    from .compiler import compile_module

    devices = {t.device.type for t in g.examples.values() if isinstance(t, torch.Tensor)}
    if "cuda" in devices and default_variant() != "cuda":
        raise KgenError("the model is on a GPU, but kgen builds for the CPU here (no nvcc, or KGEN_DEVICE=cpu)")
    plan = _partition_model(sub, call, g)
    module_dir = compile_module(plan.model, *plan.examples, name=_NAME, verbose=verbose, build=False, **spec_keys)
    _refuse_eager_plans(module_dir, g, plan.batch)
    return plan, module_dir


def _replay_applies(g: _Graph) -> bool:
    """Whether the generated op will replay its kernels as CUDA graphs (kgen.runtime.GraphReplay): on a GPU, in
    a graph Dynamo compiled with autograd off (it guards on grad mode) or with nothing requiring grad."""
    tensors = [t for t in g.examples.values() if isinstance(t, torch.Tensor)]
    return any(t.device.type == "cuda" for t in tensors) and \
        (not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors))


def _refuse_eager_plans(module_dir: Path, g: _Graph, batch: int) -> None:
    """A partition whose every plan is the eager candidate (its ops through ATen, chosen by the cost model or
    the tuning file as the fastest), or estimated no faster than it (Variant.eager_as_fast), stays PyTorch's: a
    generated op would only add a call around the same work. Says why, with the choice's reason. Unless the op
    replays them as one CUDA graph and that saves time (many small kernels at a small batch: an RNN's unrolled
    steps): then the op is that replay."""
    from .cost import argument_bytes
    from .ir import load_pipeline
    from .plan import EAGER, EAGER_CHOICE, PIPELINE
    from .runtime import replay_saving_s

    selection = json.loads((module_dir / "plan.json").read_text())
    plans = selection["plans"]
    eager = [any(c["decision"] == PIPELINE and c["chosen"] == EAGER for c in p["choices"]) for p in plans]
    if all(e or p.get("eager_as_fast") for e, p in zip(eager, plans)):
        if _replay_applies(g):  # the dispatch as rendered (at the spec's example batch), not planned again
            dispatch_us = max(selection["host_dispatch_us"].values())  # (an eager plan has one mode)
            pipe = load_pipeline(module_dir.parent / SPEC_FILE)
            saved = replay_saving_s(1e-6 * dispatch_us, argument_bytes(pipe, batch))
            if saved > 0:
                _say(f"{module_dir.name}: its ops through ATen, replayed as one CUDA graph ({dispatch_us:g} us of "
                     f"the host's dispatch, {1e3 * saved:.3f} ms saved a call)")
                return
        if not all(eager):  # the cost model's estimate of its own ops through ATen equals its plan's
            why = plans[eager.index(False)]["stages"][0].get("choice", "").partition(": ")[2]
            raise KgenError(f"its own ops through ATen are as fast as its plan ({why})")
        choice = plans[0]["stages"][0].get("choice", "") if plans[0]["stages"] else ""
        why = choice.removeprefix(EAGER_CHOICE.partition("{reason}")[0]).removesuffix(")")
        raise KgenError(f"its fastest plan is its own ops through ATen ({why})")


def _load_partition(sub: fx.GraphModule, g: _Graph, plan: _Plan, module_dir: Path, verbose: bool,
                    autotune: bool = False) -> KgenPartition:
    """The built partition (tuned first, for max-autotune) loaded as its runner, measured against ``sub`` (its
    calls as PyTorch computes them)."""
    from .build import default_variant
    from .compiler import tune_module
    from .validate import import_module_dir

    key = str(module_dir)
    if autotune:
        if default_variant() != "cuda" or not torch.cuda.is_available() or not g.on_gpu:
            _say_once("mode max-autotune: nothing to tune on the CPU (kgen tune measures plans on a CUDA GPU); "
                      "the cost model's plans run")
        elif key not in _LOADED:  # (a module loaded in this process keeps its op until the next process)
            tune_module(module_dir, [plan.batch], verbose)
            _refuse_eager_plans(module_dir, g, plan.batch)
    if key not in _LOADED:
        _LOADED[key] = import_module_dir(module_dir)
    def said(text: str) -> None:  # (a partition that keeps kgen's op says nothing: the usual case)
        if verbose and "runs eager's form" in text:
            _say(text)

    return KgenPartition(_LOADED[key], plan, isinstance(_outputs(sub), (tuple, list)), pytorch_form=sub,
                         on_choice=said)


# ------------------------------------------------------------------ the backend


def _computes(nodes) -> bool:
    """Whether a partition computes something (not only views and copies of its inputs) that the rest of the
    graph reads: a partition none of whose values is read is dead code, or in-place calls whose effect is all
    it is for (an optimizer's step), which stay PyTorch's."""
    return (any(not _views(n) and getattr(n.target, "__name__", n.target) not in ("clone", "size") for n in nodes)
            and _values_read_outside(set(nodes)) > 0)


def _values_read_outside(nodes: set) -> int:
    """How many values of the region ``nodes`` the rest of the graph reads (what its module returns)."""
    return sum(1 for n in nodes if any(u not in nodes for u in n.users))


def _without_passing_views(parts, gm: fx.GraphModule) -> list:
    """The partitions, each without its views that only pass a value from outside it to outside it (Mamba2's
    ``rearrange`` of an input that an einsum reads): PyTorch makes such a view for free, where the generated op would
    take the operand as one more input and return it. A partition with an in-place call keeps them (a view
    made outside it would see the update at another point). Closed still: what is taken out reads only values from
    outside or taken out, and only they or the outside read it."""
    from torch.fx.passes.infra.partitioner import Partition

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for p in parts:
        nodes = sorted(p.nodes, key=order.get)
        inside = set(nodes)
        if any(_in_place(n) for n in nodes):
            out.append(p)
            continue
        rooted: set = set()  # views of values from outside (through views)
        for n in nodes:
            if _views(n) and all(a not in inside or a in rooted for a in n.all_input_nodes):
                rooted.add(n)
        read_outside: set = set()  # ... that only the outside (or others of them) reads
        for n in reversed(nodes):
            if n in rooted and all(u not in inside or u in read_outside for u in n.users):
                read_outside.add(n)
        passing: set = set()
        for n in nodes:  # (whose operands are outside or taken out too)
            if n in read_outside and all(a not in inside or a in passing for a in n.all_input_nodes):
                passing.add(n)
        out.append(Partition(nodes=[n for n in nodes if n not in passing]) if passing else p)
    return out


def _within_output_limit(parts, gm: fx.GraphModule) -> list:
    """The partitions, each that returns more values than a kgen op may (spec.MAX_OUTPUTS: a loop unrolled by
    Dynamo, an RNN cell's output kept at each of 256 steps) cut into consecutive pieces in graph order that each
    return at most that many. A piece of a partition in graph order is a partition too: a path from one of its
    nodes back into it would pass through a later piece or leave the partition, and the partitioner's are closed."""
    from torch.fx.passes.infra.partitioner import Partition

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for p in parts:
        if _values_read_outside(set(p.nodes)) <= MAX_OUTPUTS:
            out.append(p)
            continue
        piece: list = []
        for n in sorted(p.nodes, key=order.get):
            if piece and _values_read_outside(set(piece) | {n}) > MAX_OUTPUTS:
                out.append(Partition(nodes=piece))
                piece = []
            piece.append(n)
        out.append(Partition(nodes=piece))
    return out


def _calls(nodes) -> list[str]:
    return [n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)) for n in nodes]


MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes kgen takes
_SAID: set = set()  # one-time messages already said


if _Restart is not None:
    class _DynamicBatch(_Restart):
        """Dynamo traces the frame again, now with the batch dynamic."""


def _source_name(n: fx.Node) -> str | None:
    src = getattr(n.meta.get("grapharg"), "source", None)
    name = getattr(src, "name", None)
    return name() if callable(name) else name


def _ask_dynamic_batch(g: _Graph) -> None:
    """Where the batch is static (Dynamo's first trace of a frame), mark dim 0 of the graph's batch inputs
    dynamic in Dynamo's automatic-dynamic state for the frame (as ``torch._dynamo.mark_dynamic`` records
    itself there) and restart its analysis: the frame is traced again with the batch a symbol, and a new
    batch size passes the guards. Asked once per frame and inputs: a batch Dynamo specializes anyway
    (``mark_static``, a size of 1, a graph that guards on it) comes back static and is compiled so
    (``torch._dynamo.reset()`` forgets what was asked, with the rest of Dynamo's state).
    Nothing is asked where automatic dynamic shapes are off (``torch.compile(dynamic=False)``) or where
    Dynamo's internals are not what this expects (then a new batch recompiles once, as Dynamo does)."""
    if _Restart is None or not isinstance(g.batch, int) or g.batch <= 1 \
            or not torch._dynamo.config.automatic_dynamic_shapes:
        return
    root = _root_tx()
    try:
        from torch._dynamo.pgo import (CodeId, FrameStateSizeEntry, auto_dynamic, auto_unset, get_code_state,
                                       process_automatic_dynamic)

        if root is None:
            return
        try:
            code_id = CodeId.make(root.f_code, root.closure)
        except TypeError:  # (torch < 2.12 keys a frame by its code alone)
            code_id = CodeId.make(root.f_code)
        state = get_code_state()[code_id].automatic_dynamic
    except (ImportError, AttributeError, TypeError):
        return
    if state is None:
        return
    inputs = []
    for n in g.gm.graph.nodes:
        ex = _example(n)
        if n.op == "placeholder" and n not in g.model_state and isinstance(ex, torch.Tensor) and ex.dim() >= 1 \
                and _same_size(ex.shape[0], g.batch):
            name = _source_name(n)
            if name is None:
                return
            if name in state and state[name].is_size_dynamic(0):
                return  # asked before: Dynamo keeps this batch static
            inputs.append((name, ex.dim()))
    if not inputs:
        return
    for name, rank in inputs:
        size = [auto_unset] * rank
        size[0] = auto_dynamic
        process_automatic_dynamic(root, name, FrameStateSizeEntry.make_size(tuple(size)))
    _remember_dynamic_batch(code_id, inputs)
    # The trace with a symbolic batch takes other steps (``B, T, C = x.size()`` is no longer constants):
    # what Dynamo's speculation log remembers of this trace would not match it ("SpeculationLog diverged").
    # Forgotten, a graph break it recorded is found again (and asked of this backend, which asks nothing twice).
    log = getattr(root, "speculation_log", None)
    if log is not None and hasattr(log, "clear"):
        log.clear()
    raise _DynamicBatch(restart_reason=f"kgen: the batch of {', '.join(n for n, _ in inputs)} is the run-time size")


DYNAMIC_BATCH_KEEP = 1000  # frames remembered, the latest asked


def _remember_dynamic_batch(code_id, inputs: list) -> None:
    """Record in kgen's cache that the frame ``code_id`` (Dynamo's pgo.CodeId: its file's content hash, line and
    name) has its batch inputs ``inputs`` ((name, rank)) dynamic, for ``_seed_dynamic_batches`` in later processes.
    A cache that cannot be written is skipped (the next process asks again)."""
    path = kgen_cache() / DYNAMIC_BATCH_FILE
    frames = _read_dynamic_batches(path)
    key = f"{code_id.file_hash}:{code_id.firstlineno}:{code_id.name}:{getattr(code_id, 'closure_hash', None)}"
    frames.pop(key, None)
    frames[key] = {"code": dataclasses.asdict(code_id), "inputs": dict(inputs)}
    text = json.dumps(dict(list(frames.items())[-DYNAMIC_BATCH_KEEP:]), indent=0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass


def _read_dynamic_batches(path) -> dict:
    try:
        frames = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return frames if isinstance(frames, dict) else {}


def _seed_dynamic_batches() -> None:
    """Dynamo traces a frame with its sizes static first; the backend then asks for the batch as a symbol and
    Dynamo traces it again (``_ask_dynamic_batch``), the slower of the two traces (DenseNet-201 on the CPU: 3.7 s
    static, then 5.6 s symbolic). The frames asked in earlier processes start with the batch dynamic in Dynamo's
    automatic-dynamic state (as Dynamo's own profile would under ``torch.compiler.config.job_id``), so Dynamo traces
    them once. Run when kgen.backend is imported: by ``torch.compile(backend="kgen")``'s lookup, before the
    first trace. A frame whose file changed has another content hash, and matches nothing."""
    try:
        from torch._dynamo.pgo import CodeId, FrameStateSizeEntry, auto_dynamic, auto_unset, get_code_state

        fields = {f.name for f in dataclasses.fields(CodeId)}
        state = get_code_state()
    except (ImportError, AttributeError, TypeError):
        return
    for frame in _read_dynamic_batches(kgen_cache() / DYNAMIC_BATCH_FILE).values():
        try:
            code = frame["code"]
            if set(code) != fields:  # another torch's CodeId
                continue
            seen = state[CodeId(**code)].automatic_dynamic
            for name, rank in frame["inputs"].items():
                size = [auto_unset] * int(rank)
                size[0] = auto_dynamic
                seen.setdefault(name, FrameStateSizeEntry.make_size(tuple(size)))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue


def _dynamic_sizes(g: _Graph) -> list:
    """The nodes kgen would compute but for a dynamic size other than the batch: (node, why)."""
    from .importer import maps_call

    out = []
    for n in g.gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not (_layer(n) is not None or maps_call(n)):
            continue
        for a in [n, *n.all_input_nodes]:
            ex = _example(a)
            if a in g.state or not isinstance(ex, torch.Tensor) or ex.dim() == 0:
                continue
            rest = [d for d, s in enumerate(ex.shape) if isinstance(_static(s), torch.SymInt)
                    and _batch_multiple(s, g.batch) is None]  # (the batch is a multiple of 1, anywhere)
            if rest:
                shape = ", ".join(str(s) for s in ex.shape)
                out.append((n, f"{a.name} is [{shape}]: dim {', '.join(map(str, rest))} dynamic"))
                break
    return out


def _say_once(msg: str) -> None:
    if msg not in _SAID:
        _SAID.add(msg)
        _say(msg)


def _options(options: dict | None, mode: str | None) -> dict:
    opts = dict(options or {})
    verbose = bool(opts.pop("verbose", True))
    spec_keys = {k: opts.pop(k) for k in ("precision", "intermediates") if k in opts}
    if "mode" in opts:
        if mode is not None:
            raise KgenError("torch.compile(backend='kgen'): mode given twice (mode= and options['mode'])")
        mode = opts.pop("mode")
    if opts:
        raise KgenError(f"torch.compile(backend='kgen'): unknown options {', '.join(sorted(opts))}; expected verbose, "
                        "precision, intermediates, mode")
    mode = mode or "default"
    if mode not in MODES:
        raise KgenError(f"torch.compile(backend='kgen'): mode={mode!r}; expected one of {', '.join(MODES)}")
    return dict(verbose=verbose, spec_keys=spec_keys, autotune=mode != "default")


def _root_tx():
    """Dynamo's translator of the frame being compiled (the one that calls this backend), or None where
    Dynamo's internals are not what this expects."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return tx.output.root_tx if tx is not None else None
    except (ImportError, AttributeError):
        return None


def _one_graph() -> bool:
    """Whether Dynamo was asked for one whole graph (``torch.compile(fullgraph=True)``)."""
    return bool(getattr(_root_tx(), "one_graph", False))


def backend_for_compile():
    """What to pass as torch.compile's ``backend``: "kgen" where the installed package's entry point registers it,
    else ``kgen_backend`` itself (a checkout on PYTHONPATH has no entry point)."""
    return "kgen" if "kgen" in torch._dynamo.list_backends() else kgen_backend


def kgen_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """The Dynamo backend ``kgen``: ``gm`` with the partitions kgen computes replaced by generated ops."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    opts = _options(options, mode)
    verbose, spec_keys = opts["verbose"], opts["spec_keys"]
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if _drop_dead_code(gm):
        gm.recompile()
    g = _Graph(gm, dict(zip(places, example_inputs)))
    _ask_dynamic_batch(g)
    original = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # (PyTorch's form, measured against kgen's)
    rewritten = rewrite_attention(gm, {n: g.examples[n] for n in g.state}) + _float_masks(gm, g)
    if rewritten:
        if verbose:
            for line in rewritten:
                _say(line)
        g = _Graph(gm, dict(zip(places, example_inputs)))
    STATS["graphs"] += 1
    fullgraph = _one_graph()
    dynamic = _dynamic_sizes(g)
    if dynamic:
        names = _calls([n for n, _ in dynamic])
        why = (f"sizes other than the batch are dynamic ({dynamic[0][1]}); kgen compiles them in: "
               "torch.compile(dynamic=False) or torch._dynamo.mark_static keeps them static")
        if fullgraph:
            raise KgenError(f"fullgraph=True: {', '.join(names[:6])} would stay eager: {why}")
        PARTITIONS.append({"calls": names, "module": None, "reason": why})
        _say(f"{len(names)} call(s) ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}) stay eager: {why}")
    partitioner = CapabilityBasedPartitioner(gm, _Support(g), allows_single_node_partition=True)
    proposed = _connected_pieces(_split_at_writes(_without_passing_views(partitioner.propose_partitions(), gm), gm))
    parts = [p for p in _within_output_limit(proposed, gm) if _computes(p.nodes)]
    if not parts:
        return _measured(gm if rewritten else original, original, g, places, verbose)
    # each partition's nodes, in graph order, before fusing renames them
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    described = [_calls(sorted(p.nodes, key=order.get)) for p in parts]
    fused = partitioner.fuse_partitions(parts)
    calls = {n.target: n for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")}
    g.parts = {target: fused.get_submodule(target) for target in calls}

    def eager(names, e) -> None:
        """Whatever fails in one partition, the model runs: that partition eagerly (its calls put back in the
        graph: _inline), with one line saying why."""
        if not isinstance(e, (KgenError, NotImplementedError, RuntimeError, TypeError, ValueError)):
            e = KgenError(f"kgen failed on it, a bug in kgen ({type(e).__name__}: {one_line(e, 200)}); please report it")
        STATS["eager"] += 1
        PARTITIONS.append({"calls": names, "module": None, "reason": one_line(e, 300)})
        text = _calls_text(names)
        why = f"{type(e).__name__ + ': ' if not isinstance(e, KgenError) else ''}{one_line(e, 300)}"
        if fullgraph:
            raise KgenError(f"fullgraph=True: partition ({text}) would stay eager: {why}") from None
        _say(f"partition ({text}) stays eager: {why}")

    rendered = []  # (target, calls, its submodule, plan, module folder): every partition rendered first ...
    in_kgen = set()
    for i, names in enumerate(described):
        target = f"fused_{i}"  # fuse_partitions names the i-th partition it is given so
        call = calls.get(target)
        if call is None:
            continue
        STATS["partitions"] += 1
        sub = fused.get_submodule(target)
        try:
            rendered.append((target, names, sub, *_render_partition(sub, call, g, verbose, spec_keys)))
        except Exception as e:  # noqa: BLE001 - see eager()
            eager(names, e)
    failures: dict = {}  # ... then built together (ninja's jobs of several modules at once) ...
    _build_together([r[4] for r in rendered if str(r[4]) not in _LOADED], failures, verbose)
    for target, names, sub, plan, module_dir in rendered:  # ... and loaded
        try:
            if module_dir in failures:
                raise KgenError(failures[module_dir])
            runner = _load_partition(sub, g, plan, module_dir, verbose, opts["autotune"])
        except Exception as e:  # noqa: BLE001 - see eager()
            eager(names, e)
            continue
        STATS["kgen"] += 1
        spec = module_dir.parent / SPEC_FILE
        PARTITIONS.append({"calls": names, "module": runner.module_name, "reason": None, "spec": str(spec),
                           "runner": weakref.ref(runner)})  # (its measured choice; no GPU memory kept alive)
        if verbose:
            _say(f"partition ({_calls_text(names)}) runs as kgen::{runner.module_name}; `kgen explain {spec}` "
                 "shows its plan")
        setattr(fused, target, runner)
        in_kgen.add(target)
    if len(in_kgen) == 1:  # one partition: the graph's own measurement (below) compares it with PyTorch's calls,
        fused.get_submodule(next(iter(in_kgen))).measured = None  # and a second per call costs microseconds
    for target, call in calls.items():
        if target not in in_kgen:
            _inline(fused, call)
        else:
            _issue_first(fused, call)
    fused.recompile()
    return _measured(fused, original, g, places, verbose)


def _measured(gm: fx.GraphModule, original: fx.GraphModule, g: _Graph, places: list, verbose: bool):
    """The graph's forward: kgen's (``gm``) and PyTorch's (``original``, the graph as Dynamo gave it), each called
    directly and, on a GPU, replayed as one CUDA graph, the fastest measured per call signature
    (``kgen.runtime.MeasuredGraph``); their constants computed once (``_fold_constants``)."""
    from .runtime import MeasuredGraph

    for m in dict.fromkeys([gm, original]):
        if _fold_constants(m):
            m.recompile()
    why = _not_replayable(original, g)
    GRAPHS.append({"graph": STATS["graphs"], "replay": why, "measured": None})
    forms = {"kgen": gm.forward, "eager": original.forward} if gm is not original else {"eager": gm.forward}
    partitions = [m for m in gm.modules() if isinstance(m, KgenPartition)]
    measured = MeasuredGraph(forms, [i for i, n in enumerate(places) if n in g.model_state], replayable=why is None,
                             name=f"graph {STATS['graphs']}", on_choice=_say if verbose else None,
                             settled={"kgen": lambda: all(p.settled() for p in partitions)})  # (its partitions' choices)
    GRAPHS[-1]["measured"] = weakref.ref(measured)  # (the list keeps no compiled graph, or its GPU memory, alive)
    return measured


# calls that wait for the GPU (no CUDA graph captures them)
_SYNCS = frozenset({"item", "tolist", "numpy", "nonzero", "unique", "masked_select", "equal", "allclose",
                    "_local_scalar_dense", "cpu"})


def _not_replayable(gm: fx.GraphModule, g: _Graph) -> str | None:
    """Why the graph cannot be replayed as a CUDA graph, or None: it writes into an input other than the model's
    parameters and buffers (a replay's copy of it would take the write), waits for the GPU, or makes a value on
    the CPU (a copy from host memory)."""
    state = {n.name for n in g.model_state}
    examples = {p.name: e for p, e in g.examples.items()}  # (by name: ``gm`` may be a copy of the graph g read)
    for n in gm.graph.nodes:
        if _writes(n) and n.args and isinstance(n.args[0], fx.Node):
            base = _view_base(n.args[0])
            if base.op == "placeholder" and base.name not in state:
                return f"it writes into its input {base.name} ({_name(n)})"
        if n.op in ("call_function", "call_method") and _name(n) in _SYNCS:
            return f"{_name(n)} waits for the GPU"
    for n in gm.graph.nodes:
        ex = examples.get(n.name) if n.op == "placeholder" else n.meta.get("example_value")
        if isinstance(ex, torch.Tensor) and ex.device.type != "cuda":
            return f"{n.name} is on the {ex.device.type}"
    return None


_WRITES = frozenset({"copy_", "setitem", "index_put_", "scatter_", "masked_fill_", "fill_", "zero_"})
# calls that make a tensor of their arguments alone, the same every call (not random, not uninitialized)
_CONSTRUCTORS = frozenset({"tensor", "as_tensor", "scalar_tensor", "full", "zeros", "ones", "arange", "linspace",
                           "logspace", "eye"})
_RANDOM = frozenset({"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
                     "dropout", "multinomial", "randperm", "poisson", "empty", "empty_like", "empty_strided"})


# methods with an effect beyond their result, whose names do not end in "_"
_EFFECTS = frozenset({"record_stream", "backward", "register_hook", "retain_grad", "__setitem__"})


def _drop_dead_code(gm: fx.GraphModule) -> bool:
    """Remove the calls whose results nothing uses (``torch.fx``'s dead-code pass, with kgen's test of an effect):
    Dynamo keeps them (Mamba2's model computes a block output it never returns, 5 of its 6.5 ms). Whether any
    was removed."""
    return gm.graph.eliminate_dead_code(is_impure_node=_has_effect)


def _has_effect(n: fx.Node) -> bool:
    """Whether node ``n`` matters beyond its result: anything but a call (an input, the output, a module), a call
    that writes into an operand or to ``out=``, draws random numbers (the later draws would change), waits for the
    GPU, or is one of fx's impure calls (grad mode, asserts)."""
    if n.op not in ("call_function", "call_method"):
        return True
    name = _name(n)
    return (_writes(n) or "out" in n.kwargs or name in _RANDOM or name in _SYNCS or name in _EFFECTS
            or name.endswith("_") or (n.op == "call_function" and n.is_impure()))


def _writes(n: fx.Node) -> bool:
    """Whether call ``n`` writes into its first operand."""
    return n.op in ("call_function", "call_method") and (_in_place(n) or _name(n) in _WRITES)


def _view_base(n):
    """The value ``n`` views (through views of views), or ``n``."""
    while isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and _views(n) and n.args:
        n = n.args[0]
    return n


def _float_masks(gm: fx.GraphModule, g: _Graph) -> list[str]:
    """``x.masked_fill(mask, value)`` with a number for value and a boolean mask made without the graph's inputs
    (Mamba2's ``~torch.tril(torch.ones(T, T, dtype=torch.bool))``, a mask compared from a buffer) ->
    ``masked_fill_nonzero(x, mask.to(x.dtype), value)`` (kgen.ops): kgen's operands are tensors of x's dtype, and
    the conversion is computed once where the mask is a constant (``_fold_constants``), else where PyTorch computes
    the mask. One line per call rewritten."""
    from .importer import fill_mask
    from .ops import masked_fill_nonzero

    lines = []
    for n in list(gm.graph.nodes):
        if fill_mask(n) is None:
            continue
        args = _bound(n, ("input", "mask", "value"))
        x, mask, value = args.get("input"), args.get("mask"), args.get("value")
        ex, em = _example(x), _example(mask)
        if not (isinstance(ex, torch.Tensor) and ex.dtype == g.dtype and g.batch_dim(x) is not None and isinstance(em, torch.Tensor)
                and em.dtype == torch.bool and mask.name not in g.from_inputs and em.dim() <= ex.dim()
                and isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue
        with gm.graph.inserting_before(n):
            converted = gm.graph.call_method("to", (mask, ex.dtype))
            converted.meta["example_value"] = em.to(ex.dtype)
            fill = gm.graph.call_function(masked_fill_nonzero, (x, converted, float(value)))
            fill.meta.update(n.meta)
        n.replace_all_uses_with(fill)
        gm.graph.erase_node(n)
        lines.append(f"{n.name}: masked_fill with a mask made without the inputs, as masked_fill_nonzero of the mask "
                     f"in {str(ex.dtype).removeprefix('torch.')}")
    return lines


def _fold_constants(gm: fx.GraphModule) -> int:
    """Compute once the tensors the graph makes from constants alone, and read them as the graph's attributes:
    SwinV2's ``torch.log(torch.tensor(1. / 0.01, device=x.device))`` is a copy from host memory at every call,
    which no CUDA graph can capture. Not a value that anything writes into, or views where the view is not
    folded too (a write through it), or that the graph returns (the caller may write into it). Returns the number
    of values folded."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    excluded: set = set()
    while True:
        const: set = set()
        for n in calls:
            if n in excluded or _name(n) in _RANDOM or _writes(n):
                continue
            inputs = n.all_input_nodes
            if (not inputs and n.op == "call_function" and _name(n) in _CONSTRUCTORS) or \
                    (inputs and all(a in const for a in inputs)):
                const.add(n)
        bad = {n for n in const if any((_writes(u) and u.args and u.args[0] is n) or (_views(u) and u not in const)
                                       or u.op == "output" for u in n.users)}  # (a caller may write a result)
        if not bad:
            break
        excluded |= bad
    frontier = [n for n in calls if n in const and any(u not in const for u in n.users)]
    if not frontier:
        return 0
    env: dict = {}
    try:
        for n in calls:
            if n not in const:
                continue
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], n.target)(*args[1:], **kwargs)
    except Exception:  # noqa: BLE001 - a value that cannot be computed here stays a call
        return 0
    folded = 0
    for n in frontier:
        if not isinstance(env[n], torch.Tensor):
            continue
        name = f"_kgen_constant_{folded}"
        gm.register_buffer(name, env[n], persistent=False)
        with gm.graph.inserting_before(n):
            n.replace_all_uses_with(gm.graph.get_attr(name))
        folded += 1
    for n in reversed(calls):
        if n in const and not n.users:
            gm.graph.erase_node(n)
    return folded


# in-place updates _issue_first may move after a kgen call: arithmetic (a random fill's draws would move past others')
_BOOKKEEPING = frozenset({"add_", "sub_", "mul_", "div_", "fill_", "zero_", "copy_"})


def _issue_first(gm: fx.GraphModule, call: fx.Node) -> None:
    """Move after the kgen call ``call`` the bookkeeping before it: in-place updates of graph inputs that nothing
    else in the graph reads, whose results nothing uses (a training-mode batch norm's
    ``num_batches_tracked += 1``, which Dynamo's graph puts before the partition that holds the norm). The host
    then issues the partition's kernels first and the GPU starts sooner where the queue is empty at the call (as
    KernelBench times a call): on the H200, under torch.profiler, the host issued ResNet's basic block's first
    convolution 0.42 ms into the call behind three such adds (bench/profile_backend.py --timeline, 263a239)."""
    anchor = call
    for n in list(gm.graph.nodes):  # (a copy: nodes move)
        if n is call:
            break
        name = _name(n)
        if (n.op in ("call_method", "call_function") and name in _BOOKKEEPING
                and not n.users and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
                and list(n.args[0].users) == [n]  # (nothing else in the graph reads what it updates)
                and all(a.op in ("placeholder", "get_attr") for a in n.all_input_nodes)):
            anchor.append(n)
            anchor = n


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    """Put the calls of the partition that ``call`` runs (a submodule of ``gm``) back in ``gm``'s graph: a partition
    that stays eager costs no submodule call (KernelBench level 3 #46-49, whose partitions all stay eager, on the
    H200: 0.90-0.93x eager inside submodule calls, 0.92-0.97x without)."""
    sub = gm.get_submodule(call.target)
    places = [n for n in sub.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_before(call):
        out = gm.graph.graph_copy(sub.graph, dict(zip(places, call.args)))
    if isinstance(out, (tuple, list)):  # several outputs: each getitem of the call is its value
        for user in list(call.users):
            assert user.op == "call_function" and user.target is operator.getitem, user
            user.replace_all_uses_with(out[user.args[1]])
            gm.graph.erase_node(user)
    else:
        call.replace_all_uses_with(out)
    gm.graph.erase_node(call)
    gm.delete_submodule(call.target)


def _calls_text(names: list) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} calls)" if len(names) > 6 else "")


def _build_together(module_dirs: list, failures: dict, verbose: bool) -> None:
    """Build the partitions' modules at once; each one that fails is recorded in ``failures`` (its folder ->
    the error's first line), the others still built. Anything else that breaks here leaves each module to be
    built as it loads, where its partition's own error is caught."""
    from .build import build_modules

    if module_dirs:
        try:
            build_modules(list(dict.fromkeys(module_dirs)), failures=failures, quiet=not verbose)
        except Exception:  # noqa: BLE001 - see above
            pass


_seed_dynamic_batches()
