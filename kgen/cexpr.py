"""Small C/C++ (and Python) expression builders the templates use.

Everything here turns plan data into text: literals, coordinate names, index
arithmetic, and an elementwise op's call of its ``kgen_math.h`` function as
the op table (``kgen.ops``) names it. No decisions are made here: schedules
come from the plan, and loops are written in the templates.
"""
from __future__ import annotations

import math

from .buffer import Buffer
from .ir import Capture, Elementwise, TensorArg, TensorType
from .ops import OPS


def cfloat(x: float) -> str:
    """A float32 C literal that reads back as the same value."""
    x = float(x)
    if math.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    text = repr(x)
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def braces(values) -> str:
    """A C++ braced list: (1, 2) -> {1, 2}."""
    return "{" + ", ".join(str(v) for v in values) + "}"


def pytuple(values) -> str:
    """A Python tuple literal (a one-element tuple keeps its comma)."""
    values = list(values)
    return "(" + ", ".join(repr(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def pykwargs(kwargs) -> str:
    """Keyword arguments as Python source: ((a, 1), (b, (2, 2))) -> a=1, b=(2, 2)."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs)


def dim_names(rank: int) -> list[str]:
    """Coordinate names of a sample's dims (C, *S)."""
    return ["c"] + [f"d{i}" for i in range(rank - 1)]


def decl(names: list[str]) -> str:
    """Function parameters for coordinates: int c, int d0, ..."""
    return ", ".join(f"int {n}" for n in names)


def named_dims(dims, t: TensorType) -> list[tuple[str, int]]:
    """(coordinate name, size) of dims (indices into t's shape, 1 = channels)."""
    names = dim_names(t.rank - 1)
    return [(names[d - 1], t.shape[d]) for d in dims]


def unravel(var: str, dims: list[tuple[str, int]], tmp: str, ty: str = "Index") -> str:
    """C statements that split the row-major index ``var`` into ``dims`` (outermost first)."""
    if not dims:
        return f"(void)({var});"
    lines = [f"{ty} {tmp} = {var};"]
    for i, (name, size) in enumerate(reversed(dims)):  # (a coordinate the ops after it need not read: maybe_unused)
        if size == 1:
            lines.append(f"[[maybe_unused]] const int {name} = 0;")
        elif i == len(dims) - 1:
            lines.append(f"[[maybe_unused]] const int {name} = static_cast<int>({tmp});")
        else:
            lines.append(f"[[maybe_unused]] const int {name} = static_cast<int>({tmp} % {size}); {tmp} /= {size};")
    return "\n".join(lines)


def ravel(dims: list[tuple[str, int]]) -> str:
    """C expression of the row-major index of the named coordinates ``dims`` (outermost first): unravel's inverse."""
    terms, stride = [], 1
    for name, size in reversed(dims):
        if size != 1:
            terms.append(name if stride == 1 else f"{name} * {stride}")
        stride *= size
    return " + ".join(reversed(terms)) or "0"


def reduced_coords(reduce, t: TensorType, names: list[str]) -> list[str]:
    """Coordinates of a reduction's output dims, in terms of the kept input dims."""
    out = []
    for d in range(1, t.rank):
        if reduce is not None and d in reduce.dims:
            if d in reduce.kept:
                out.append("0")
        else:
            out.append(names[d - 1])
    return out


def param_index(shape: tuple[int, ...], act: TensorType, coords: list[str]) -> str:
    """Flat index of a parameter of ``shape``, broadcast to ``act``, at ``coords``."""
    aligned = (1,) * (act.rank - len(shape)) + tuple(shape)
    terms, stride = [], 1
    for d in range(act.rank - 1, 0, -1):
        if aligned[d] != 1:
            terms.append(coords[d - 1] if stride == 1 else f"{coords[d - 1]} * {stride}")
        stride *= aligned[d]
    return " + ".join(reversed(terms)) or "0"


def register(name: str) -> str:
    """The C local holding value ``name`` inside a stage function."""
    return f"val_{name}"


def view_index(buf: Buffer, shape: tuple[int, ...], act: TensorType, coords: list[str]) -> str:
    """Offset of a value of (C, *S) ``shape`` held in the view ``buf`` (one tile, any strides), broadcast to ``act``
    as a parameter is, at ``coords``: its dims of size 1 are not stepped."""
    tile = buf.tiles[0]
    lead = act.rank - 1 - len(shape)
    terms = [f"n * {tile.sample_stride}LL"]
    for d, (size, stride) in enumerate(zip(shape, tile.strides)):
        if size != 1 and stride:
            terms.append(coords[lead + d] if stride == 1 else f"{coords[lead + d]} * {stride}")
    return " + ".join(terms)


def elementwise(op: Elementwise, act: TensorType, coords: list[str], tensors: dict[str, TensorArg],
                values: dict[str, TensorType] | None = None, views: dict | None = None) -> str:
    """C statement applying ``op`` to the float ``v`` through its kgen_math.h function;
    ``coords`` index act's dims 1.., ``tensors`` are the plan's parameters by name,
    ``values`` the pipeline's values (inputs, named results) by name. A named result
    (``as``) is kept in a local; a value operand is read from it or from its tensor
    (batch ``n``, broadcast like a parameter), through its strides where it is a view
    read in place (``views``: Plan.view_values)."""
    if isinstance(op, Capture):
        return f"const float {register(op.name)} = v; (void){register(op.name)};"
    entry = OPS[op.fn]
    args = ["v"] + [cfloat(default if value is None else value) for value, (_, default) in zip(op.consts, entry.consts)]
    if entry.operand:
        if op.tensor is not None:
            if op.register:
                args.append(register(op.tensor))
            else:
                vt = values[op.tensor]
                if views and op.tensor in views:
                    args.append(f"a.{op.tensor}[{view_index(views[op.tensor], tuple(vt.shape[1:]), act, coords)}]")
                else:
                    index = param_index(tuple(vt.shape[1:]), act, coords)
                    args.append(f"a.{op.tensor}[n * {vt.sample_numel}LL + {index}]")
        elif op.param is None:
            args.append(cfloat(op.scalar))
        elif op.param_sum_dims:  # reduction algebra: the parameter summed (it varies only there)
            scale = f" * {cfloat(op.param_sum_scale)}" if op.param_sum_scale != 1 else ""
            args.append(f"sum_of_{tensors[op.param].ident}(a){scale}")
        else:
            t = tensors[op.param]
            args.append(f"a.{t.ident}[{param_index(op.param_view or t.shape, act, coords)}]")
        if op.reverse:
            args[0], args[1] = args[1], args[0]
    statement = f"v = {entry.c_fn}({', '.join(args)});"
    if op.cuda_only:  # the CPU build's ATen call computed it (Elementwise.cuda_only)
        return f"#ifdef __CUDA_ARCH__  // CUDA only: on the CPU, ATen's call added it\n  {statement}\n#endif"
    return statement


# A parameter of at least this many values that enters summed is summed once per call by the binding
# (ATen), not by every thread that needs it (KernelBench #51's 8192 values: 191 us a call in the stage)
HOST_SUM_MIN = 64


def summed_params(ops, tensors: dict[str, TensorArg]) -> list[tuple[str, int, bool]]:
    """(ident, numel, summed by the binding) of parameters that enter summed (reduction algebra)."""
    out = []
    for op in ops:
        if isinstance(op, Elementwise) and op.param_sum_dims:
            t = tensors[op.param]
            numel = math.prod(t.shape)
            item = (t.ident, numel, numel >= HOST_SUM_MIN)
            if item not in out:
                out.append(item)
    return out


def tile_address(buf: Buffer, t: int, coords: list[str]) -> str:
    """Element offset of logical ``coords`` in tile ``t`` (phased: coords are phase-local m; "0": left out)."""
    tile = buf.tiles[t]
    terms = [f"n * {tile.sample_stride}LL"]
    for d, (name, stride) in enumerate(zip(coords, tile.strides)):
        off = tile.offset[d - 1] if d > 0 else 0
        pos = f"({name} + {off})" if off else name
        if tile.dims[d] > 1 and stride and pos != "0":  # (stride 0: a broadcast dim)
            terms.append(pos if stride == 1 else f"{pos} * {stride}")
    return " + ".join(terms)


def phase_coords(names: list[str]) -> list[str]:
    """Coordinates within a sub-pixel phase tile: the channel, then m0, m1, ..."""
    return [names[0]] + [f"m{i}" for i in range(len(names) - 1)]


def phase_index(buf: Buffer) -> str:
    """The phase (tile) index of residues r0, r1, ... (row-major over the phase strides)."""
    expr = "r0"
    for d in range(1, len(buf.phase_stride)):
        expr = f"({expr}) * {buf.phase_stride[d]} + r{d}" if d > 1 else f"r0 * {buf.phase_stride[d]} + r{d}"
    return expr


def shape_expr(t: TensorType) -> str:
    """A C++ shape of ``t`` with the run-time ``batch``."""
    return braces(["batch"] + list(t.shape[1:]))


def check_dims(t: TensorType) -> str:
    """The shape an argument check expects: kgen::kAnySize for the run-time batch."""
    return braces(["kgen::kAnySize" if isinstance(d, str) else d for d in t.shape])


FUNCTIONS = dict(
    braces=braces, cfloat=cfloat, decl=decl, dim_names=dim_names, named_dims=named_dims, phase_coords=phase_coords,
    phase_index=phase_index, pykwargs=pykwargs, pytuple=pytuple, reduced_coords=reduced_coords, shape_expr=shape_expr,
    check_dims=check_dims, tile_address=tile_address, unravel=unravel, ravel=ravel,
)
