"""Load a spec file and check its syntax: keys, types, ranges.

Meaning (shapes, broadcasting, reduction dims) is checked by ``kgen.ir`` when
it builds the pipeline; both raise ``SpecError`` naming the file and the key
path, so every problem in a spec reads the same way:

    specs/foo.yaml: ops[2].max_pool3d.kernel_size: expected a positive integer ...

Nothing from a spec reaches generated code except identifiers that match
``[a-z][a-z0-9_]*`` (and are not reserved, see ``kgen.names``) and numbers
that passed the checks (``kgen.fields``). The fields of each op and their
defaults come from the op table (``kgen.ops``). Sizes are bounded by the
field checkers; element counts of the tensors a pipeline makes are bounded by
``kgen.ir`` (``max_elements``).

A spec file is read defensively: regular files of at most ``MAX_FILE_BYTES``,
YAML with duplicate keys refused and nesting and alias expansion limited, and
error messages show only a short prefix of any value.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import KgenError, SpecError
from .fields import MAX_NAME, REQUIRED, boolean, fail, ident, integer, show, size_ok
from .names import module_name_reason
from .ops import OPS

SYMBOL = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
PRECISIONS = ("ieee", "tf32", "tf32x3")
DTYPES = ("float32",)
PARAM_INITS = ("randn", "ones", "zeros")
CONV_LAYOUTS = ("auto", "channels_last", "contiguous")
CONV_IMPLS = ("auto", "aten", "gemm")  # plan.conv: who computes a convolution (auto: the planner chooses)
DEFAULT_MAX_ELEMENTS = 2**34  # per sample of an activation, per parameter tensor (KGEN_MAX_ELEMENTS)
MAX_FILE_BYTES = 1 << 20
MAX_YAML_DEPTH = 32  # nested collections
MAX_YAML_NODES = 100_000  # nodes once aliases are expanded (a billion-laughs file has 10^9)

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
    conv_impl: str = "auto"

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
        raise KgenError(f"KGEN_MAX_ELEMENTS must be a positive integer, got {show(raw)}")
    return value


TOP_KEYS = {"name", "description", "input", "params", "ops", "precision", "rewrites", "plan"}


def _mapping(v, key, path, what="a mapping"):
    if not isinstance(v, dict):
        fail(path, key, f"expected {what}, got {type(v).__name__}")
    return v


def _shown(k) -> str:
    """A key as it appears in a key path: plain names as they are, anything else quoted."""
    return k if isinstance(k, str) and SYMBOL.match(k) and len(k) <= MAX_NAME else show(k)


def _no_extra(d: dict, allowed, key, path):
    for k in d:
        if k not in allowed:
            sub = f"{key}.{_shown(k)}" if key else _shown(k)
            fail(path, sub, f"unknown key; expected one of: {', '.join(sorted(allowed))}")


def _fields(raw: dict, schema: dict, key: str, path: str) -> dict:
    _no_extra(raw, schema, key, path)
    out = {}
    for name, (check, default) in schema.items():
        if name in raw:
            out[name] = check(raw[name], f"{key}.{name}", path)
        elif default is REQUIRED:
            fail(path, f"{key}.{name}", "missing required field")
        else:  # defaults go through the checker too, so 1 becomes (1, 1, 1)
            out[name] = None if default is None else check(default, f"{key}.{name}", path)
    return out


def _load_op(raw, i: int, path: str) -> OpSpec:
    key = f"ops[{i}]"
    if isinstance(raw, str):
        raw = {raw: None}
    if not isinstance(raw, dict) or len(raw) != 1:
        fail(path, key, "each op is a mapping with exactly one key, the op name (e.g. '- max_pool3d: {kernel_size: 2}')")
    (kind, fields), = raw.items()
    if kind not in OPS:
        fail(path, key, f"unknown op {show(kind)}; known ops: {', '.join(sorted(OPS))}")
    key = f"{key}.{kind}"
    if fields is None:
        fields = {}
    _mapping(fields, key, path)
    entry = OPS[kind]
    args = _fields(fields, entry.fields, key, path)
    if entry.check:
        entry.check(args, key, path)
    return OpSpec(kind, args, key, i)


def _load_input(raw, path):
    _mapping(raw, "input", path)
    _no_extra(raw, {"shape", "dtype", "example"}, "input", path)
    if "shape" not in raw:
        fail(path, "input.shape", "missing required field")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) < 3 or len(shape) > 5:
        fail(path, "input.shape", f"expected a list of 3 to 5 sizes [batch, channels, spatial...], got {show(shape)}")
    clean = []
    for d, v in enumerate(shape):
        k = f"input.shape[{d}]"
        if d == 0 and isinstance(v, str):
            if not SYMBOL.match(v) or len(v) > MAX_NAME:
                fail(path, k, f"expected a positive integer or a symbol name like N, got {show(v)}")
            clean.append(v)
        elif isinstance(v, str):
            fail(path, k, "only the batch dimension (position 0) may be a run-time symbol")
        else:
            clean.append(integer(1)(v, k, path))
    dtype = raw.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        fail(path, "input.dtype", f"unsupported dtype {show(dtype)}; supported: {', '.join(DTYPES)}")
    example = _mapping(raw.get("example", {}) or {}, "input.example", path)
    symbols = [v for v in clean if isinstance(v, str)]
    _no_extra(example, set(symbols), "input.example", path)
    example = {s: integer(1)(example.get(s, 1), f"input.example.{s}", path) for s in symbols}
    return tuple(clean), dtype, example


def _load_params(raw, path):
    params = {}
    for name, p in _mapping(raw or {}, "params", path).items():
        key = f"params.{name}"
        ident(name, key, path)
        _mapping(p, key, path)
        _no_extra(p, {"shape", "init"}, key, path)
        shape = p.get("shape")
        if not isinstance(shape, list) or not 0 < len(shape) <= 5 or not all(size_ok(v, 1) for v in shape):
            fail(path, f"{key}.shape", f"expected a non-empty list of at most 5 positive integers, got {show(shape)}")
        init = p.get("init", "randn")
        if not isinstance(init, str) or init not in PARAM_INITS:
            fail(path, f"{key}.init", f"expected one of {', '.join(PARAM_INITS)}, got {show(init)}")
        params[name] = ParamSpec(name, tuple(shape), init, key)
    return params


def _load_rewrites(raw, path):
    if raw is None or isinstance(raw, bool):
        on = True if raw is None else raw
        return {n: on for n in REWRITE_NAMES}
    _mapping(raw, "rewrites", path, "true, false, or a mapping of rewrite name to true/false")
    _no_extra(raw, REWRITE_NAMES, "rewrites", path)
    return {n: boolean(raw.get(n, True), f"rewrites.{n}", path) for n in REWRITE_NAMES}


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
            fail(path, where, "a YAML alias refers to a node that contains it")
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
                            fail(path, sub, f"duplicate key (line {knode.start_mark.line + 1}); each key may appear once")
                        seen.add(key)
                    except TypeError:  # unhashable: the constructor reports it
                        pass
                total += 1 + walk(vnode, sub)
                if total > MAX_YAML_NODES:
                    break
        open_nodes.discard(id(node))
        if total > MAX_YAML_NODES:
            fail(path, where, f"the YAML document expands to more than {MAX_YAML_NODES} values (aliases)")
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
            fail(path, k, "missing required field")
    name = ident(raw["name"], "name", path, module_name_reason)
    description = raw.get("description", "")
    if not isinstance(description, str):
        fail(path, "description", "expected a string")
    shape, dtype, example = _load_input(raw["input"], path)
    params = _load_params(raw.get("params"), path)
    ops_raw = raw["ops"]
    if not isinstance(ops_raw, list) or not ops_raw:
        fail(path, "ops", "expected a non-empty list of ops")
    ops = tuple(_load_op(o, i, path) for i, o in enumerate(ops_raw))
    precision = raw.get("precision", "tf32")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        fail(path, "precision", f"expected one of {', '.join(PRECISIONS)}, got {show(precision)}")
    plan = _mapping(raw.get("plan", {}) or {}, "plan", path)
    _no_extra(plan, {"conv_layout", "conv"}, "plan", path)
    conv_layout = plan.get("conv_layout", "auto")
    if not isinstance(conv_layout, str) or conv_layout not in CONV_LAYOUTS:
        fail(path, "plan.conv_layout", f"expected one of {', '.join(CONV_LAYOUTS)}, got {show(conv_layout)}")
    conv_impl = plan.get("conv", "auto")
    if not isinstance(conv_impl, str) or conv_impl not in CONV_IMPLS:
        fail(path, "plan.conv", f"expected one of {', '.join(CONV_IMPLS)}, got {show(conv_impl)}")
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
        conv_impl=conv_impl,
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
        "plan": {"conv_layout": spec.conv_layout, "conv": spec.conv_impl},
    }
