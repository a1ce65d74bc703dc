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

import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import KgenError, SpecError
from .fields import MAX_NAME, REQUIRED, boolean, fail, ident, integer, member_path, number, show, size_ok, value_name
from .names import module_name_reason
from .ops import INTERNAL, OPS, spec_op_names

SYMBOL = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
PRECISIONS = ("ieee", "tf32", "tf32x3")
# `intermediates:` "eager" keeps eager PyTorch's bits where a later op would amplify a difference: a 16-bit plan
# rounds each op's output to the dtype where eager materializes it (kgen.plan.rounding_points), and a float32
# plan runs a chain of training-mode batch norms as eager does (ir.Pipeline.eager_batch_norms); "float32" keeps
# float32 until each stage's output and kgen's own batch statistics
INTERMEDIATES = ("eager", "float32")
DTYPES = ("float32", "bfloat16", "float16")  # a spec's dtypes: the module dispatches on the input's
DEFAULT_DTYPES = ("float32",)
PARAM_INITS = ("randn", "ones", "zeros")
CONV_LAYOUTS = ("auto", "channels_last", "contiguous")
CONV_IMPLS = ("auto", "aten", "gemm")  # plan.conv: who computes a convolution (auto: the planner chooses)
LINEAR_IMPLS = ("auto", "aten", "gemm")  # plan.linear: who computes a matrix product (cuBLAS or linear_gemm)
# plan.conv_norm: a generated convolution before a norm writes its output for the norm stage,
# or computes itself twice with the norm as its epilogue, or once on co-resident CTAs per sample
# (auto: the planner chooses)
CONV_NORM_FORMS = ("auto", "written", "recompute", "onepass")
DEFAULT_MAX_ELEMENTS = 2**34  # per sample of an activation, per parameter tensor (KGEN_MAX_ELEMENTS)
MAX_FILE_BYTES = 1 << 20
MAX_YAML_DEPTH = 32  # nested collections
MAX_YAML_NODES = 100_000  # nodes once aliases are expanded (a billion-laughs file has 10^9)

# Kept in step with kgen.rewrites.REWRITES (a test checks it); listed here so
# that loading a spec does not import the rewrite machinery.
REWRITE_NAMES = (
    "dropout_of_zero",
    "softmax_through_reshape",
    "commute_operand_chain",
    "permute_before_elementwise",
    "scalar_through_max",
    "pool_composition",
    "batch_stats_pass",
    "affine_through_pooling",
    "sum_before_conv",
    "pool_into_linear",
    "avg_pool_folding",
    "subpixel_conv_transpose",
    "dead_region",
    "reduction_algebra",
    "batch_norm_eval_affine",  # eval mode's own plan (kgen.plan: not one of rewrites.REWRITES)
    "batch_norm_batch_stats",  # training mode's batch statistics stage (kgen.plan: not one of rewrites.REWRITES)
)


@dataclass(frozen=True)
class OpSpec:
    kind: str  # e.g. "max_pool3d"
    args: dict[str, Any]  # every field of the kind, defaults filled in
    key: str  # key path of the op's fields, e.g. "ops[2].max_pool3d"
    index: int
    name: str | None = None  # `as:` names the op's result (a value later ops may read)
    src: str | None = None  # `from:` the value the op reads (default: the previous op's result)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str | float  # randn | ones | zeros, or a number (torch.tensor(value) when the shape is [])
    key: str
    unused: bool = False  # created for the state_dict only (the reference model has it, forward does not read it)


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple  # ints, or a symbol string in position 0
    key: str


@dataclass(frozen=True)
class ArgSpec:
    """A constructor argument of the reference model: its name, the value compiled in, and
    its default in the reference's signature (``NO_DEFAULT`` when it has none)."""

    name: str
    value: Any  # None, a bool, int, float, or a (nested) tuple of them
    default: Any
    key: str


NO_DEFAULT = "<no default>"


@dataclass(frozen=True)
class InitSpec:
    """A re-initialization the original model's __init__ makes after creating its members
    (``nn.init.kaiming_normal_(m.weight, mode="fan_out")``): the state_dict name of the
    tensor, the ``torch.nn.init`` function and its keyword arguments; replayed in order."""

    member: str
    fn: str
    args: tuple  # ((name, value), ...): numbers and strings
    key: str


# torch.nn.init function -> the arguments a spec may give it (numbers, or strings where listed in INIT_CHOICES)
INIT_ARGS = {
    "kaiming_normal_": ("a", "mode", "nonlinearity"),
    "kaiming_uniform_": ("a", "mode", "nonlinearity"),
    "xavier_normal_": ("gain",),
    "xavier_uniform_": ("gain",),
    "normal_": ("mean", "std"),
    "uniform_": ("a", "b"),
    "trunc_normal_": ("mean", "std", "a", "b"),
    "constant_": ("val",),
    "zeros_": (),
    "ones_": (),
    "orthogonal_": ("gain",),
}
INIT_CHOICES = {
    "mode": ("fan_in", "fan_out"),
    "nonlinearity": ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                     "conv_transpose3d", "sigmoid", "tanh", "relu", "leaky_relu", "selu"),
}
MAX_INITS = 10000


@dataclass(frozen=True)
class Spec:
    path: str
    name: str
    description: str
    input_shape: tuple  # the first input's: ints, or a symbol string in position 0
    dtypes: tuple[str, ...]  # the dtypes the module is rendered for (every input and parameter has the input's)
    example: dict[str, int]  # values of run-time symbols for bench / the main job
    params: dict[str, ParamSpec]
    ops: tuple[OpSpec, ...]
    precision: str
    rewrites: dict[str, bool] = field(default_factory=dict)  # name -> enabled
    intermediates: str = "eager"  # INTERMEDIATES: a 16-bit plan's values between ops
    conv_layout: str = "auto"
    conv_impl: str = "auto"
    conv_norm: str = "auto"
    linear_impl: str = "auto"
    inputs: tuple[InputSpec, ...] = ()  # every input, the first one first (`input:` gives one named x)
    multi_input: bool = False  # written as `inputs:` (kept so the spec reads back the same way)
    constructor: tuple[ArgSpec, ...] | None = None  # the reference model's __init__ arguments
    members: tuple[str, ...] = ()  # submodules and parameters in the reference's creation order
    init: tuple[InitSpec, ...] = ()  # re-initializations after the members are created, in order
    source: str | None = None  # the model file it was imported from
    # `outputs:` the values the model returns, in order (names given with `as:`); () when not given: the last
    # op's result alone (kgen.ir checks the names against the values)
    outputs: tuple[str, ...] = ()

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


TOP_KEYS = {"name", "description", "input", "inputs", "example", "params", "ops", "outputs", "precision", "intermediates",
            "rewrites", "plan", "constructor"}
OP_KEYS = ("as", "from")  # keys any op may have besides its own fields
# The op kgen::NAME takes each input as one argument and the rest as at most 4 more (the parameters and the
# buffers as two lists, the mode, the update weights: render.op_arguments); PyTorch's dispatcher takes ops of at
# most 64 arguments (a longer schema aborts the process when the library loads). 60 inputs fill it exactly in the
# longest op (a 60-input spec with a batch norm: 64 arguments, built and validated on the CPU at 2d011ef) and cover
# DenseNet201 under torch.compile(backend="kgen"), whose largest partition reads 49 values.
DISPATCHER_MAX_ARGS = 64
MAX_RANK = 5  # dims of an input or a parameter: [batch, channels, up to 3 spatial]
MAX_INPUTS = 60
MAX_OUTPUTS = 16
MAX_ARGS = 64  # constructor arguments


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


def _choice(d: dict, name: str, choices, default: str, key: str, path) -> str:
    """d[name] (``default`` when absent): one of the strings ``choices``; ``key`` names it in errors."""
    v = d.get(name, default)
    if not isinstance(v, str) or v not in choices:
        fail(path, key, f"expected one of {', '.join(choices)}, got {show(v)}")
    return v


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
    if kind not in OPS or kind in INTERNAL:
        hint = " (name a value with `as: NAME` on the op that computes it)" if kind == "as" else ""
        fail(path, key, f"unknown op {show(kind)}{hint}; known ops: {', '.join(spec_op_names())}")
    key = f"{key}.{kind}"
    if fields is None:
        fields = {}
    _mapping(fields, key, path)
    entry = OPS[kind]
    extra = {k: value_name(fields[k], f"{key}.{k}", path) for k in OP_KEYS if k in fields}
    fields = {k: v for k, v in fields.items() if k not in OP_KEYS}
    try:
        args = _fields(fields, entry.fields, key, path)
    except SpecError as e:  # an unknown key also lists `as` and `from`
        if "unknown key" in e.message:
            fail(path, e.key, f"unknown key; expected one of: {', '.join(sorted(list(entry.fields) + list(OP_KEYS)))}")
        raise
    if entry.check:
        entry.check(args, key, path)
    return OpSpec(kind, args, key, i, extra.get("as"), extra.get("from"))


def _load_shape(raw, key, path):
    """An input's shape: [batch, features] or [batch, channels, spatial...] (2 to 5 sizes)."""
    _mapping(raw, key, path)
    if "shape" not in raw:
        fail(path, f"{key}.shape", "missing required field")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) < 2 or len(shape) > MAX_RANK:
        fail(path, f"{key}.shape", f"expected a list of 2 to {MAX_RANK} sizes [batch, channels, spatial...], got {show(shape)}")
    clean = []
    for d, v in enumerate(shape):
        k = f"{key}.shape[{d}]"
        if d == 0 and isinstance(v, str):
            if not SYMBOL.match(v) or len(v) > MAX_NAME:
                fail(path, k, f"expected a positive integer or a symbol name like N, got {show(v)}")
            clean.append(v)
        elif isinstance(v, str):
            fail(path, k, "only the batch dimension (position 0) may be a run-time symbol")
        else:
            clean.append(integer(1)(v, k, path))
    return tuple(clean), _load_dtypes(raw.get("dtype", "float32"), f"{key}.dtype", path)


def _load_dtypes(raw, key, path) -> tuple[str, ...]:
    """``dtype``: one of DTYPES or a list of them (each once); the module is rendered for each."""
    given = raw if isinstance(raw, list) else [raw]
    if not given:
        fail(path, key, f"expected a dtype or a non-empty list of them ({', '.join(DTYPES)})")
    for i, d in enumerate(given):
        k = f"{key}[{i}]" if isinstance(raw, list) else key
        if not isinstance(d, str) or d not in DTYPES:
            fail(path, k, f"unsupported dtype {show(d)}; supported: {', '.join(DTYPES)}")
        if d in given[:i]:
            fail(path, k, f"dtype {d} is listed twice")
    return tuple(given)


def dtypes_data(dtypes: tuple[str, ...]):
    """The ``dtype`` key's value as spec_to_data writes it: a single dtype as a string (so the
    data, and the spec hash, of a float32 spec stay what they were), several as a list."""
    return dtypes[0] if len(dtypes) == 1 else list(dtypes)


def _load_example(raw, symbols, key, path):
    example = _mapping(raw or {}, key, path)
    _no_extra(example, set(symbols), key, path)
    return {s: integer(1)(example.get(s, 1), f"{key}.{s}", path) for s in symbols}


def _load_input(raw, path):
    _mapping(raw, "input", path)
    _no_extra(raw, {"shape", "dtype", "example"}, "input", path)
    shape, dtypes = _load_shape(raw, "input", path)
    example = _load_example(raw.get("example"), [v for v in shape if isinstance(v, str)], "input.example", path)
    return (InputSpec("x", shape, "input"),), dtypes, example


def _load_inputs(raw, example_raw, path):
    """``inputs: {NAME: {shape, dtype}, ...}`` (the first is the one the ops start from) and ``example``."""
    _mapping(raw, "inputs", path)
    if not raw or len(raw) > MAX_INPUTS:
        fail(path, "inputs", f"expected 1 to {MAX_INPUTS} inputs, got {len(raw)}")
    inputs, batch, dtypes = [], None, None
    for name, spec in raw.items():
        key = f"inputs.{_shown(name)}"
        value_name(name, key, path)
        _mapping(spec, key, path)
        _no_extra(spec, {"shape", "dtype"}, key, path)
        shape, given = _load_shape(spec, key, path)
        if dtypes is not None and given != dtypes:  # one dtype (list) for the whole spec
            fail(path, f"{key}.dtype", f"every input has the dtype of the first ({dtypes_data(dtypes)}), got {dtypes_data(given)}")
        dtypes = given
        if batch is not None and shape[0] != batch:
            fail(path, f"{key}.shape[0]", f"every input has the batch of the first ({show(batch)}), got {show(shape[0])}")
        batch = shape[0]
        if name == "x" and inputs:
            fail(path, key, "only the first input may be named x")
        inputs.append(InputSpec(name, shape, key))
    example = _load_example(example_raw, [batch] if isinstance(batch, str) else [], "example", path)
    return tuple(inputs), dtypes, example


ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
RESERVED_ARGS = {"self", "torch", "super", "forward", "SPEC", "SPEC_DATA", "Model", "_check_init"}
SOURCE_PATH = re.compile(r"[A-Za-z0-9_./+-]{1,200}\Z")  # it is shown in generated code


def arg_value(v, key, path, depth=0):
    """A constructor argument's value: None, a bool, an int, a finite float, or a list of them
    (tuples are written as lists); returned with lists as tuples."""
    if v is None or isinstance(v, bool) or (isinstance(v, int) and abs(v) <= 2**63):
        return v
    if isinstance(v, float):
        import math

        if not math.isfinite(v):
            fail(path, key, f"expected a finite number, got {show(v)}")
        return v
    if isinstance(v, list) and depth < 3 and len(v) <= 16:
        return tuple(arg_value(e, f"{key}[{i}]", path, depth + 1) for i, e in enumerate(v))
    fail(path, key, f"expected null, a boolean, a number or a short list of them, got {show(v)}")


def _load_constructor(raw, path):
    _mapping(raw, "constructor", path)
    _no_extra(raw, {"source", "args", "members", "init"}, "constructor", path)
    source = raw.get("source")
    if source is not None and (not isinstance(source, str) or not SOURCE_PATH.match(source)):
        fail(path, "constructor.source", f"expected a file path of plain characters, got {show(source)}")
    args_raw = _mapping(raw.get("args") or {}, "constructor.args", path)
    if len(args_raw) > MAX_ARGS:
        fail(path, "constructor.args", f"at most {MAX_ARGS} arguments")
    args = []
    for name, v in args_raw.items():
        key = f"constructor.args.{_shown(name)}"
        import keyword

        if not isinstance(name, str) or not ARG_NAME.match(name) or len(name) > MAX_NAME or keyword.iskeyword(name) \
                or name in RESERVED_ARGS:
            fail(path, key, f"expected a Python argument name (not a keyword or one of {', '.join(sorted(RESERVED_ARGS))})")
        if isinstance(v, dict):
            _no_extra(v, {"value", "default"}, key, path)
            if "default" not in v:
                fail(path, f"{key}.default", "missing required field (a plain value has no default)")
            default = arg_value(v["default"], f"{key}.default", path)
            value = arg_value(v["value"], f"{key}.value", path) if "value" in v else default
        else:
            value, default = arg_value(v, key, path), NO_DEFAULT
        if default is NO_DEFAULT and any(a.default is not NO_DEFAULT for a in args):
            fail(path, key, "an argument without a default follows one with a default")
        args.append(ArgSpec(name, value, default, key))
    members = raw.get("members") or []
    if not isinstance(members, list) or len(members) > 1000:
        fail(path, "constructor.members", "expected a list of submodule and parameter names")
    members = tuple(member_path(m, f"constructor.members[{i}]", path) for i, m in enumerate(members))
    if len(set(members)) != len(members):
        fail(path, "constructor.members", "a name appears twice")
    return tuple(args), members, _load_init(raw.get("init"), members, path), source


def _load_init(raw, members, path) -> tuple[InitSpec, ...]:
    """``constructor.init``: [{member: features.0.weight, fn: kaiming_normal_, args: {mode: fan_out}}, ...];
    the member is a parameter or buffer of a listed submodule, or a listed parameter (build_pipeline
    checks that the submodule has it)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_INITS:
        fail(path, "constructor.init", f"expected a list of at most {MAX_INITS} re-initializations")
    out = []
    for i, entry in enumerate(raw):
        key = f"constructor.init[{i}]"
        _mapping(entry, key, path)
        _no_extra(entry, {"member", "fn", "args"}, key, path)
        for k in ("member", "fn"):
            if k not in entry:
                fail(path, f"{key}.{k}", "missing required field")
        member = member_path(entry["member"], f"{key}.member", path)
        owner = member.rpartition(".")[0]
        if members and member not in members and owner not in members:
            fail(path, f"{key}.member", f"'{member}' is neither a listed parameter nor a tensor of a submodule in "
                 "constructor.members")
        fn = entry["fn"]
        if fn not in INIT_ARGS:
            fail(path, f"{key}.fn", f"expected one of {', '.join(INIT_ARGS)}, got {show(fn)}")
        args = _mapping(entry.get("args") or {}, f"{key}.args", path)
        values = []
        for name, v in args.items():
            akey = f"{key}.args.{_shown(name)}"
            if name not in INIT_ARGS[fn]:
                fail(path, akey, f"{fn} takes {', '.join(INIT_ARGS[fn]) or 'no arguments'} here")
            if name in INIT_CHOICES:
                if v not in INIT_CHOICES[name]:
                    fail(path, akey, f"expected one of {', '.join(INIT_CHOICES[name])}, got {show(v)}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                fail(path, akey, f"expected a finite number, got {show(v)}")
            values.append((name, v))
        out.append(InitSpec(member, fn, tuple(values), key))
    return tuple(out)


def _load_params(raw, path):
    params = {}
    for name, p in _mapping(raw or {}, "params", path).items():
        key = f"params.{name}"
        member_path(name, key, path)
        _mapping(p, key, path)
        _no_extra(p, {"shape", "init", "unused"}, key, path)
        shape = p.get("shape")
        if not isinstance(shape, list) or not len(shape) <= MAX_RANK or not all(size_ok(v, 1) for v in shape):
            fail(path, f"{key}.shape", f"expected a list of at most {MAX_RANK} positive integers ([] for a scalar), got {show(shape)}")
        init = p.get("init", "randn")
        if isinstance(init, (int, float)) and not isinstance(init, bool):
            init = number(init, f"{key}.init", path)
        elif not isinstance(init, str) or init not in PARAM_INITS:
            fail(path, f"{key}.init", f"expected one of {', '.join(PARAM_INITS)} or a number, got {show(init)}")
        unused = boolean(p.get("unused", False), f"{key}.unused", path)
        params[name] = ParamSpec(name, tuple(shape), init, key, unused)
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
    for k in ("name", "ops"):
        if k not in raw:
            fail(path, k, "missing required field")
    if ("input" in raw) == ("inputs" in raw):
        fail(path, "input" if "inputs" not in raw else "inputs",
             "missing required field" if "inputs" not in raw else "give either 'input' or 'inputs', not both")
    name = ident(raw["name"], "name", path, module_name_reason)
    description = raw.get("description", "")
    if not isinstance(description, str):
        fail(path, "description", "expected a string")
    if "input" in raw:
        if "example" in raw:
            fail(path, "example", "with 'input', the example goes in input.example")
        inputs, dtypes, example = _load_input(raw["input"], path)
    else:
        inputs, dtypes, example = _load_inputs(raw["inputs"], raw.get("example"), path)
    constructor, members, init, source = (_load_constructor(raw["constructor"], path) if "constructor" in raw
                                          else (None, (), (), None))
    params = _load_params(raw.get("params"), path)
    ops_raw = raw["ops"]
    if not isinstance(ops_raw, list) or not ops_raw:
        fail(path, "ops", "expected a non-empty list of ops")
    ops = tuple(_load_op(o, i, path) for i, o in enumerate(ops_raw))
    precision = _choice(raw, "precision", PRECISIONS, "tf32", "precision", path)
    intermediates = _choice(raw, "intermediates", INTERMEDIATES, "eager", "intermediates", path)
    plan = _mapping(raw.get("plan", {}) or {}, "plan", path)
    _no_extra(plan, {"conv_layout", "conv", "conv_norm", "linear"}, "plan", path)
    conv_layout = _choice(plan, "conv_layout", CONV_LAYOUTS, "auto", "plan.conv_layout", path)
    conv_impl = _choice(plan, "conv", CONV_IMPLS, "auto", "plan.conv", path)
    conv_norm = _choice(plan, "conv_norm", CONV_NORM_FORMS, "auto", "plan.conv_norm", path)
    linear_impl = _choice(plan, "linear", LINEAR_IMPLS, "auto", "plan.linear", path)
    outputs = _load_outputs(raw["outputs"], path) if "outputs" in raw else ()
    return Spec(
        path=path,
        name=name,
        description=description.strip(),
        input_shape=inputs[0].shape,
        dtypes=dtypes,
        example=example,
        params=params,
        ops=ops,
        precision=precision,
        intermediates=intermediates,
        rewrites=_load_rewrites(raw.get("rewrites"), path),
        conv_layout=conv_layout,
        conv_impl=conv_impl,
        conv_norm=conv_norm,
        linear_impl=linear_impl,
        inputs=inputs,
        multi_input="inputs" in raw,
        constructor=constructor,
        members=members,
        init=init,
        source=source,
        outputs=outputs,
    )


def _load_outputs(raw, path) -> tuple[str, ...]:
    """``outputs:``: a non-empty list of value names, each once (what they name is kgen.ir's check)."""
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_OUTPUTS:
        fail(path, "outputs", f"expected a non-empty list of at most {MAX_OUTPUTS} value names, got {show(raw)}")
    names = []
    for i, v in enumerate(raw):
        name = value_name(v, f"outputs[{i}]", path)
        if name in names:
            fail(path, f"outputs[{i}]", f"'{name}' is listed twice (outputs[{names.index(name)}]); each value is returned once")
        names.append(name)
    return tuple(names)


def spec_to_data(spec: Spec) -> dict:
    """The spec as plain data (dicts, lists, str, int, float, bool, None), every default
    filled in and the free-text description left out: ``spec_from_data`` gives the spec back.
    Generated modules embed it (every string in it is a checked identifier)."""

    def plain(v):
        return [plain(e) for e in v] if isinstance(v, (tuple, list)) else v

    def op(o):
        args = {k: plain(v) for k, v in o.args.items()}
        args.update({k: v for k, v in (("as", o.name), ("from", o.src)) if v is not None})
        return {o.kind: args}

    def param(p):
        d = {"shape": list(p.shape), "init": p.init}
        return dict(d, unused=True) if p.unused else d

    data = {"name": spec.name}
    if spec.multi_input:
        data["inputs"] = {i.name: {"shape": list(i.shape), "dtype": dtypes_data(spec.dtypes)} for i in spec.inputs}
        data["example"] = dict(spec.example)
    else:
        data["input"] = {"shape": list(spec.input_shape), "dtype": dtypes_data(spec.dtypes), "example": dict(spec.example)}
    data.update({
        "params": {n: param(p) for n, p in spec.params.items()},
        "ops": [op(o) for o in spec.ops],
        "precision": spec.precision,
        "rewrites": dict(spec.rewrites),
        "plan": {"conv_layout": spec.conv_layout, "conv": spec.conv_impl},
    })
    if spec.intermediates != "eager":  # only when set: the data (and spec hashes) of specs without it stay as they were
        data["intermediates"] = spec.intermediates
    if spec.conv_norm != "auto":  # only when set: the data (and spec hashes) of specs without it stay as they were
        data["plan"]["conv_norm"] = spec.conv_norm
    if spec.linear_impl != "auto":  # the same
        data["plan"]["linear"] = spec.linear_impl
    if spec.outputs:  # only when given: the data (and spec hashes) of specs without it stay as they were
        data["outputs"] = list(spec.outputs)
    if spec.constructor is not None:
        args = {a.name: plain(a.value) if a.default is NO_DEFAULT else {"value": plain(a.value), "default": plain(a.default)}
                for a in spec.constructor}
        data["constructor"] = {"args": args, "members": list(spec.members)}
        if spec.init:  # only when given: the data (and hashes) of specs without it stay as they were
            data["constructor"]["init"] = [{"member": i.member, "fn": i.fn, "args": dict(i.args)} for i in spec.init]
        if spec.source is not None:
            data["constructor"] = {"source": spec.source, **data["constructor"]}
    return data
