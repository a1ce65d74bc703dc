"""Load a spec file and check its syntax: keys, types, ranges.

Meaning (shapes, broadcasting, reduction dims) is checked by ``kgen.ir`` when
it builds the pipeline; both raise ``SpecError`` naming the file and the key
path, so every problem in a spec reads the same way:

    specs/foo.yaml: ops[2].max_pool3d.kernel_size: expected a positive integer ...

Nothing from a spec reaches generated code except identifiers that match
``[a-z][a-z0-9_]*`` (and are not reserved, see ``reserved_reason``) and
numbers that passed the checks below. Sizes are bounded here; element counts
of the tensors a pipeline makes are bounded by ``kgen.ir`` (``max_elements``).

A spec file is read defensively: regular files of at most ``MAX_FILE_BYTES``,
YAML with duplicate keys refused and nesting and alias expansion limited, and
error messages show only a short prefix of any value.
"""
from __future__ import annotations

import functools
import keyword
import math
import os
import re
import reprlib
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .errors import KgenError, SpecError

IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")
SYMBOL = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
PRECISIONS = ("ieee", "tf32", "tf32x3")
DTYPES = ("float32",)
PARAM_INITS = ("randn", "ones", "zeros")
CONV_LAYOUTS = ("auto", "channels_last", "contiguous")
MAX_NAME = 64  # characters of a name (module, parameter, submodule, symbol)
MAX_SIZE = 2**31 - 1  # any one size, stride, padding...: kernels index single dims with 32-bit ints
FLOAT32_MAX = 3.4028234663852886e38
DEFAULT_MAX_ELEMENTS = 2**34  # per sample of an activation, per parameter tensor (KGEN_MAX_ELEMENTS)
MAX_FILE_BYTES = 1 << 20
MAX_YAML_DEPTH = 32  # nested collections
MAX_YAML_NODES = 100_000  # nodes once aliases are expanded (a billion-laughs file has 10^9)
MAX_SHOWN = 80  # characters of a value an error message shows

# Kept in step with kgen.rewrites.REWRITES (a test checks it); listed here so
# that loading a spec does not import the rewrite machinery.
REWRITE_NAMES = (
    "scalar_through_max",
    "pool_composition",
    "avg_pool_folding",
    "subpixel_conv_transpose",
    "dead_region",
    "reduction_algebra",
)


@dataclass(frozen=True)
class OpSpec:
    kind: str  # e.g. "max_pool3d"
    args: dict[str, Any]  # every field of the kind, defaults filled in
    key: str  # key path of the op's fields, e.g. "ops[2].max_pool3d"
    index: int


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str
    key: str


@dataclass(frozen=True)
class Spec:
    path: str
    name: str
    description: str
    input_shape: tuple  # ints, or a symbol string in position 0
    dtype: str
    example: dict[str, int]  # values of run-time symbols for bench / the main job
    params: dict[str, ParamSpec]
    ops: tuple[OpSpec, ...]
    precision: str
    rewrites: dict[str, bool] = field(default_factory=dict)  # name -> enabled
    conv_layout: str = "auto"

    def error(self, key: str, message: str) -> SpecError:
        return SpecError(self.path, key, message)


def max_elements() -> int:
    """The cap on elements per sample of an activation and per parameter tensor."""
    raw = os.environ.get("KGEN_MAX_ELEMENTS")
    if raw is None:
        return DEFAULT_MAX_ELEMENTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KgenError(f"KGEN_MAX_ELEMENTS must be a positive integer, got {_show(raw)}")
    return value


_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlong, _repr.maxlevel = MAX_SHOWN, MAX_SHOWN, 40, 3


def _show(v) -> str:
    """A value as an error message quotes it: its repr, cut to a short prefix."""
    text = _repr.repr(v)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


# Names a spec may not use for its parameters or submodules: each becomes a
# Python identifier (attribute, argument) and a C++ one (argument, struct
# member), next to the names the generated code uses itself. The module's own
# name has fewer rules (module_name_reason).
CPP_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t
    class compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
    decltype default delete do double dynamic_cast else enum explicit export extern false float for friend
    goto if import inline int long module mutable namespace new noexcept not not_eq nullptr operator or
    or_eq private protected public register reinterpret_cast requires return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try typedef typeid
    typename union unsigned using virtual void volatile wchar_t while xor xor_eq final override
""".split())
CPP_MACROS_AND_TYPES = frozenset("""
    assert errno offsetof setjmp va_arg va_start va_end linux unix major minor
    int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t size_t ptrdiff_t intptr_t uintptr_t
    half dim3 std at c10 kgen torch cuda
""".split())
# Locals, arguments and struct members of the generated binding and module
# (a parameter named `x` or `torch` would shadow them).
GENERATED_NAMES = frozenset("x self torch forward in out like guard batch a partial stats splits".split())
GENERATED_PATTERN = re.compile(
    r"(t|x|w|s|stage|level)[0-9]+\Z"  # per-stage locals and namespaces of the binding
    r"|.*_c\Z"  # the binding's contiguous copy of parameter P is P_c
    r"|(u?(char|short|int|long|longlong)|float|double)[1-4]\Z"  # CUDA vector types
)
# kgen's own ops (NAME_stageK), variants (NAME_norewrite), and `name`, an
# attribute of torch.ops.kgen (no op can be reached under it)
OWN_OPS_PATTERN = re.compile(r"name\Z|.*_(stage[0-9]+|norewrite)\Z")


@functools.lru_cache(maxsize=None)
def _module_attributes() -> frozenset:
    import torch

    return frozenset(n for n in dir(torch.nn.Module()) if not n.startswith("_"))


def module_name_reason(name: str) -> str | None:
    """Why ``name`` cannot name a generated module (package entry, op kgen::NAME); None if it can."""
    if keyword.iskeyword(name):
        return "a Python keyword"
    if name in CPP_KEYWORDS:
        return "a C++ keyword"
    if OWN_OPS_PATTERN.match(name):
        return "a name kgen's own ops use"
    return None


def reserved_reason(name: str) -> str | None:
    """Why ``name`` cannot name a parameter or submodule; None if it can."""
    reason = module_name_reason(name)
    if reason:
        return reason
    if name in CPP_MACROS_AND_TYPES:
        return "a C/C++/CUDA name the generated code sees"
    if name in _module_attributes():
        return "an attribute of torch.nn.Module"
    if name in GENERATED_NAMES or GENERATED_PATTERN.match(name):
        return "a name the generated code uses"
    return None


# --------------------------------------------------------------------------
# field checkers: each takes (value, key, path) and returns the clean value


class _Req:
    """Marks a field without default."""


REQUIRED = _Req()


def _fail(path, key, msg):
    raise SpecError(path, key, msg)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _size_ok(v, lo: int) -> bool:
    return _is_int(v) and lo <= v <= MAX_SIZE


def _int(lo: int) -> Callable:
    what = "a positive integer" if lo == 1 else "a non-negative integer"

    def check(v, key, path):
        if not _size_ok(v, lo):
            too_big = " (at most 2**31 - 1)" if _is_int(v) and v > MAX_SIZE else ""
            _fail(path, key, f"expected {what}{too_big}, got {_show(v)}")
        return v

    return check


def _ints(rank: int, lo: int) -> Callable:
    """An int, or a list of ``rank`` ints, each in [lo, 2**31 - 1]; returns a tuple of length rank."""
    what = "positive" if lo == 1 else "non-negative"

    def check(v, key, path):
        if _size_ok(v, lo):
            return (v,) * rank
        if isinstance(v, list) and len(v) == rank and all(_size_ok(e, lo) for e in v):
            return tuple(v)
        _fail(path, key, f"expected a {what} integer or a list of {rank} {what} integers, each at most 2**31 - 1, got {_show(v)}")

    return check


def _optional(check: Callable) -> Callable:
    return lambda v, key, path: None if v is None else check(v, key, path)


def _bool(v, key, path):
    if not isinstance(v, bool):
        _fail(path, key, f"expected true or false, got {_show(v)}")
    return v


def _number(v, key, path):
    """A number the kernels can use: finite in float32 (compared exactly, so 10**400 is refused, not an overflow)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        _fail(path, key, f"expected a finite number, got {_show(v)}")
    if abs(v) > FLOAT32_MAX:
        _fail(path, key, f"{_show(v)} is not finite in float32 (largest: 3.4028235e38)")
    v = float(v)
    if v != 0 and abs(v) <= 2.0**-150:  # half the smallest float32 or less: it would become 0
        _fail(path, key, f"{_show(v)} rounds to 0 in float32")
    return v


def _ident(v, key, path, reserved=None):
    """A parameter or submodule name (or, with ``reserved=module_name_reason``, the module's)."""
    if not isinstance(v, str) or not IDENT.match(v):
        _fail(path, key, f"expected an identifier matching [a-z][a-z0-9_]*, got {_show(v)}")
    if len(v) > MAX_NAME:
        _fail(path, key, f"name is {len(v)} characters long; at most {MAX_NAME} are allowed")
    reason = (reserved or reserved_reason)(v)
    if reason:
        _fail(path, key, f"'{v}' is {reason}; choose another name")
    return v


def _dims(v, key, path):
    if _is_int(v) and abs(v) <= MAX_SIZE:
        return (v,)
    if isinstance(v, list) and 0 < len(v) <= 5 and all(_is_int(e) and abs(e) <= MAX_SIZE for e in v):
        if len(set(v)) != len(v):
            _fail(path, key, f"repeated dimension in {_show(v)}")
        return tuple(v)
    _fail(path, key, f"expected a dimension index or a non-empty list of at most 5 of them, got {_show(v)}")


def _ones(rank: int) -> Callable:
    def check(v, key, path):
        if (_is_int(v) and v == 1) or (isinstance(v, list) and len(v) == rank and all(_is_int(e) and e == 1 for e in v)):
            return (1,) * rank
        _fail(path, key, f"only global pooling (output_size 1) is supported, got {_show(v)}")

    return check


# --------------------------------------------------------------------------
# the op catalog: kind -> {field: (checker, default)}


def _conv_fields(rank: int, transposed: bool) -> dict:
    f = {
        "out_channels": (_int(1), REQUIRED),
        "kernel_size": (_ints(rank, 1), REQUIRED),
        "stride": (_ints(rank, 1), 1),
        "padding": (_ints(rank, 0), 0),
        "dilation": (_ints(rank, 1), 1),
        "groups": (_int(1), 1),
        "bias": (_bool, True),
        "name": (_optional(_ident), None),
    }
    if transposed:
        f["output_padding"] = (_ints(rank, 0), 0)
    return f


def _pool_fields(rank: int, kind: str) -> dict:
    f = {
        "kernel_size": (_ints(rank, 1), REQUIRED),
        "stride": (_optional(_ints(rank, 1)), None),  # None: the kernel size
        "padding": (_ints(rank, 0), 0),
        "ceil_mode": (_bool, False),
    }
    if kind == "max":
        f["dilation"] = (_ints(rank, 1), 1)
    else:
        f["count_include_pad"] = (_bool, True)
    return f


def _binary_fields() -> dict:
    return {"scalar": (_optional(_number), None), "param": (_optional(_ident), None)}


OP_FIELDS: dict[str, dict] = {}
for _r in (1, 2, 3):
    OP_FIELDS[f"conv{_r}d"] = _conv_fields(_r, False)
    OP_FIELDS[f"conv_transpose{_r}d"] = _conv_fields(_r, True)
    OP_FIELDS[f"max_pool{_r}d"] = _pool_fields(_r, "max")
    OP_FIELDS[f"avg_pool{_r}d"] = _pool_fields(_r, "avg")
    OP_FIELDS[f"adaptive_avg_pool{_r}d"] = {"output_size": (_ones(_r), REQUIRED)}
OP_FIELDS.update(
    {
        "relu": {},
        "sigmoid": {},
        "clamp": {"min": (_optional(_number), None), "max": (_optional(_number), None)},
        "add": _binary_fields(),
        "sub": _binary_fields(),
        "mul": _binary_fields(),
        "div": _binary_fields(),
        "sum": {"dim": (_dims, REQUIRED), "keepdim": (_bool, False)},
        "mean": {"dim": (_dims, REQUIRED), "keepdim": (_bool, False)},
        "max": {"dim": (_dims, REQUIRED), "keepdim": (_bool, False)},
        "group_norm": {
            "num_groups": (_int(1), REQUIRED),
            "eps": (_number, 1e-5),
            "affine": (_bool, True),
            "name": (_optional(_ident), None),
        },
        "instance_norm": {
            "eps": (_number, 1e-5),
            "affine": (_bool, False),
            "track_running_stats": (_bool, False),
            "name": (_optional(_ident), None),
        },
    }
)

TOP_KEYS = {"name", "description", "input", "params", "ops", "precision", "rewrites", "plan"}


def _mapping(v, key, path, what="a mapping"):
    if not isinstance(v, dict):
        _fail(path, key, f"expected {what}, got {type(v).__name__}")
    return v


def _shown(k) -> str:
    """A key as it appears in a key path: plain names as they are, anything else quoted."""
    return k if isinstance(k, str) and SYMBOL.match(k) and len(k) <= MAX_NAME else _show(k)


def _no_extra(d: dict, allowed, key, path):
    for k in d:
        if k not in allowed:
            sub = f"{key}.{_shown(k)}" if key else _shown(k)
            _fail(path, sub, f"unknown key; expected one of: {', '.join(sorted(allowed))}")


def _fields(raw: dict, schema: dict, key: str, path: str) -> dict:
    _no_extra(raw, schema, key, path)
    out = {}
    for name, (check, default) in schema.items():
        if name in raw:
            out[name] = check(raw[name], f"{key}.{name}", path)
        elif default is REQUIRED:
            _fail(path, f"{key}.{name}", "missing required field")
        else:  # defaults go through the checker too, so 1 becomes (1, 1, 1)
            out[name] = None if default is None else check(default, f"{key}.{name}", path)
    return out


def _check_op_args(kind: str, args: dict, key: str, path: str):
    """Cross-field rules that a single field checker cannot see."""
    if kind in ("add", "sub", "mul", "div"):
        if (args["scalar"] is None) == (args["param"] is None):
            _fail(path, key, "give exactly one of 'scalar' or 'param'")
        if kind == "div" and args["scalar"] == 0.0:
            _fail(path, f"{key}.scalar", "division by zero")
    if kind == "clamp" and args["min"] is None and args["max"] is None:
        _fail(path, key, "give at least one of 'min' or 'max'")
    if kind == "clamp" and None not in (args["min"], args["max"]) and args["min"] > args["max"]:
        _fail(path, key, f"min ({args['min']}) is larger than max ({args['max']})")
    if kind == "instance_norm" and args["track_running_stats"]:
        _fail(path, f"{key}.track_running_stats", "running statistics are not supported; use false")


def _load_op(raw, i: int, path: str) -> OpSpec:
    key = f"ops[{i}]"
    if isinstance(raw, str):
        raw = {raw: None}
    if not isinstance(raw, dict) or len(raw) != 1:
        _fail(path, key, "each op is a mapping with exactly one key, the op name (e.g. '- max_pool3d: {kernel_size: 2}')")
    (kind, fields), = raw.items()
    if kind not in OP_FIELDS:
        _fail(path, key, f"unknown op {_show(kind)}; known ops: {', '.join(sorted(OP_FIELDS))}")
    key = f"{key}.{kind}"
    if fields is None:
        fields = {}
    _mapping(fields, key, path)
    args = _fields(fields, OP_FIELDS[kind], key, path)
    _check_op_args(kind, args, key, path)
    return OpSpec(kind, args, key, i)


def _load_input(raw, path):
    _mapping(raw, "input", path)
    _no_extra(raw, {"shape", "dtype", "example"}, "input", path)
    if "shape" not in raw:
        _fail(path, "input.shape", "missing required field")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) < 3 or len(shape) > 5:
        _fail(path, "input.shape", f"expected a list of 3 to 5 sizes [batch, channels, spatial...], got {_show(shape)}")
    clean = []
    for d, v in enumerate(shape):
        k = f"input.shape[{d}]"
        if d == 0 and isinstance(v, str):
            if not SYMBOL.match(v) or len(v) > MAX_NAME:
                _fail(path, k, f"expected a positive integer or a symbol name like N, got {_show(v)}")
            clean.append(v)
        elif isinstance(v, str):
            _fail(path, k, "only the batch dimension (position 0) may be a run-time symbol")
        else:
            clean.append(_int(1)(v, k, path))
    dtype = raw.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        _fail(path, "input.dtype", f"unsupported dtype {_show(dtype)}; supported: {', '.join(DTYPES)}")
    example = _mapping(raw.get("example", {}) or {}, "input.example", path)
    symbols = [v for v in clean if isinstance(v, str)]
    _no_extra(example, set(symbols), "input.example", path)
    example = {s: _int(1)(example.get(s, 1), f"input.example.{s}", path) for s in symbols}
    return tuple(clean), dtype, example


def _load_params(raw, path):
    params = {}
    for name, p in _mapping(raw or {}, "params", path).items():
        key = f"params.{name}"
        _ident(name, key, path)
        _mapping(p, key, path)
        _no_extra(p, {"shape", "init"}, key, path)
        shape = p.get("shape")
        if not isinstance(shape, list) or not 0 < len(shape) <= 5 or not all(_size_ok(v, 1) for v in shape):
            _fail(path, f"{key}.shape", f"expected a non-empty list of at most 5 positive integers, got {_show(shape)}")
        init = p.get("init", "randn")
        if not isinstance(init, str) or init not in PARAM_INITS:
            _fail(path, f"{key}.init", f"expected one of {', '.join(PARAM_INITS)}, got {_show(init)}")
        params[name] = ParamSpec(name, tuple(shape), init, key)
    return params


def _load_rewrites(raw, path):
    if raw is None or isinstance(raw, bool):
        on = True if raw is None else raw
        return {n: on for n in REWRITE_NAMES}
    _mapping(raw, "rewrites", path, "true, false, or a mapping of rewrite name to true/false")
    _no_extra(raw, REWRITE_NAMES, "rewrites", path)
    return {n: _bool(raw.get(n, True), f"rewrites.{n}", path) for n in REWRITE_NAMES}


# --------------------------------------------------------------------------
# reading the file: a regular file of bounded size, YAML with limits


class _YAMLLimit(yaml.YAMLError):
    def __init__(self, problem: str, mark):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounded nesting and alias use while composing
    (its composer recurses, and aliases let a small file stand for a huge value)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_NODES:
                raise _YAMLLimit(f"more than {MAX_YAML_NODES} aliases", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _YAMLLimit(f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# YAML 1.1 reads 1e-5 (no dot) as a string; take it as the number it looks like.
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+\Z"), list("-+0123456789")
)
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_yaml_tree(loader: _SpecLoader, root, path: str) -> None:
    """Refuse duplicate keys (naming the key path), recursive aliases, and documents
    that hold more than MAX_YAML_NODES nodes once aliases are expanded.

    Each node is visited once (aliases share nodes), so a billion-laughs file
    costs as much as its text; its expanded size is summed, not built.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def walk(node, where: str) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            _fail(path, where, "a YAML alias refers to a node that contains it")
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += walk(item, f"{where}[{i}]")
                if total > MAX_YAML_NODES:
                    break
        elif isinstance(node, yaml.MappingNode):
            seen = set()
            for knode, vnode in node.value:
                if knode.tag == _MERGE_TAG:
                    key, shown = None, "<<"
                elif isinstance(knode, yaml.ScalarNode):
                    key = loader.construct_object(knode)
                    shown = _shown(key)
                else:
                    key, shown = None, "?"
                sub = f"{where}.{shown}" if where else shown
                if key is not None:
                    try:
                        if key in seen:
                            _fail(path, sub, f"duplicate key (line {knode.start_mark.line + 1}); each key may appear once")
                        seen.add(key)
                    except TypeError:  # unhashable: the constructor reports it
                        pass
                total += 1 + walk(vnode, sub)
                if total > MAX_YAML_NODES:
                    break
        open_nodes.discard(id(node))
        if total > MAX_YAML_NODES:
            _fail(path, where, f"the YAML document expands to more than {MAX_YAML_NODES} values (aliases)")
        sizes[id(node)] = total
        return total

    walk(root, "")


def load_yaml(text: str, path: str = "<spec>"):
    """Parse ``text`` as YAML with the spec loader's limits; problems are SpecErrors."""
    loader = None
    try:
        loader = _SpecLoader(text)  # reads the text: it may refuse a character already
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_tree(loader, node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(path, "", f"not valid YAML: {problem}{where}") from None
    except ValueError:  # an integer with more digits than Python converts
        raise SpecError(path, "", "not valid YAML: a number with too many digits") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_spec_text(path: str | Path) -> str:
    """The text of a spec file: a regular file (a FIFO or device is refused without
    opening it), at most MAX_FILE_BYTES, UTF-8."""
    shown = str(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(shown, "", "not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise SpecError(shown, "", f"file is {info.st_size} bytes; a spec may have at most {MAX_FILE_BYTES}")
        # O_NONBLOCK: should the path have become a FIFO since the stat, opening does not wait.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise SpecError(shown, "", "not a regular file")
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SpecError(shown, "", f"cannot read spec: {e.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(shown, "", f"file is larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(shown, "", f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None


def load_spec(path: str | Path) -> Spec:
    """Read and check ``path``; raises SpecError naming the file and key on any problem."""
    return parse_spec(read_spec_text(path), str(path))


def parse_spec(text: str, path: str = "<spec>") -> Spec:
    return spec_from_data(load_yaml(text, path), path)


def spec_from_data(raw, path: str = "<spec>") -> Spec:
    """Check already-parsed spec data (what the YAML holds, or ``spec_to_data``'s output)."""
    _mapping(raw, "", path, "a mapping at the top level")
    _no_extra(raw, TOP_KEYS, "", path)
    for k in ("name", "input", "ops"):
        if k not in raw:
            _fail(path, k, "missing required field")
    name = _ident(raw["name"], "name", path, module_name_reason)
    description = raw.get("description", "")
    if not isinstance(description, str):
        _fail(path, "description", "expected a string")
    shape, dtype, example = _load_input(raw["input"], path)
    params = _load_params(raw.get("params"), path)
    ops_raw = raw["ops"]
    if not isinstance(ops_raw, list) or not ops_raw:
        _fail(path, "ops", "expected a non-empty list of ops")
    ops = tuple(_load_op(o, i, path) for i, o in enumerate(ops_raw))
    precision = raw.get("precision", "tf32")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        _fail(path, "precision", f"expected one of {', '.join(PRECISIONS)}, got {_show(precision)}")
    plan = _mapping(raw.get("plan", {}) or {}, "plan", path)
    _no_extra(plan, {"conv_layout"}, "plan", path)
    conv_layout = plan.get("conv_layout", "auto")
    if not isinstance(conv_layout, str) or conv_layout not in CONV_LAYOUTS:
        _fail(path, "plan.conv_layout", f"expected one of {', '.join(CONV_LAYOUTS)}, got {_show(conv_layout)}")
    return Spec(
        path=path,
        name=name,
        description=description.strip(),
        input_shape=shape,
        dtype=dtype,
        example=example,
        params=params,
        ops=ops,
        precision=precision,
        rewrites=_load_rewrites(raw.get("rewrites"), path),
        conv_layout=conv_layout,
    )


def spec_to_data(spec: Spec) -> dict:
    """The spec as plain data (dicts, lists, str, int, float, bool, None), every default
    filled in and the free-text description left out: ``spec_from_data`` gives the spec back.
    Generated modules embed it (every string in it is a checked identifier)."""

    def plain(v):
        return [plain(e) for e in v] if isinstance(v, (tuple, list)) else v

    return {
        "name": spec.name,
        "input": {"shape": list(spec.input_shape), "dtype": spec.dtype, "example": dict(spec.example)},
        "params": {n: {"shape": list(p.shape), "init": p.init} for n, p in spec.params.items()},
        "ops": [{o.kind: {k: plain(v) for k, v in o.args.items()}} for o in spec.ops],
        "precision": spec.precision,
        "rewrites": dict(spec.rewrites),
        "plan": {"conv_layout": spec.conv_layout},
    }
