"""The pipeline IR: typed ops, PyTorch's shape rules, and a torch implementation of each op.

Each op of a spec is built from its entry in the op table (``kgen.ops``), by
the entry's role: a convolution, a window pool, a global pool, a reduction, a
normalization or an elementwise op. An IR op says what is computed, as
written: ``Op.infer`` is its shape rule and ``Op.run`` its semantics in eager
PyTorch. The reference model (``kgen.reference``) is the spec's ops run
through ``run`` in float64, and the rewrite tests compare a rewritten pipeline
with the original through it, so a rewritten op (``kgen.lowering.LoweredConv``,
a reduction with a summed parameter) carries its own ``run``.

Shapes are ``(batch, channels, *spatial)``; the batch may be a run-time symbol
(a string), everything else is a compile-time constant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch
import torch.nn.functional as F

from .errors import SpecError
from .fields import MAX_SIZE
from .ops import OPS, ElementwiseOp
from .spec import OpSpec, Spec, load_spec, max_elements

Tensors = Mapping[str, torch.Tensor]


class ShapeError(ValueError):
    """An op cannot take its input; the pipeline builder adds file and key."""


@dataclass(frozen=True)
class TensorType:
    shape: tuple  # (batch, C, *spatial); batch is an int or a symbol name

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def channels(self) -> int:
        return self.shape[1]

    @property
    def spatial(self) -> tuple[int, ...]:
        return tuple(self.shape[2:])

    @property
    def sample_numel(self) -> int:
        return math.prod(self.shape[1:])

    def concrete(self, batch: int) -> tuple[int, ...]:
        return (batch,) + tuple(self.shape[1:])

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.shape) + "]"


def conv_out(L, k, s, p, d):
    """Output size of a convolution along one dim."""
    return (L + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_out(L, k, s, p, d, ceil_mode):
    """PyTorch's pooling output size (pooling_output_shape in ATen)."""
    num = L + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = num // s + 1
    if ceil_mode and (out - 1) * s >= L + p:
        out -= 1
    return out


def _check_rank(t: TensorType, rank: int, kind: str):
    if len(t.spatial) != rank:
        raise ShapeError(f"{kind} needs a {rank + 2}-d input (batch, channels, {rank} spatial), got shape {t}")


def _ident(name: str) -> str:
    """The C/Python identifier of a state_dict name: conv.weight -> conv_weight."""
    return name.replace(".", "_")


# ---------------------------------------------------------------- members


@dataclass(frozen=True)
class TensorArg:
    """A parameter tensor the op takes: state_dict name, C/Python identifier, shape."""

    name: str  # "conv.weight"
    ident: str  # "conv_weight"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Member:
    """What a model of the pipeline creates: a ``torch.nn`` submodule (``nn_class`` with
    ``kwargs``) or a free parameter (``init``: randn | ones | zeros). The reference model
    instantiates members; the generated module's ``Model`` prints the same lines."""

    attr: str  # attribute name on the model
    tensors: tuple[TensorArg, ...]  # the state_dict entries it holds, in order
    nn_class: str | None = None
    kwargs: tuple = ()  # ((name, value), ...) for nn_class
    init: str | None = None


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class Op:
    key: str  # where it came from in the spec, e.g. "ops[1].max_pool3d"

    @property
    def op_name(self) -> str:
        """Its entry in the op table (kgen.ops.OPS)."""
        raise NotImplementedError

    def infer(self, t: TensorType) -> TensorType:
        raise NotImplementedError

    def run(self, x: torch.Tensor, tensors: Tensors) -> torch.Tensor:
        raise NotImplementedError

    def tensor_names(self) -> tuple[str, ...]:
        """Names of the parameters (state_dict keys) this op reads."""
        return ()

    def member(self) -> Member | None:
        """The submodule this op owns, if any."""
        return None

    def flops(self, t_in: TensorType, t_out: TensorType) -> int:
        """Floating-point operations per sample (multiply-adds count 2)."""
        return t_in.sample_numel

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Conv(Op):
    """convNd / conv_transposeNd, as written in the spec.

    How it is computed (a folded average pool, sub-pixel phases, a cropped
    output, the bias added by the next stage) is the rewrites' and the plan's
    business: ``kgen.lowering.LoweredConv`` wraps this op with that.
    """

    kind: str = "conv3d"
    module: str = "conv"
    in_channels: int = 1
    out_channels: int = 1
    kernel: tuple = (1,)
    stride: tuple = (1,)
    padding: tuple = (0,)
    dilation: tuple = (1,)
    output_padding: tuple = (0,)
    groups: int = 1
    bias: bool = True

    @property
    def op_name(self) -> str:
        return self.kind

    @property
    def transposed(self) -> bool:
        return "transpose" in self.kind

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"

    @property
    def bias_name(self) -> str | None:
        return f"{self.module}.bias" if self.bias else None

    def tensor_names(self):
        return (self.weight_name,) + ((self.bias_name,) if self.bias else ())

    def weight_shape(self) -> tuple[int, ...]:
        if self.transposed:
            return (self.in_channels, self.out_channels // self.groups) + self.kernel
        return (self.out_channels, self.in_channels // self.groups) + self.kernel

    def member(self) -> "Member":
        cls = ("ConvTranspose" if self.transposed else "Conv") + f"{self.rank}d"
        kw = dict(
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            kernel_size=self.kernel,
            stride=self.stride,
            padding=self.padding,
        )
        if self.transposed:
            kw["output_padding"] = self.output_padding
        kw.update(groups=self.groups, bias=self.bias, dilation=self.dilation)
        tensors = (TensorArg(self.weight_name, _ident(self.weight_name), self.weight_shape()),)
        if self.bias:
            tensors += (TensorArg(self.bias_name, _ident(self.bias_name), (self.out_channels,)),)
        return Member(self.module, tensors, nn_class=cls, kwargs=tuple(kw.items()))

    def out_size(self, L: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size for input spatial size ``L``."""
        if self.transposed:
            return tuple(
                (l - 1) * s - 2 * p + d * (k - 1) + op + 1
                for l, k, s, p, d, op in zip(L, self.kernel, self.stride, self.padding, self.dilation, self.output_padding)
            )
        return tuple(conv_out(*a) for a in zip(L, self.kernel, self.stride, self.padding, self.dilation))

    def check_input(self, t: TensorType) -> None:
        _check_rank(t, self.rank, self.kind)
        if t.channels != self.in_channels:
            raise ShapeError(f"expects {self.in_channels} input channels, got shape {t}")
        if self.out_channels % self.groups or self.in_channels % self.groups:
            raise ShapeError(
                f"groups={self.groups} must divide in_channels ({self.in_channels}) and out_channels ({self.out_channels})"
            )
        if self.transposed and any(op >= max(s, d) for op, s, d in zip(self.output_padding, self.stride, self.dilation)):
            raise ShapeError("output_padding must be smaller than stride or dilation")

    def infer(self, t):
        self.check_input(t)
        return self.output_type(t, self.out_size(t.spatial))

    def output_type(self, t: TensorType, out: tuple[int, ...]) -> TensorType:
        if any(o < 1 for o in out):
            raise ShapeError(f"output would be empty: input {t} gives spatial size {list(out)}")
        return TensorType((t.shape[0], self.out_channels) + tuple(out))

    def flops(self, t_in, t_out):
        if self.transposed:
            return 2 * t_in.sample_numel * self.out_channels // self.groups * math.prod(self.kernel)
        return 2 * self.in_channels // self.groups * math.prod(self.kernel) * t_out.sample_numel

    def apply(self, x, w, b, kernel_stride: tuple | None = None) -> torch.Tensor:
        """The torch convolution with this op's geometry; ``kernel_stride`` overrides the stride
        (a folded convolution runs a wider kernel with a larger stride)."""
        stride = kernel_stride or self.stride
        if self.transposed:
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.rank - 1]
            return fn(x, w, b, stride, self.padding, self.output_padding, self.groups, self.dilation)
        fn = (F.conv1d, F.conv2d, F.conv3d)[self.rank - 1]
        return fn(x, w, b, stride, self.padding, self.dilation, self.groups)

    def run(self, x, tensors):
        return self.apply(x, tensors[self.weight_name], tensors[self.bias_name] if self.bias else None)

    def describe(self):
        args = f"{self.in_channels}->{self.out_channels}, k={fmt(self.kernel)}"
        if any(s != 1 for s in self.stride):
            args += f", s={fmt(self.stride)}"
        if any(self.padding):
            args += f", p={fmt(self.padding)}"
        if any(d != 1 for d in self.dilation):
            args += f", dilation={fmt(self.dilation)}"
        if self.transposed and any(self.output_padding):
            args += f", output_padding={fmt(self.output_padding)}"
        if self.groups != 1:
            args += f", groups={self.groups}"
        return f"{self.kind}({args})"


@dataclass(frozen=True)
class Pool(Op):
    """max_poolNd / avg_poolNd with PyTorch's defaults (stride = kernel, floor mode)."""

    kind: str = "max"  # max | avg
    kernel: tuple = (1,)
    stride: tuple = (1,)
    padding: tuple = (0,)
    dilation: tuple = (1,)
    ceil_mode: bool = False
    count_include_pad: bool = True
    sources: tuple = ()  # spec keys of the pools composed into this one

    @property
    def op_name(self) -> str:
        return f"{self.kind}_pool{self.rank}d"

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def non_overlapping(self) -> bool:
        return (
            self.stride == self.kernel
            and not any(self.padding)
            and all(d == 1 for d in self.dilation)
            and not self.ceil_mode
        )

    def infer(self, t):
        _check_rank(t, self.rank, f"{self.kind}_pool{self.rank}d")
        for k, p in zip(self.kernel, self.padding):
            if p > k // 2:  # PyTorch's rule, whatever the dilation
                raise ShapeError(f"padding {list(self.padding)} must be at most half of the kernel {list(self.kernel)}")
        if self.kind == "avg" and self.rank == 3 and any(l < k for l, k in zip(t.spatial, self.kernel)):
            raise ShapeError(f"input {t} is smaller than the kernel {list(self.kernel)} (avg_pool3d needs it unpadded)")
        out = tuple(
            _pool_out(l, k, s, p, d, self.ceil_mode)
            for l, k, s, p, d in zip(t.spatial, self.kernel, self.stride, self.padding, self.dilation)
        )
        if any(o < 1 for o in out):
            raise ShapeError(f"input {t} pools to nothing (spatial size {list(out)})")
        return TensorType(t.shape[:2] + out)

    def flops(self, t_in, t_out):
        return t_out.sample_numel * math.prod(self.kernel)

    def run(self, x, tensors):
        if self.kind == "max":
            fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[self.rank - 1]
            return fn(x, self.kernel, self.stride, self.padding, self.dilation, self.ceil_mode)
        fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[self.rank - 1]
        return fn(x, self.kernel, self.stride, self.padding, self.ceil_mode, self.count_include_pad)

    def describe(self):
        args = f"k={fmt(self.kernel)}"
        if self.stride != self.kernel:
            args += f", s={fmt(self.stride)}"
        if any(self.padding):
            args += f", p={fmt(self.padding)}"
        if self.kind == "max" and any(d != 1 for d in self.dilation):
            args += f", dilation={fmt(self.dilation)}"
        if self.ceil_mode:
            args += ", ceil_mode"
        if self.kind == "avg" and any(self.padding) and not self.count_include_pad:
            args += ", count_include_pad=False"
        return f"{self.kind}_pool{self.rank}d({args})"


@dataclass(frozen=True)
class Elementwise(Op):
    """An elementwise op of the op table (``fn``): ``consts`` are its constant arguments
    (e.g. clamp's min and max, None where the spec leaves one out); an op with an
    operand takes a ``scalar`` or a broadcast parameter ``param``.

    ``param_sum_dims`` (reduction algebra): the parameter enters summed over these
    dims of the activation (e.g. ``(1,)``: sum over channels of a per-channel bias).
    """

    fn: str = "relu"
    consts: tuple = ()
    scalar: float | None = None
    param: str | None = None
    param_sum_dims: tuple = ()
    param_rank: int = 0  # activation rank that param_sum_dims refer to
    param_view: tuple = ()  # shape to view the parameter as (a conv bias [C] as [C, 1, 1])
    param_sum_scale: int = 1  # times the summed parameter counts (it broadcasts along summed dims)

    @property
    def op_name(self) -> str:
        return self.fn

    @property
    def entry(self) -> ElementwiseOp:
        return OPS[self.fn]

    def tensor_names(self):
        return (self.param,) if self.param else ()

    def infer(self, t):
        return t

    def aligned_param(self, p: torch.Tensor, rank: int) -> torch.Tensor:
        """The parameter viewed with the activation's rank, summed where the algebra says so."""
        if self.param_view:
            p = p.reshape(self.param_view)
        if self.param_sum_dims:
            p = p.reshape((1,) * (self.param_rank - p.dim()) + tuple(p.shape)).sum(dim=self.param_sum_dims)
            p = p * self.param_sum_scale
        return p.reshape((1,) * (rank - p.dim()) + tuple(p.shape))

    def run(self, x, tensors):
        if not self.entry.operand:
            return self.entry.torch_fn(x, *self.consts)
        other = self.scalar if self.param is None else self.aligned_param(tensors[self.param], x.dim())
        return self.entry.torch_fn(x, other)

    def describe(self):
        if self.consts:
            return f"{self.fn}({', '.join(str(c) for c in self.consts)})"
        if not self.entry.operand:
            return self.fn
        if self.param is None:
            return f"{self.fn}({self.scalar:g})"
        if self.param_sum_dims:
            return f"{self.fn}(sum over dims {list(self.param_sum_dims)} of {self.param})"
        if self.param_view:
            return f"{self.fn}({self.param} per channel)"
        return f"{self.fn}({self.param})"


@dataclass(frozen=True)
class Reduce(Op):
    """sum / mean / max (values) over ``dims``; ``kept`` dims stay as size 1."""

    fn: str = "sum"
    dims: tuple = ()
    kept: tuple = ()
    origin: str = ""  # e.g. "adaptive_avg_pool3d" when it came from global pooling

    @property
    def op_name(self) -> str:
        return self.origin or self.fn

    def infer(self, t):
        return TensorType(tuple(1 if d in self.kept else n for d, n in enumerate(t.shape) if d not in self.dims or d in self.kept))

    def count(self, t: TensorType) -> int:
        return math.prod(t.shape[d] for d in self.dims)

    def run(self, x, tensors):
        if self.fn == "max":
            y = torch.amax(x, dim=self.dims, keepdim=True)
        else:
            y = getattr(torch, self.fn)(x, dim=self.dims, keepdim=True)
        shape = [n for d, n in enumerate(y.shape) if d not in self.dims or d in self.kept]
        return y.reshape(shape)

    def describe(self):
        name = self.origin or f"{self.fn}"
        keep = "" if not self.kept else (", keepdim" if self.kept == self.dims else f", keeping {list(self.kept)}")
        return f"{name}(dims={list(self.dims)}{keep})" if not self.origin else f"{self.origin} (= {self.fn} over {list(self.dims)})"


@dataclass(frozen=True)
class Norm(Op):
    """group_norm / instance_norm (= group norm with one channel per group)."""

    kind: str = "group_norm"
    module: str = "group_norm"
    num_groups: int = 1
    num_channels: int = 1
    eps: float = 1e-5
    affine: bool = True
    rank: int = 1  # spatial dims of its input (InstanceNorm{rank}d)

    @property
    def op_name(self) -> str:
        return self.kind

    def tensor_names(self):
        return (f"{self.module}.weight", f"{self.module}.bias") if self.affine else ()

    def member(self) -> Member:
        if self.kind == "group_norm":
            cls, kw = "GroupNorm", dict(num_groups=self.num_groups, num_channels=self.num_channels, eps=self.eps, affine=self.affine)
        else:
            cls, kw = f"InstanceNorm{self.rank}d", dict(num_features=self.num_channels, eps=self.eps, affine=self.affine)
        tensors = tuple(TensorArg(n, _ident(n), (self.num_channels,)) for n in self.tensor_names())
        return Member(self.module, tensors, nn_class=cls, kwargs=tuple(kw.items()))

    def infer(self, t):
        if self.num_channels != t.channels:
            raise ShapeError(f"normalizes {self.num_channels} channels, got shape {t}")
        if self.kind == "instance_norm" and math.prod(t.spatial) < 2:
            raise ShapeError(f"instance_norm needs more than one spatial element, got shape {t}")
        if t.channels % self.num_groups:
            raise ShapeError(f"num_groups={self.num_groups} does not divide the {t.channels} channels")
        return t

    def flops(self, t_in, t_out):
        return 8 * t_in.sample_numel

    def run(self, x, tensors):
        w = tensors[f"{self.module}.weight"] if self.affine else None
        b = tensors[f"{self.module}.bias"] if self.affine else None
        if self.kind == "instance_norm":
            return F.instance_norm(x, weight=w, bias=b, eps=self.eps)
        return F.group_norm(x, self.num_groups, w, b, self.eps)

    def describe(self):
        if self.kind == "instance_norm":
            return f"instance_norm(eps={self.eps:g}{', affine' if self.affine else ''})"
        return f"group_norm(groups={self.num_groups}, eps={self.eps:g}{'' if self.affine else ', affine=False'})"


def fmt(t: tuple) -> str:
    """Sizes for describe(): one number when all are equal, else 2x3x4."""
    return str(t[0]) if len(set(t)) == 1 else "x".join(str(v) for v in t)


# ---------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    init: str


@dataclass(frozen=True)
class Pipeline:
    name: str
    path: str
    input: TensorType
    ops: tuple[Op, ...]
    types: tuple[TensorType, ...]  # types[i] is op i's input; types[-1] the output
    params: dict = field(default_factory=dict)  # free parameters: name -> Param
    precision: str = "tf32"
    rewrites: dict = field(default_factory=dict)
    conv_layout: str = "auto"
    conv_impl: str = "auto"  # plan.conv: aten | gemm forces who computes the convolutions
    example: dict = field(default_factory=dict)
    description: str = ""
    spec: Spec | None = field(default=None, compare=False, repr=False)  # what it was built from

    @property
    def output(self) -> TensorType:
        return self.types[-1]

    @property
    def batch_symbol(self) -> str | None:
        b = self.input.shape[0]
        return b if isinstance(b, str) else None

    def example_batch(self) -> int:
        b = self.input.shape[0]
        return self.example.get(b, 1) if isinstance(b, str) else b

    def with_ops(self, ops) -> "Pipeline":
        """The same pipeline with other ops; shapes are re-inferred and the output must not change."""
        types = infer_types(self.input, ops, self.path)
        if types[-1] != self.output:
            raise AssertionError(f"rewrite changed the output type {self.output} -> {types[-1]}")
        return replace(self, ops=tuple(ops), types=types)

    def members(self) -> list[Member]:
        """Submodules and free parameters in the order a model of the pipeline creates them.

        The order of first use in the ops; it matches a hand-written model that
        declares them in forward order, so the same seed gives the same init.
        The reference model instantiates these; the generated Model prints them.
        """
        seen, out = set(), []
        for op in self.ops:
            m = op.member()
            if m is not None and m.attr not in seen:
                seen.add(m.attr)
                out.append(m)
            for name in op.tensor_names():
                if name in self.params and name not in seen:
                    seen.add(name)
                    p = self.params[name]
                    out.append(Member(name, (TensorArg(name, name, p.shape),), init=p.init))
        return out

    def tensor_args(self) -> list[TensorArg]:
        """Parameter tensors of the op, in creation order (the functional forward's order)."""
        return [t for m in self.members() for t in m.tensors]

    def run(self, x: torch.Tensor, tensors: Tensors) -> torch.Tensor:
        for op in self.ops:
            x = op.run(x, tensors)
        return x


def infer_types(input_type: TensorType, ops, path: str) -> tuple[TensorType, ...]:
    types = [input_type]
    for op in ops:
        try:
            types.append(op.infer(types[-1]))
        except ShapeError as e:
            raise SpecError(path, op.key, str(e)) from None
    return tuple(types)


def _norm_dims(dims, t: TensorType, key, path) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not -t.rank <= d < t.rank:
            raise SpecError(path, f"{key}.dim", f"dimension {d} is out of range for shape {t} (rank {t.rank})")
        d %= t.rank
        if d == 0:
            raise SpecError(path, f"{key}.dim", "reducing over the batch dimension (0) is not supported")
        out.append(d)
    if len(set(out)) != len(out):
        raise SpecError(path, f"{key}.dim", f"repeated dimension in {list(dims)}")
    return tuple(sorted(out))


def _check_broadcast(pshape, t: TensorType, key, path, name):
    if len(pshape) > t.rank:
        raise SpecError(path, key, f"parameter '{name}' of shape {list(pshape)} has more dims than the activation {t}")
    aligned = (None,) * (t.rank - len(pshape)) + tuple(pshape)
    for d, (p, n) in enumerate(zip(aligned, t.shape)):
        if p is None or p == 1:
            continue
        if d == 0 or p != n:
            raise SpecError(
                path, key, f"parameter '{name}' of shape {list(pshape)} does not broadcast to the activation {t}"
            )


def _check_bounds(op: Op | None, t_in: TensorType, t: TensorType, key: str, path: str) -> None:
    """Sizes the kernels can index: every size and window position within 32 bits, and no
    activation sample or weight above ``max_elements()`` (KGEN_MAX_ELEMENTS)."""
    cap = max_elements()
    if isinstance(op, (Conv, Pool)):
        for d, L in enumerate(t_in.spatial):
            reach = L + 2 * op.padding[d] + op.dilation[d] * (op.kernel[d] - 1) + op.stride[d]
            if reach > MAX_SIZE:
                raise SpecError(path, key, f"input size {L} with its padding, kernel and stride along spatial dim {d} "
                                "exceeds the kernels' 32-bit index range")
    if any(n > MAX_SIZE for n in t.shape[1:]):
        raise SpecError(path, key, f"shape {t} has a size above 2**31 - 1")
    if t.sample_numel > cap:
        raise SpecError(path, key, f"shape {t} has {t.sample_numel} elements per sample; at most {cap} "
                        "(KGEN_MAX_ELEMENTS) are allowed")
    if isinstance(op, Conv) and math.prod(op.weight_shape()) > cap:
        raise SpecError(path, key, f"the weight {list(op.weight_shape())} has {math.prod(op.weight_shape())} "
                        f"elements; at most {cap} (KGEN_MAX_ELEMENTS) are allowed")


# ---------------------------------------------------------------- building


class _Builder:
    """Builds each spec op's IR op from its op-table entry, one method per role."""

    def __init__(self, spec: Spec):
        self.spec, self.path = spec, spec.path
        self.modules: dict[str, str] = {}  # module name -> key of the op that owns it
        self.used: set[str] = set()  # free parameters some op reads

    def module_name(self, o: OpSpec, default: str) -> str:
        name = o.args["name"] or default
        if name in self.modules:
            hint = "" if o.args["name"] else "; give this op a 'name'"
            raise SpecError(self.path, f"{o.key}.name", f"module name '{name}' is already used by {self.modules[name]}{hint}")
        if name in self.spec.params:
            raise SpecError(self.path, f"{o.key}.name", f"module name '{name}' clashes with the parameter '{name}'")
        self.modules[name] = o.key
        return name

    def conv(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        transposed = entry.variant == "transposed"
        return Conv(
            key=o.key,
            kind=o.kind,
            module=self.module_name(o, "conv_transpose" if transposed else "conv"),
            in_channels=t.channels,
            out_channels=a["out_channels"],
            kernel=a["kernel_size"],
            stride=a["stride"],
            padding=a["padding"],
            dilation=a["dilation"],
            output_padding=a.get("output_padding") or (0,) * entry.rank,
            groups=a["groups"],
            bias=a["bias"],
        )

    def pool(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        return Pool(
            key=o.key,
            kind=entry.variant,
            kernel=a["kernel_size"],
            stride=a["stride"] or a["kernel_size"],
            padding=a["padding"],
            dilation=a.get("dilation") or (1,) * entry.rank,
            ceil_mode=a["ceil_mode"],
            count_include_pad=a.get("count_include_pad", True),
            sources=(o.key,),
        )

    def global_pool(self, o: OpSpec, entry, t: TensorType) -> Op:
        try:
            _check_rank(t, entry.rank, o.kind)
        except ShapeError as e:
            raise SpecError(self.path, o.key, str(e)) from None
        spatial = tuple(range(2, 2 + entry.rank))
        return Reduce(key=o.key, fn="mean", dims=spatial, kept=spatial, origin=o.kind)

    def elementwise(self, o: OpSpec, entry: ElementwiseOp, t: TensorType) -> Op:
        a = o.args
        pname = a.get("param")
        if pname:
            if pname not in self.spec.params:
                known = ", ".join(sorted(self.spec.params)) or "none declared"
                raise SpecError(self.path, f"{o.key}.param", f"unknown parameter '{pname}' (params: {known})")
            _check_broadcast(self.spec.params[pname].shape, t, f"{o.key}.param", self.path, pname)
            self.used.add(pname)
        consts = tuple(a[name] for name, _ in entry.consts)
        return Elementwise(key=o.key, fn=o.kind, consts=consts, scalar=a.get("scalar"), param=pname)

    def reduce(self, o: OpSpec, entry, t: TensorType) -> Op:
        dims = _norm_dims(o.args["dim"], t, o.key, self.path)
        return Reduce(key=o.key, fn=o.kind, dims=dims, kept=dims if o.args["keepdim"] else ())

    def norm(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        return Norm(
            key=o.key,
            kind=o.kind,
            module=self.module_name(o, o.kind),
            num_groups=a.get("num_groups") or t.channels,  # instance_norm: one channel per group
            num_channels=t.channels,
            eps=a["eps"],
            affine=a["affine"],
            rank=len(t.spatial),
        )


def build_pipeline(spec: Spec) -> Pipeline:
    """Spec -> Pipeline with inferred types; semantic errors name the op's key."""
    path = spec.path
    b = _Builder(spec)
    t = TensorType(spec.input_shape)
    _check_bounds(None, t, t, "input.shape", path)
    for p in spec.params.values():
        if math.prod(p.shape) > max_elements():
            raise SpecError(path, f"{p.key}.shape", f"{math.prod(p.shape)} elements; at most {max_elements()} "
                            "(KGEN_MAX_ELEMENTS) are allowed")
    ops, types = [], [t]
    for o in spec.ops:
        entry = OPS[o.kind]
        op = getattr(b, entry.role)(o, entry, t)
        try:
            t = op.infer(t)
        except ShapeError as e:
            raise SpecError(path, o.key, str(e)) from None
        _check_bounds(op, types[-1], t, o.key, path)
        ops.append(op)
        types.append(t)

    for name, p in spec.params.items():
        if name not in b.used:
            raise SpecError(path, p.key, f"parameter '{name}' is declared but no op uses it")
    pipe = Pipeline(
        name=spec.name,
        path=path,
        input=types[0],
        ops=tuple(ops),
        types=tuple(types),
        params={n: Param(n, p.shape, p.init) for n, p in spec.params.items()},
        precision=spec.precision,
        rewrites=dict(spec.rewrites),
        conv_layout=spec.conv_layout,
        conv_impl=spec.conv_impl,
        example=dict(spec.example),
        description=spec.description,
        spec=spec,
    )
    idents = {}
    for arg in pipe.tensor_args():
        if arg.ident in idents or arg.ident == "x":
            raise SpecError(path, "params", f"parameter names '{arg.name}' and '{idents.get(arg.ident, 'x')}' collide as '{arg.ident}'")
        idents[arg.ident] = arg.name
    return pipe


def load_pipeline(path) -> Pipeline:
    return build_pipeline(load_spec(path))
