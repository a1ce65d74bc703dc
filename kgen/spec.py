"""Load a spec file and check its syntax: keys, types, ranges.

Meaning (shapes, broadcasting, reduction dims) is checked by ``kgen.ir`` when
it builds the pipeline; both raise ``SpecError`` naming the file and the key
path, so every problem in a spec reads the same way:

    specs/foo.yaml: ops[2].max_pool3d.kernel_size: expected a positive integer ...

Nothing from a spec reaches generated code except identifiers that match
``[a-z][a-z0-9_]*`` and numbers that passed the checks (``kgen.fields``). The
fields of each op and their defaults come from the op table (``kgen.ops``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError
from .fields import REQUIRED, boolean, fail, ident, integer, is_int
from .ops import OPS

SYMBOL = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
PRECISIONS = ("ieee", "tf32", "tf32x3")
DTYPES = ("float32",)
PARAM_INITS = ("randn", "ones", "zeros")
CONV_LAYOUTS = ("auto", "channels_last", "contiguous")
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


TOP_KEYS = {"name", "description", "input", "params", "ops", "precision", "rewrites", "plan"}


def _mapping(v, key, path, what="a mapping"):
    if not isinstance(v, dict):
        fail(path, key, f"expected {what}, got {type(v).__name__}")
    return v


def _shown(k) -> str:
    """A key as it appears in a key path: plain names as they are, anything else quoted."""
    return k if isinstance(k, str) and SYMBOL.match(k) else repr(k)


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
        fail(path, key, f"unknown op {kind!r}; known ops: {', '.join(sorted(OPS))}")
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
        fail(path, "input.shape", f"expected a list of 3 to 5 sizes [batch, channels, spatial...], got {shape!r}")
    clean = []
    for d, v in enumerate(shape):
        k = f"input.shape[{d}]"
        if d == 0 and isinstance(v, str):
            if not SYMBOL.match(v):
                fail(path, k, f"expected a positive integer or a symbol name like N, got {v!r}")
            clean.append(v)
        elif isinstance(v, str):
            fail(path, k, "only the batch dimension (position 0) may be a run-time symbol")
        else:
            clean.append(integer(1)(v, k, path))
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        fail(path, "input.dtype", f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
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
        if not isinstance(shape, list) or not shape or not all(is_int(v) and v >= 1 for v in shape):
            fail(path, f"{key}.shape", f"expected a non-empty list of positive integers, got {shape!r}")
        init = p.get("init", "randn")
        if init not in PARAM_INITS:
            fail(path, f"{key}.init", f"expected one of {', '.join(PARAM_INITS)}, got {init!r}")
        params[name] = ParamSpec(name, tuple(shape), init, key)
    return params


def _load_rewrites(raw, path):
    if raw is None or isinstance(raw, bool):
        on = True if raw is None else raw
        return {n: on for n in REWRITE_NAMES}
    _mapping(raw, "rewrites", path, "true, false, or a mapping of rewrite name to true/false")
    _no_extra(raw, REWRITE_NAMES, "rewrites", path)
    return {n: boolean(raw.get(n, True), f"rewrites.{n}", path) for n in REWRITE_NAMES}


def load_spec(path: str | Path) -> Spec:
    """Read and check ``path``; raises SpecError naming the file and key on any problem."""
    path = Path(path)
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(shown, "", f"cannot read spec: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(shown, "", f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    return parse_spec(text, shown)


def parse_spec(text: str, path: str = "<spec>") -> Spec:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(path, "", f"not valid YAML: {problem}{where}") from None
    _mapping(raw, "", path, "a mapping at the top level")
    _no_extra(raw, TOP_KEYS, "", path)
    for k in ("name", "input", "ops"):
        if k not in raw:
            fail(path, k, "missing required field")
    name = ident(raw["name"], "name", path)
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
    if precision not in PRECISIONS:
        fail(path, "precision", f"expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    plan = _mapping(raw.get("plan", {}) or {}, "plan", path)
    _no_extra(plan, {"conv_layout"}, "plan", path)
    conv_layout = plan.get("conv_layout", "auto")
    if conv_layout not in CONV_LAYOUTS:
        fail(path, "plan.conv_layout", f"expected one of {', '.join(CONV_LAYOUTS)}, got {conv_layout!r}")
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
