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
from functools import cached_property, lru_cache
from typing import Mapping

import torch
import torch.nn.functional as F

from .errors import SpecError
from .fields import MAX_SIZE
from .ops import NORMALIZATIONS, OPS, ElementwiseOp
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


@lru_cache(maxsize=4096)
def _conv_out_size(conv: "Conv", L: tuple[int, ...]) -> tuple[int, ...]:
    """Conv.out_size, remembered (planning asks for each convolution's size many times per plan it tries)."""
    if conv.transposed:
        return tuple(
            (l - 1) * s - 2 * p + d * (k - 1) + op + 1
            for l, k, s, p, d, op in zip(L, conv.kernel, conv.stride, conv.padding, conv.dilation, conv.output_padding)
        )
    return tuple(conv_out(*a) for a in zip(L, conv.kernel, conv.stride, conv.padding, conv.dilation))


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
    # None: the plan's dtype (a parameter or buffer, converted with the model); "float32": a batch norm's
    # statistics, float in every plan, as ATen keeps them for a 16-bit input (BatchStats, DerivedTensor)
    dtype: str | None = None

    @classmethod
    def named(cls, name: str, shape, dtype: str | None = None) -> "TensorArg":
        return cls(name, _ident(name), tuple(shape), dtype)


@dataclass(frozen=True)
class Member:
    """What a model of the pipeline creates: a ``torch.nn`` submodule (``nn_class`` with
    ``kwargs``) or a free parameter (``init``: randn | ones | zeros). The reference model
    instantiates members; the generated module's ``Model`` prints the same lines."""

    attr: str  # attribute name on the model
    tensors: tuple[TensorArg, ...]  # the parameters it holds (state_dict entries), in order
    nn_class: str | None = None
    kwargs: tuple = ()  # ((name, value), ...) for nn_class
    init: str | float | None = None  # randn | ones | zeros, or a number (a scalar parameter torch.tensor(value))
    buffers: tuple[TensorArg, ...] = ()  # running statistics the op reads and (in training mode) updates


HALF_DTYPES = (torch.bfloat16, torch.float16)  # whose batch-norm statistics ATen computes in float


def batch_norm_scale(var: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A batch norm's per-channel scale ``weight / sqrt(var + eps)`` (``1 / sqrt(...)`` without a
    weight), as kgen::batch_norm_scale computes it in the generated bindings: in float for 16-bit
    tensors (ATen's batch norm computes a 16-bit input's statistics and scale in float)."""
    if var.dtype in HALF_DTYPES:
        var, weight = var.float(), weight.float() if weight is not None else None
    root = torch.sqrt(var + eps)
    return weight / root if weight is not None else torch.reciprocal(root)


@dataclass(frozen=True)
class DerivedTensor:
    """A tensor the op computes from its parameters and buffers on each call, before its stages
    (a stage takes it like a parameter): eval-mode batch norm's per-channel scale
    ``weight / sqrt(running_var + eps)`` (``1 / sqrt(...)`` without a weight), which the plan for
    eval mode applies as ``(x - running_mean) * scale + bias`` (kgen.rewrites.batch_norm_eval_affine)."""

    arg: TensorArg
    var: str  # the running variance's state_dict name
    weight: str | None
    eps: float

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.var,) + ((self.weight,) if self.weight else ())

    def compute(self, tensors) -> torch.Tensor:
        return batch_norm_scale(tensors[self.var], tensors[self.weight] if self.weight else None, self.eps)

    def cpp(self, ident) -> str:
        """The same formula in ATen (``ident``: a state_dict name -> its C++ argument)."""
        weight = ident(self.weight) if self.weight else "at::Tensor()"
        return f"kgen::batch_norm_scale({ident(self.var)}, {weight}, {self.eps!r})"


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class OpResult:
    """How the op kgen::NAME lays out its result (the one home of that layout; ``Pipeline.op_result``):
    the outputs in the order of the spec's ``outputs:``, then, in training mode, each running statistic's new
    value in the order of ``Pipeline.buffer_args`` (eval mode returns the outputs alone). One tensor
    alone is returned as a Tensor; more as one list (schema ``Tensor[]``: a C++ std::vector rather
    than a std::tuple, whose boxing templates the compiler instantiates over every element, a
    minute of compile time for DenseNet-201's 210 tensors)."""

    outputs: int  # how many outputs
    several: bool  # the Model returns a tuple of outputs (else the one output)
    buffers: tuple[str, ...]  # the running statistics' state_dict names

    @property
    def count(self) -> int:
        return self.outputs + len(self.buffers)

    @property
    def is_list(self) -> bool:
        """Whether the op returns a list (``Tensor[]``) rather than one tensor."""
        return self.count > 1

    @property
    def schema(self) -> str:
        return "Tensor[]" if self.is_list else "Tensor"

    @property
    def cpp_type(self) -> str:
        return "std::vector<at::Tensor>" if self.is_list else "at::Tensor"

    def split(self, result) -> tuple:
        """(the outputs as the Model returns them: one tensor, or a tuple of several; the running
        statistics' new values, a list in ``buffers``' order: empty in eval mode, where the op returns
        the outputs alone) of the op's ``result``."""
        if not self.is_list:
            return result, []
        n = self.outputs
        return (tuple(result[:n]) if self.several else result[0]), list(result[n:])

    def output_grads(self, grads: tuple) -> tuple:
        """The gradients of the outputs (None for an unused one) among the backward's arguments: torch.library
        hands a list result's gradients over as one list, a tensor's as one tensor."""
        flat = list(grads[0]) if self.is_list else [grads[0]]
        return tuple(flat[: self.outputs])


class Env(dict):
    """What an op's ``run`` reads besides its input: parameters and buffers by state_dict
    name, values by name (inputs and results named with ``as``), and the mode."""

    training: bool = False


@dataclass(frozen=True)
class Op:
    key: str  # where it came from in the spec, e.g. "ops[1].max_pool3d"
    src: str | None = None  # the value it reads (spec `from:`); None: the previous op's result

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

    def value_names(self) -> tuple[str, ...]:
        """Names of the values (inputs, named results) this op reads besides its input."""
        return ()

    def buffer_names(self) -> tuple[str, ...]:
        """Names of the buffers (state_dict keys) this op reads and may update."""
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
        return _conv_out_size(self, tuple(L))

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
    tensor: str | None = None  # a value (input or named result) as the operand; it broadcasts to x
    reverse: bool = False  # the operand on the left: f(operand, x)
    register: bool = False  # the plan reads the tensor operand from a register of the same stage
    # a step inside one op eager computes whole (a batch norm as sub, mul, add: rewrites.batch_norm_batch_stats):
    # eager materializes no tensor there, so a 16-bit plan does not round its output (kgen.plan.rounding_points)
    inner: bool = False
    # computed by the CUDA build only: the CPU build's ATen call computed it already (a 16-bit convolution's bias
    # that the next stage adds on CUDA, as ATen's CUDA call adds it after cuDNN's; ATen's CPU convolution adds it
    # inside and rounds once: kgen.plan.defer_conv_bias)
    cuda_only: bool = False

    @property
    def op_name(self) -> str:
        return self.fn

    @property
    def entry(self) -> ElementwiseOp:
        return OPS[self.fn]

    def tensor_names(self):
        return (self.param,) if self.param else ()

    def value_names(self):
        return (self.tensor,) if self.tensor else ()

    @property
    def libm(self) -> bool:
        """Calls a libm function (expf, tanhf, ...): a long chain of dependent instructions."""
        return getattr(self.entry, "libm", False)  # a Capture's entry is no ElementwiseOp

    @property
    def plain(self) -> bool:
        """A function of x alone, or of x and a scalar or parameter on the right (what the rewrites reason about)."""
        return self.tensor is None and not self.reverse and self.src is None

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
        if self.cuda_only and x.device.type != "cuda":
            return x  # the CPU build's ATen call computed it
        if not self.entry.operand:
            return self.entry.torch_fn(x, *self.consts)
        if self.tensor is not None:
            other = tensors[self.tensor]
        elif self.param is None:
            other = self.scalar
        else:
            other = self.aligned_param(tensors[self.param], x.dim())
        if self.reverse:
            if not isinstance(other, torch.Tensor):
                other = torch.full_like(x, other)
            return self.entry.torch_fn(other, x)
        return self.entry.torch_fn(x, other, *self.consts)

    def describe(self):
        consts = "".join(f", {c:g}" for c in self.consts) if self.entry.operand else ""  # (masked_fill's value)
        if self.tensor is not None or self.reverse:
            other = self.tensor if self.tensor is not None else (f"{self.scalar:g}" if self.param is None else self.param)
            return f"{self.fn}({other}, x)" if self.reverse else f"{self.fn}(x, {other}{consts})"
        if consts:
            return f"{self.fn}(x, {self.param}{consts})"
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
    """sum / mean / max / min (values) / logsumexp over ``dims``; ``kept`` dims stay as size 1."""

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
        if self.fn in ("max", "min"):
            y = (torch.amax if self.fn == "max" else torch.amin)(x, dim=self.dims, keepdim=True)
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


@dataclass(frozen=True)
class Capture(Elementwise):
    """Names the value at this point (spec: `as:` on the op before); the identity.

    Later ops read it as ``tensor`` operand or ``src``; the plan keeps it in a
    register where its readers are in the same run of elementwise ops of one
    stage, and otherwise makes it a stage's output tensor."""

    fn: str = "as"
    name: str = ""

    @property
    def plain(self) -> bool:
        return False

    def run(self, x, tensors):
        return x

    def flops(self, t_in, t_out):
        return 0

    def describe(self):
        return f"as {self.name}"


@dataclass(frozen=True)
class Linear(Op):
    """nn.Linear over the last dim (``module`` holds weight [out, in] and bias [out])."""

    module: str = "linear"
    in_features: int = 1
    out_features: int = 1
    bias: bool = True

    @property
    def op_name(self) -> str:
        return "linear"

    def tensor_names(self):
        return (f"{self.module}.weight",) + ((f"{self.module}.bias",) if self.bias else ())

    def member(self) -> Member:
        names = self.tensor_names()
        shapes = [(self.out_features, self.in_features), (self.out_features,)]
        tensors = tuple(TensorArg(n, _ident(n), sh) for n, sh in zip(names, shapes))
        kw = dict(in_features=self.in_features, out_features=self.out_features, bias=self.bias)
        return Member(self.module, tensors, nn_class="Linear", kwargs=tuple(kw.items()))

    def infer(self, t):
        if t.shape[-1] != self.in_features or t.rank < 2:
            raise ShapeError(f"expects {self.in_features} features in the last dim, got shape {t}")
        return TensorType(t.shape[:-1] + (self.out_features,))

    def flops(self, t_in, t_out):
        return 2 * self.in_features * t_out.sample_numel

    def run(self, x, tensors):
        return blocked_linear(x, tensors[f"{self.module}.weight"], tensors[f"{self.module}.bias"] if self.bias else None)

    def describe(self):
        return f"linear({self.in_features}->{self.out_features}{'' if self.bias else ', no bias'})"


BLOCK_ELEMENTS = 2**22  # weight elements converted at a time when the weight's dtype is not x's


def blocked_linear(x, w, b, absolute: bool = False):
    """F.linear(x, w, b) (``absolute``: with |w| and |b|); a weight of another dtype than x (a
    float32 weight too large to hold in float64 too) is converted a block of rows at a time."""
    def part(t):
        t = t.to(x.dtype)
        return t.abs() if absolute else t

    if w.dtype == x.dtype and not absolute:
        return F.linear(x, w, b)
    rows = max(1, BLOCK_ELEMENTS // max(1, w.shape[1]))
    return torch.cat([F.linear(x, part(w[i:i + rows]), None if b is None else part(b[i:i + rows]))
                      for i in range(0, w.shape[0], rows)], dim=-1)


@dataclass(frozen=True)
class Matmul(Op):
    """torch.matmul(x, operand): a 2-d parameter (``transpose``: its transpose) or a value of
    the same batch (a batched product, bmm)."""

    param: str | None = None
    tensor: str | None = None
    transpose: bool = False
    operand_shape: tuple = ()  # the operand's shape (a value's without its batch)

    @property
    def op_name(self) -> str:
        return "matmul"

    def tensor_names(self):
        return (self.param,) if self.param else ()

    def value_names(self):
        return (self.tensor,) if self.tensor else ()

    def _k_m(self) -> tuple[int, int]:
        k, m = self.operand_shape[-2:]
        return (m, k) if self.transpose else (k, m)

    def infer(self, t):
        k, m = self._k_m()
        if t.rank < 2 or t.shape[-1] != k:
            raise ShapeError(f"multiplies [.., {k}] by [{k}, {m}], got shape {t}")
        if self.tensor is not None and t.rank != len(self.operand_shape) + 1:
            raise ShapeError(f"a batched product needs operands of one rank, got shape {t} and [N, "
                             f"{', '.join(map(str, self.operand_shape))}]")
        return TensorType(t.shape[:-1] + (m,))

    def flops(self, t_in, t_out):
        return 2 * self._k_m()[0] * t_out.sample_numel

    def run(self, x, tensors):
        w = tensors[self.param if self.param is not None else self.tensor].to(x.dtype)
        return torch.matmul(x, w.transpose(-1, -2) if self.transpose else w)

    def describe(self):
        return f"matmul(x, {self.param or self.tensor}{'.T' if self.transpose else ''})"


@dataclass(frozen=True)
class Softmax(Op):
    """softmax / log_softmax over ``dim``; with ``spanned``, over the dims from ``dim`` of those sizes taken as one
    (what a reshape merging them, the softmax and the reshape back compute: kgen.rewrites.softmax_through_reshape)."""

    fn: str = "softmax"
    dim: int = 1
    spanned: tuple = ()  # sizes of the consecutive dims from ``dim`` it normalizes together (none: ``dim`` alone)

    @property
    def op_name(self) -> str:
        return self.fn

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(range(self.dim, self.dim + max(1, len(self.spanned))))

    def infer(self, t):
        return t

    def flops(self, t_in, t_out):
        return 4 * t_in.sample_numel

    def run(self, x, tensors):
        fn = torch.softmax if self.fn == "softmax" else torch.log_softmax
        if not self.spanned:
            return fn(x, self.dim)
        return fn(x.flatten(self.dim, self.dims[-1]), self.dim).unflatten(self.dim, self.spanned)

    def describe(self):
        return f"{self.fn}(dim={self.dim})" if not self.spanned else f"{self.fn}(dims={list(self.dims)})"


@dataclass(frozen=True)
class BatchNorm(Op):
    """nn.BatchNormNd as its forward computes it: in training mode the batch statistics and
    (tracked) the running-statistics update with ``momentum`` (None: the cumulative average);
    in eval mode the running statistics."""

    module: str = "batch_norm"
    num_features: int = 1
    eps: float = 1e-5
    momentum: float | None = 0.1
    affine: bool = True
    track_running_stats: bool = True
    rank: int = 2  # of its input: BatchNorm1d for 2 or 3, 2d for 4, 3d for 5

    @property
    def op_name(self) -> str:
        return "batch_norm"

    def tensor_names(self):
        return (f"{self.module}.weight", f"{self.module}.bias") if self.affine else ()

    def buffer_names(self):
        return (f"{self.module}.running_mean", f"{self.module}.running_var") if self.track_running_stats else ()

    def member(self) -> Member:
        kw = dict(num_features=self.num_features, eps=self.eps, momentum=self.momentum, affine=self.affine,
                  track_running_stats=self.track_running_stats)
        tensors = tuple(TensorArg(n, _ident(n), (self.num_features,)) for n in self.tensor_names())
        buffers = tuple(TensorArg(n, _ident(n), (self.num_features,)) for n in self.buffer_names())
        return Member(self.module, tensors, nn_class=f"BatchNorm{max(1, self.rank - 2)}d", kwargs=tuple(kw.items()),
                      buffers=buffers)

    def infer(self, t):
        if t.rank != self.rank or t.channels != self.num_features:
            raise ShapeError(f"normalizes {self.num_features} channels of a {self.rank}-d input, got shape {t}")
        return t

    def flops(self, t_in, t_out):
        return 8 * t_in.sample_numel

    def run(self, x, tensors):
        """As nn.BatchNorm's forward: in training mode the running statistics in ``tensors`` are
        updated in place (and num_batches_tracked counted, when ``tensors`` has it)."""
        w = tensors[f"{self.module}.weight"] if self.affine else None
        b = tensors[f"{self.module}.bias"] if self.affine else None
        training = getattr(tensors, "training", False)
        rm = rv = None
        factor = 0.0
        if self.track_running_stats:
            rm, rv = (tensors[n] for n in self.buffer_names())
            if training:
                factor = self.count_batch(tensors)
        return F.batch_norm(x, rm, rv, w, b, training or not self.track_running_stats, factor, self.eps)

    def count_batch(self, tensors) -> float:
        """Training mode's step: counts this batch in num_batches_tracked (when ``tensors`` has it)
        and returns the running statistics' update weight."""
        count = tensors.get(f"{self.module}.num_batches_tracked")
        if count is not None:
            count.add_(1)
        return self.factor(count)

    def factor(self, num_batches_tracked) -> float:
        """The running statistics' update weight: momentum, or (momentum None) 1 / the batches
        counted so far, this one included."""
        if self.momentum is not None:
            return self.momentum
        return 1.0 / float(num_batches_tracked) if num_batches_tracked is not None else 0.0

    def describe(self):
        return f"batch_norm(eps={self.eps:g}, momentum={self.momentum}{'' if self.affine else ', affine=False'})"


@dataclass(frozen=True)
class BatchStats(Op):
    """Training-mode batch norm's statistics (kgen.rewrites.batch_norm_batch_stats): the identity on
    its input, which it reads once for the batch's per-channel mean and biased variance over (batch,
    spatial); it makes two tensors for the ops after it, ``mean`` and ``scale`` = weight /
    sqrt(var + eps), which apply the norm as ``(x - mean) * scale + bias``, and (tracked) updates
    the running statistics as ``norm`` does (the unbiased variance, momentum or the cumulative average)."""

    norm: BatchNorm = None

    @property
    def op_name(self) -> str:
        return "batch_stats"

    @property
    def mean(self) -> TensorArg:
        return TensorArg.named(f"{self.norm.module}.batch_mean", (self.norm.num_features,), "float32")

    @property
    def scale(self) -> TensorArg:
        return TensorArg.named(f"{self.norm.module}.batch_scale", (self.norm.num_features,), "float32")

    @property
    def weight(self) -> str | None:
        return self.norm.tensor_names()[0] if self.norm.affine else None

    def tensor_names(self):
        return (self.weight,) if self.weight else ()

    def buffer_names(self):
        return self.norm.buffer_names()

    def made_tensors(self) -> tuple[TensorArg, ...]:
        """The tensors it makes for the ops after it (they take them like parameters)."""
        return (self.mean, self.scale)

    def infer(self, t):
        return self.norm.infer(t)

    def flops(self, t_in, t_out):
        return 3 * t_in.sample_numel

    def run(self, x, tensors):
        """Puts mean and scale into ``tensors``; in training mode updates the running statistics
        there in place as ``norm`` does (and counts num_batches_tracked, when ``tensors`` has it)."""
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // x.shape[1]
        if n <= 1:  # as F.batch_norm refuses it
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}")
        half = x.dtype in HALF_DTYPES  # statistics in float, as ATen's batch norm computes them
        var, mean = torch.var_mean(x.float() if half else x, dim=dims, correction=0)
        if self.norm.track_running_stats and getattr(tensors, "training", False):
            rm, rv = (tensors[b] for b in self.buffer_names())
            factor = self.norm.count_batch(tensors)
            if half:  # each update in float, rounded once (ATen's batch_norm_update_stats)
                rm.copy_(mean * factor + (1 - factor) * rm.float())
                rv.copy_(var * (n / (n - 1)) * factor + (1 - factor) * rv.float())
            else:
                rm.mul_(1 - factor).add_(mean.to(rm.dtype), alpha=factor)
                rv.mul_(1 - factor).add_((var * (n / (n - 1))).to(rv.dtype), alpha=factor)
        tensors[self.mean.name] = mean
        tensors[self.scale.name] = batch_norm_scale(var, tensors[self.weight] if self.weight else None, self.norm.eps)
        return x

    def stand_ins(self, tensors) -> dict:
        """Values for the tensors it makes where a stage after it runs alone (validation's
        per-stage cases): the running statistics' (eval mode's) where it tracks them."""
        if self.norm.track_running_stats:
            mean, var = (tensors[b] for b in self.buffer_names())
        else:  # zero mean, unit variance, on the tensors' device
            device = next((t.device for t in tensors.values() if isinstance(t, torch.Tensor)), None)
            mean = torch.zeros(self.norm.num_features, device=device)
            var = torch.ones(self.norm.num_features, device=device)
        return {self.mean.name: mean.float() if mean.dtype in HALF_DTYPES else mean,
                self.scale.name: batch_norm_scale(var, tensors[self.weight] if self.weight else None, self.norm.eps)}

    def describe(self):
        return f"batch statistics of {self.norm.describe()}"


@dataclass(frozen=True)
class LayerNorm(Op):
    """nn.LayerNorm over the last ``len(normalized_shape)`` dims."""

    module: str = "layer_norm"
    normalized_shape: tuple = (1,)
    eps: float = 1e-5
    affine: bool = True
    bias: bool = True

    @property
    def op_name(self) -> str:
        return "layer_norm"

    def tensor_names(self):
        if not self.affine:
            return ()
        return (f"{self.module}.weight",) + ((f"{self.module}.bias",) if self.bias else ())

    def member(self) -> Member:
        kw = dict(normalized_shape=self.normalized_shape, eps=self.eps, elementwise_affine=self.affine, bias=self.bias)
        tensors = tuple(TensorArg(n, _ident(n), self.normalized_shape) for n in self.tensor_names())
        return Member(self.module, tensors, nn_class="LayerNorm", kwargs=tuple(kw.items()))

    def infer(self, t):
        k = len(self.normalized_shape)
        if t.rank <= k or tuple(t.shape[-k:]) != self.normalized_shape:
            raise ShapeError(f"normalizes the last dims {list(self.normalized_shape)}, got shape {t}")
        return t

    def flops(self, t_in, t_out):
        return 8 * t_in.sample_numel

    def run(self, x, tensors):
        names = self.tensor_names()
        w = tensors[names[0]] if names else None
        b = tensors[names[1]] if len(names) > 1 else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)

    def describe(self):
        return f"layer_norm({list(self.normalized_shape)}, eps={self.eps:g})"


@dataclass(frozen=True)
class Reshape(Op):
    """A view of each sample as ``shape`` (the batch stays in front)."""

    shape: tuple = (1,)

    @property
    def op_name(self) -> str:
        return "reshape"

    def infer(self, t):
        if math.prod(self.shape) != t.sample_numel:
            raise ShapeError(f"cannot view shape {t} as [{t.shape[0]}, {', '.join(map(str, self.shape))}]")
        return TensorType((t.shape[0],) + tuple(self.shape))

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        return x.reshape((x.shape[0],) + tuple(self.shape))

    def describe(self):
        return f"reshape([N, {', '.join(map(str, self.shape))}])"


@dataclass(frozen=True)
class Cat(Op):
    """torch.cat([x, *tensors], dim): the input first, then the named values ``tensors`` in order
    (``pieces``: their types, for the shape rule)."""

    dim: int = 1
    tensors: tuple = ()
    pieces: tuple = ()  # TensorType of each value of ``tensors``

    @property
    def op_name(self) -> str:
        return "cat"

    def value_names(self):
        return tuple(dict.fromkeys(self.tensors))

    def infer(self, t):
        size = t.shape[self.dim] if self.dim < t.rank else 0
        for name, p in zip(self.tensors, self.pieces):
            same = p.rank == t.rank and all(a == b for d, (a, b) in enumerate(zip(p.shape, t.shape)) if d != self.dim)
            if not same or self.dim >= t.rank:
                raise ShapeError(f"cannot concatenate '{name}' {p} to {t} along dim {self.dim}: every other size must "
                                 "be equal")
            size += p.shape[self.dim]
        return TensorType(t.shape[:self.dim] + (size,) + t.shape[self.dim + 1:])

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        return torch.cat([x] + [tensors[n].to(x.dtype) for n in self.tensors], self.dim)

    def describe(self):
        return f"cat([x, {', '.join(self.tensors)}], dim={self.dim})"


@dataclass(frozen=True)
class Permute(Op):
    """x.permute(dims).contiguous() (spec: permute, or transpose of two dims); the batch stays first."""

    kind: str = "permute"  # permute | transpose (how the spec wrote it)
    dims: tuple = (0,)

    @property
    def op_name(self) -> str:
        return self.kind

    def infer(self, t):
        if len(self.dims) != t.rank:
            raise ShapeError(f"permutes {len(self.dims)} dims, got shape {t}")
        return TensorType(tuple(t.shape[d] for d in self.dims))

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        return x.permute(self.dims).contiguous()

    def swapped(self) -> tuple[int, int] | None:
        """The two dims a transpose swaps (None when it is not one)."""
        moved = [d for d, p in enumerate(self.dims) if d != p]
        return (moved[0], moved[1]) if len(moved) == 2 else None

    def describe(self):
        pair = self.swapped()
        if self.kind == "transpose" and pair:
            return f"transpose({pair[0]}, {pair[1]})"
        return f"permute({list(self.dims)})"


@dataclass(frozen=True)
class Slice(Op):
    """x[..., start:end:step] along ``dim`` (not the batch), bounds already within the dim; contiguous."""

    dim: int = 1
    start: int = 0
    end: int = 1
    step: int = 1

    @property
    def op_name(self) -> str:
        return "slice"

    def infer(self, t):
        if self.dim >= t.rank or self.end > t.shape[self.dim]:
            raise ShapeError(f"slice {self.start}:{self.end} along dim {self.dim} does not fit shape {t}")
        n = len(range(self.start, self.end, self.step))
        return TensorType(t.shape[:self.dim] + (n,) + t.shape[self.dim + 1:])

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        return x.narrow(self.dim, self.start, self.end - self.start)[
            (slice(None),) * self.dim + (slice(None, None, self.step),)].contiguous()

    def describe(self):
        step = f":{self.step}" if self.step != 1 else ""
        return f"slice(dim {self.dim}, {self.start}:{self.end}{step})"


@dataclass(frozen=True)
class Pad(Op):
    """F.pad(x, pad, 'constant', value): pad[2i], pad[2i+1] before and after dim -1-i."""

    pad: tuple = (0, 0)
    value: float = 0.0

    @property
    def op_name(self) -> str:
        return "pad"

    def infer(self, t):
        k = len(self.pad) // 2
        if k > t.rank - 1:
            raise ShapeError(f"pads {k} dims of shape {t}; at most {t.rank - 1} (not the batch)")
        shape = list(t.shape)
        for i in range(k):
            d = t.rank - 1 - i
            shape[d] = t.shape[d] + self.pad[2 * i] + self.pad[2 * i + 1]
            if shape[d] < 1:
                raise ShapeError(f"pad {list(self.pad)} leaves nothing of dim {d} of shape {t}")
        return TensorType(tuple(shape))

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        return F.pad(x, self.pad, "constant", self.value)

    def describe(self):
        return f"pad({list(self.pad)}{f', value={self.value:g}' if self.value else ''})"


@dataclass(frozen=True)
class Cumsum(Op):
    """torch.cumsum(x, dim) along ``dim`` (not the batch)."""

    dim: int = 1

    @property
    def op_name(self) -> str:
        return "cumsum"

    def infer(self, t):
        if not 1 <= self.dim < t.rank:
            raise ShapeError(f"cumsum along dim {self.dim} of shape {t}: not a dim after the batch")
        return t

    def flops(self, t_in, t_out):
        return t_in.sample_numel

    def run(self, x, tensors):
        return torch.cumsum(x, self.dim)

    def describe(self):
        return f"cumsum(dim {self.dim})"


@dataclass(frozen=True)
class Interpolate(Op):
    """F.interpolate: ``mode`` nearest or bilinear, to ``size`` (the output's spatial size); where the
    spec gave a scale factor, ``scales`` holds it (PyTorch maps coordinates with it, not with the sizes'
    ratio)."""

    mode: str = "nearest"
    size: tuple = (1,)
    scales: tuple | None = None
    align_corners: bool | None = None

    @property
    def op_name(self) -> str:
        return "interpolate"

    def infer(self, t):
        if len(t.spatial) != len(self.size) or (self.mode == "bilinear" and t.rank != 4):
            need = "a 4-d input (bilinear)" if self.mode == "bilinear" else f"{len(self.size)} spatial dims"
            raise ShapeError(f"{self.mode} interpolation to {list(self.size)} needs {need}, got shape {t}")
        return TensorType(t.shape[:2] + tuple(self.size))

    def flops(self, t_in, t_out):
        return (4 if self.mode == "bilinear" else 0) * t_out.sample_numel

    def run(self, x, tensors):
        if self.scales is not None:
            return F.interpolate(x, scale_factor=self.scales, mode=self.mode, align_corners=self.align_corners)
        return F.interpolate(x, size=self.size, mode=self.mode, align_corners=self.align_corners)

    def describe(self):
        how = f"scale {fmt(self.scales)}" if self.scales is not None else f"size {list(self.size)}"
        corners = ", align_corners" if self.align_corners else ""
        return f"interpolate({self.mode}, {how}{corners})"


@dataclass(frozen=True)
class AdaptivePool(Op):
    """F.adaptive_avg_poolNd / F.adaptive_max_poolNd (the values) to ``output`` (not all 1: that is a Reduce)."""

    kind: str = "avg"
    output: tuple = (1,)

    @property
    def rank(self) -> int:
        return len(self.output)

    @property
    def op_name(self) -> str:
        return f"adaptive_{self.kind}_pool{self.rank}d"

    def infer(self, t):
        _check_rank(t, self.rank, self.op_name)
        return TensorType(t.shape[:2] + tuple(self.output))

    def flops(self, t_in, t_out):
        return t_in.sample_numel

    def run(self, x, tensors):
        fn = getattr(F, self.op_name)
        return fn(x, self.output)

    def describe(self):
        return f"{self.op_name}({fmt(self.output)})"


@dataclass(frozen=True)
class Expand(Op):
    """x.expand(N, *shape).contiguous(): size-1 dims repeated; the batch stays. With ``param``: that
    parameter broadcast over the batch, ``param.expand(N, *shape).contiguous()`` (ViT's class token
    before its cat): the input (the previous result or ``from:``) only gives the batch N."""

    shape: tuple = (1,)
    param: str | None = None  # the parameter expanded instead of the input (its shape checked by the builder)

    @property
    def op_name(self) -> str:
        return "expand"

    def tensor_names(self):
        return (self.param,) if self.param else ()

    def infer(self, t):
        if self.param is not None:
            return TensorType((t.shape[0],) + tuple(self.shape))
        if len(self.shape) != t.rank - 1 or any(s != n and n != 1 for s, n in zip(self.shape, t.shape[1:])):
            raise ShapeError(f"cannot expand shape {t} to [{t.shape[0]}, {', '.join(map(str, self.shape))}]: only "
                             "dims of size 1 grow")
        return TensorType((t.shape[0],) + tuple(self.shape))

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        if self.param is not None:
            return tensors[self.param].to(x.dtype).expand((x.shape[0],) + tuple(self.shape)).contiguous()
        return x.expand((x.shape[0],) + tuple(self.shape)).contiguous()

    def describe(self):
        return f"{self.param or 'x'}.expand([N, {', '.join(map(str, self.shape))}])"


class DropoutError(RuntimeError):
    """Dropout with p > 0 in training mode: random, and kgen does not compute it."""


@dataclass(frozen=True)
class Dropout(Op):
    """nn.Dropout: the identity in eval mode or with p = 0; refused in training mode otherwise."""

    p: float = 0.0

    @property
    def op_name(self) -> str:
        return "dropout"

    def infer(self, t):
        return t

    def flops(self, t_in, t_out):
        return 0

    def run(self, x, tensors):
        if getattr(tensors, "training", False) and self.p > 0:
            raise DropoutError(dropout_refusal(self.p))
        return x

    def describe(self):
        return f"dropout(p={self.p:g}; identity in eval mode)"


def dropout_refusal(p: float) -> str:
    return (f"dropout with p={p:g} in training mode is random and kgen does not compute it; "
            "call model.eval() (or use p=0)")


def fmt(t: tuple) -> str:
    """Sizes for describe(): one number when all are equal, else 2x3x4."""
    return str(t[0]) if len(set(t)) == 1 else "x".join(str(v) for v in t)


# ---------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    init: str | float
    unused: bool = False  # created for the state_dict only


@dataclass(frozen=True)
class Pipeline:
    name: str
    path: str
    input: TensorType  # the first input's type: the ops start from it
    ops: tuple[Op, ...]
    types: tuple[TensorType, ...]  # types[0] is the first input; types[i + 1] op i's result; types[-1] the output
    params: dict = field(default_factory=dict)  # free parameters: name -> Param
    precision: str = "tf32"
    rewrites: dict = field(default_factory=dict)
    intermediates: str = "eager"  # spec `intermediates:`: eager's bits (rounding points, eager_batch_norms) or float32
    conv_layout: str = "auto"
    conv_impl: str = "auto"  # plan.conv: aten | gemm forces who computes the convolutions
    linear_impl: str = "auto"  # plan.linear: aten | gemm forces who computes the matrix products
    conv_norm: str = "auto"  # plan.conv_norm: written | recompute | onepass forces how a generated convolution meets a norm
    example: dict = field(default_factory=dict)
    description: str = ""
    spec: Spec | None = field(default=None, compare=False, repr=False)  # what it was built from
    inputs: dict = field(default_factory=dict)  # every input: name -> TensorType, the first one first
    values: dict = field(default_factory=dict)  # inputs and named results: name -> TensorType
    member_order: tuple = ()  # submodules and parameters in the reference model's creation order
    derived: tuple = ()  # DerivedTensors the ops read (a rewrite made them)
    kept_members: tuple | None = None  # the model's members where a rewrite removed the ops that name them
    # (convolution module, whether eager's cuDNN call for it runs TF32) as `kgen tune` measured them on the
    # render target (kgen.tunefile.eager_conv_tf32); none: the precision rules' defaults (families.base)
    eager_conv_tf32: tuple = ()
    dtypes: tuple = ("float32",)  # the spec's dtypes: the module has plans for each
    dtype: str = "float32"  # the dtype this pipeline's plans compute in (a compile-time parameter, kgen.plan)
    # the values the model returns, in order (spec `outputs:`; the last op's result is always one); ():
    # the last op's result alone
    outputs: tuple[str, ...] = ()

    @property
    def output(self) -> TensorType:
        """The last op's result (the only output, or one of several: ``output_types``)."""
        return self.types[-1]

    @cached_property
    def names_after(self) -> tuple[frozenset[str], ...]:
        """[i]: the op names (kgen.ops.OPS) of the ops after op i (i up to len(ops)). Families ask what follows
        their op once per candidate plan: a scan of the rest of a whole model each time made planning quadratic."""
        out, seen = [frozenset()] * (len(self.ops) + 1), set()
        for i in range(len(self.ops) - 1, -1, -1):
            out[i] = frozenset(seen)
            seen.add(self.ops[i].op_name)
        return tuple(out)

    @cached_property
    def sum_after(self) -> tuple[bool, ...]:
        """[i]: whether a sum or mean reduction comes after op i (i up to len(ops))."""
        out, seen = [False] * (len(self.ops) + 1), False
        for i in range(len(self.ops) - 1, -1, -1):
            out[i] = seen
            seen = seen or (isinstance(self.ops[i], Reduce) and self.ops[i].fn in ("sum", "mean"))
        return tuple(out)

    @cached_property
    def eager_batch_norms(self) -> bool:
        """Whether training mode's batch norms run as eager's ATen call and every convolution before one as eager's
        cuDNN call (NC[D]HW, as written; a softmax before one as ATen's: plan.eager_call_cuts), so that the plan's
        values are eager's bits: a float32 plan (unless the spec's ``intermediates: float32``) where a batch norm
        over batch statistics is followed by a convolution and then another normalization. kgen's own statistics
        (in double) differ from cuDNN's batch norm in the last bit; the next convolution's TF32 rounding turns some
        of those bits into differences of 1e-3 of a value, and the next norm scales them up: ResNet-18 and the basic block (KernelBench level 3, H200) failed
        KernelBench's 1e-4 check against eager 0/5 with kgen's statistics (as far from float64 as eager's) and
        pass 5/5 with eager's calls (docs/performance.md, Precision). A single norm at the end keeps kgen's."""
        if self.dtype != "float32" or self.intermediates == "float32":
            return False
        first = next((i for i, op in enumerate(self.ops) if isinstance(op, BatchNorm)), None)
        if first is None:
            return False
        return any(isinstance(op, Conv) and not self.names_after[j].isdisjoint(NORMALIZATIONS)
                   for j, op in enumerate(self.ops[first + 1:], first + 1))

    @property
    def rounds_between_ops(self) -> bool:
        """Whether each op's result is rounded to the dtype before the next op reads it, as eager's 16-bit
        tensors are (a 16-bit plan, unless the spec's ``intermediates: float32`` keeps float32 between ops)."""
        return self.dtype != "float32" and self.intermediates != "float32"

    @property
    def several_outputs(self) -> bool:
        """Whether the model returns a tuple of tensors (``outputs`` names more than one value)."""
        return len(self.outputs) > 1

    @property
    def output_types(self) -> tuple[TensorType, ...]:
        """The type of each output, in order."""
        return tuple(self.values[n] for n in self.outputs) if self.several_outputs else (self.output,)

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs) or ["x"]

    @property
    def batch_symbol(self) -> str | None:
        b = self.input.shape[0]
        return b if isinstance(b, str) else None

    def example_batch(self) -> int:
        b = self.input.shape[0]
        return self.example.get(b, 1) if isinstance(b, str) else b

    def in_type(self, i: int) -> TensorType:
        """The type of op i's input (its ``src`` value, or the previous op's result)."""
        op = self.ops[i]
        return self.values[op.src] if op.src is not None else self.types[i]

    def one_value_batch_norms(self) -> list[TensorType]:
        """The input types of the batch norms that see one value per channel in a sample ([N, C], [N, C, 1, 1]):
        PyTorch refuses their batch statistics at batch 1 in training mode."""
        return [t for i, op in enumerate(self.ops) if isinstance(op, BatchNorm)
                for t in [self.in_type(i)] if t.sample_numel == t.channels]

    @property
    def training_dependent(self) -> bool:
        """Whether some op computes differently in training and eval mode (batch norm, dropout)."""
        return any(isinstance(op, (BatchNorm, BatchStats, Dropout)) for op in self.ops)

    def with_ops(self, ops) -> "Pipeline":
        """The same pipeline with other ops; shapes are re-inferred and the output must not change."""
        types, values = infer_types(self.input, ops, self.path, self.inputs)
        if types[-1] != self.output:
            raise AssertionError(f"rewrite changed the output type {self.output} -> {types[-1]}")
        for n in self.outputs:
            if values.get(n) != self.values[n]:
                raise AssertionError(f"rewrite changed the output '{n}': {self.values[n]} -> {values.get(n)}")
        return replace(self, ops=tuple(ops), types=types, values=values)

    def members(self) -> list[Member]:
        """Submodules and free parameters in the order a model of the pipeline creates them.

        The reference model's creation order where the spec records it
        (``constructor.members``), else the order of first use in the ops,
        which matches a hand-written model that declares them in forward
        order; either way the same seed gives the same init. Parameters no op
        reads (``unused``) are created too. The reference model instantiates
        these; the generated Model prints them.
        """
        return list(self._members)

    @cached_property
    def _members(self) -> tuple:
        """members(), made once (planning asks for them thousands of times on a whole model)."""
        if self.kept_members is not None:
            return tuple(self.kept_members)
        seen, out = set(), []
        for op in self.ops:
            m = op.member()
            if m is not None and m.attr not in seen:
                seen.add(m.attr)
                out.append(m)
            for name in op.tensor_names():
                if name in self.params and name not in seen:
                    seen.add(name)
                    out.append(self._param_member(name))
        out += [self._param_member(n) for n in self.params if n not in seen]
        if self.member_order:
            rank = {n: i for i, n in enumerate(self.member_order)}
            out.sort(key=lambda m: rank.get(m.attr, len(rank)))  # stable: the rest keep first-use order
        return tuple(out)

    def _param_member(self, name: str) -> Member:
        p = self.params[name]
        return Member(name, (TensorArg.named(name, p.shape),), init=p.init)

    def tensor_args(self) -> list[TensorArg]:
        """Parameter tensors the op reads, in creation order (the functional forward's order)."""
        read = {n for op in self.ops for n in op.tensor_names()} | {n for d in self.derived for n in d.sources}
        return [t for m in self.members() for t in m.tensors if t.name in read]

    def buffer_args(self) -> list[TensorArg]:
        """Running statistics the op reads (and returns updated in training mode), in creation order."""
        return [b for m in self.members() for b in m.buffers]

    def op_signature(self) -> list[str]:
        """The names of the op kgen::NAME's arguments, in order (the one home of that order): the inputs (the
        first is ``x``), ``params`` (the parameters as one list), ``buffers`` (the running statistics as one list,
        where there are some), ``training`` (the mode, where an op computes differently in it) and ``factors``
        (the running statistics' update weights)."""
        names = ["x", *self.input_names[1:], "params"]
        if self.buffer_args():
            names.append("buffers")
        if self.training_dependent:
            names.append("training")
        if self.buffer_args():
            names.append("factors")
        return names

    def op_result(self) -> OpResult:
        """How the op kgen::NAME lays out its result (``OpResult``); ``op_signature`` says its arguments."""
        return OpResult(len(self.output_types), self.several_outputs, tuple(b.name for b in self.buffer_args()))

    def stage_tensors(self) -> list[TensorArg]:
        """Every tensor a stage may take like a parameter: parameters, buffers, derived tensors,
        and the tensors a stage makes for the stages after it (batch statistics)."""
        return list(self._stage_tensors)

    @cached_property
    def _stage_tensors(self) -> tuple:
        made = [a for op in self.ops if isinstance(op, BatchStats) for a in op.made_tensors()]
        return tuple(self.tensor_args() + self.buffer_args() + [d.arg for d in self.derived] + made)

    def derived_sources(self) -> list[str]:
        """The tensors the derived tensors are made from, each once."""
        return list(dict.fromkeys(n for d in self.derived for n in d.sources))

    def updated_buffers(self) -> set[str]:
        """The running statistics some op of the pipeline updates in training mode."""
        return {n for op in self.ops if isinstance(op, (BatchNorm, BatchStats)) for n in op.buffer_names()}

    def with_derived(self, tensors: Mapping) -> dict:
        """``tensors`` (parameters and buffers by state_dict name) and the derived tensors made from them."""
        out = dict(tensors)
        out.update({d.arg.name: d.compute(tensors) for d in self.derived})
        return out

    def with_stage_tensors(self, tensors: Mapping) -> dict:
        """``with_derived``, and stand-ins for the tensors stages make (``BatchStats.stand_ins``):
        every tensor a stage may take, for running a stage alone."""
        out = self.with_derived(tensors)
        for op in self.ops:
            if isinstance(op, BatchStats):
                out.update(op.stand_ins(out))
        return out

    def value_args(self) -> list[str]:
        """Named values some op reads as an operand or input, in the order they are defined."""
        read = {n for op in self.ops for n in op.value_names()} | {op.src for op in self.ops if op.src}
        return [n for n in self.values if n in read]

    def run(self, x: torch.Tensor, tensors: Tensors, inputs: Mapping[str, torch.Tensor] | None = None,
            training: bool = False, record: list | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The ops on ``x`` (the first input; ``inputs`` holds the others by name) with the
        parameters and buffers ``tensors``; ``training`` as a module's mode (batch norm).
        Several outputs come as a tuple in the order of ``outputs``. ``record`` gets each op's result."""
        env = Env(self.with_derived(tensors) if self.derived else tensors)
        env.training = training
        env[self.input_names[0]] = x
        env.update(inputs or {})
        y = run_ops(self.ops, x, env, record)
        return tuple(env[n] for n in self.outputs) if self.several_outputs else y


def run_ops(ops, x: torch.Tensor, env: Env, record: list | None = None) -> torch.Tensor:
    """Run ``ops`` from ``x``; ``env`` holds parameters, buffers and values, and gets the named results;
    ``record`` (a list) each op's result."""
    for op in ops:
        if op.src is not None:
            x = env[op.src]
        x = op.run(x, env)
        if record is not None:
            record.append(x)
        if isinstance(op, Capture):
            env[op.name] = x
    return x


def infer_types(input_type: TensorType, ops, path: str, inputs: dict | None = None):
    """(types, values): types[0] the input, types[i + 1] op i's result; values: the inputs'
    and named results' types by name."""
    values = dict(inputs or {"x": input_type})
    types = [input_type]
    for op in ops:
        t = values[op.src] if op.src is not None else types[-1]
        try:
            t = op.infer(t)
        except ShapeError as e:
            raise SpecError(path, op.key, str(e)) from None
        if isinstance(op, Capture):
            values[op.name] = t
        types.append(t)
    return tuple(types), values


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
        self.values: dict[str, TensorType] = {}  # inputs and named results so far

    def module_name(self, o: OpSpec, default: str) -> str:
        name = o.args["name"] or default
        if name in self.modules:
            hint = "" if o.args["name"] else "; give this op a 'name'"
            raise SpecError(self.path, f"{o.key}.name", f"module name '{name}' is already used by {self.modules[name]}{hint}")
        if name in self.spec.params:
            raise SpecError(self.path, f"{o.key}.name", f"module name '{name}' clashes with the parameter '{name}'")
        if name in self.values:
            raise SpecError(self.path, f"{o.key}.name", f"module name '{name}' clashes with the value '{name}'")
        self.modules[name] = o.key
        return name

    def param(self, o: OpSpec, field: str = "param") -> str | None:
        pname = o.args.get(field)
        if pname:
            if pname not in self.spec.params:
                known = ", ".join(sorted(self.spec.params)) or "none declared"
                raise SpecError(self.path, f"{o.key}.{field}", f"unknown parameter '{pname}' (params: {known})")
            self.used.add(pname)
        return pname

    def value(self, o: OpSpec, name: str | None, field: str) -> TensorType | None:
        if name is None:
            return None
        if name not in self.values:
            known = ", ".join(self.values)
            later = " (it is named later)" if any(x.name == name for x in self.spec.ops) else ""
            raise SpecError(self.path, f"{o.key}.{field}", f"unknown value '{name}'{later}; values so far: {known}")
        return self.values[name]

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
        output = o.args["output_size"]
        if any(s != 1 for s in output):  # an ATen stage (AdaptivePool); output 1 is a reduction that fuses
            return AdaptivePool(key=o.key, kind=entry.variant, output=tuple(output))
        spatial = tuple(range(2, 2 + entry.rank))
        return Reduce(key=o.key, fn="mean" if entry.variant == "avg" else "max", dims=spatial, kept=spatial, origin=o.kind)

    def _dim(self, o: OpSpec, field: str, t: TensorType) -> int:
        """A spec dim of ``t`` (negative from the end), not the batch."""
        d = o.args[field]
        if not -t.rank <= d < t.rank:
            raise SpecError(self.path, f"{o.key}.{field}", f"dimension {d} is out of range for shape {t} (rank {t.rank})")
        if d % t.rank == 0:
            raise SpecError(self.path, f"{o.key}.{field}", f"dim {d} is the batch; kgen keeps the batch first and whole")
        return d % t.rank

    def cat(self, o: OpSpec, entry, t: TensorType) -> Op:
        dim = self._dim(o, "dim", t)
        pieces = tuple(self.value(o, n, f"tensors[{i}]") for i, n in enumerate(o.args["tensors"]))
        return Cat(key=o.key, dim=dim, tensors=tuple(o.args["tensors"]), pieces=pieces)

    def permute(self, o: OpSpec, entry, t: TensorType) -> Op:
        if o.kind == "transpose":
            a, b = self._dim(o, "dim0", t), self._dim(o, "dim1", t)
            dims = list(range(t.rank))
            dims[a], dims[b] = b, a
            return Permute(key=o.key, kind="transpose", dims=tuple(dims))
        given = o.args["dims"]
        if len(given) != t.rank or not all(-t.rank <= d < t.rank for d in given):
            raise SpecError(self.path, f"{o.key}.dims", f"{list(given)} is not a permutation of the {t.rank} dims of {t}")
        dims = tuple(d % t.rank for d in given)
        if sorted(dims) != list(range(t.rank)):
            raise SpecError(self.path, f"{o.key}.dims", f"{list(given)} is not a permutation of the {t.rank} dims of {t}")
        if dims[0] != 0:
            raise SpecError(self.path, f"{o.key}.dims", f"{list(given)} moves the batch; dims[0] must be 0")
        return Permute(key=o.key, kind="permute", dims=dims)

    def slice(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        dim = self._dim(o, "dim", t)
        start, end, step = slice(a["start"], a["end"], a["step"]).indices(t.shape[dim])
        if len(range(start, end, step)) < 1:
            raise SpecError(self.path, o.key, f"slice {a['start']}:{a['end']} of dim {dim} of {t} is empty")
        return Slice(key=o.key, dim=dim, start=start, end=max(end, start), step=step)

    def pad(self, o: OpSpec, entry, t: TensorType) -> Op:
        pad = o.args["pad"]
        if len(pad) // 2 > t.rank - 1:
            raise SpecError(self.path, f"{o.key}.pad", f"{list(pad)} pads {len(pad) // 2} dims of {t}; at most "
                            f"{t.rank - 1} (the batch is not padded)")
        return Pad(key=o.key, pad=tuple(pad), value=o.args["value"])

    def cumsum(self, o: OpSpec, entry, t: TensorType) -> Op:
        return Cumsum(key=o.key, dim=self._dim(o, "dim", t))

    def interpolate(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        r = len(t.spatial)
        if r < 1 or r > 3 or (a["mode"] == "bilinear" and r != 2):
            need = "a 4-d input" if a["mode"] == "bilinear" else "1 to 3 spatial dims"
            raise SpecError(self.path, o.key, f"{a['mode']} interpolation needs {need}, got shape {t}")
        field = "size" if a["size"] is not None else "scale_factor"
        given = a[field]
        if len(given) not in (1, r):
            raise SpecError(self.path, f"{o.key}.{field}", f"expected one value or {r}, got {list(given)}")
        given = tuple(given) * (r // len(given))
        if field == "size":
            size, scales = given, None
        else:  # PyTorch's output size: floor(L * scale) in double
            size, scales = tuple(int(math.floor(float(L) * s)) for L, s in zip(t.spatial, given)), given
            if any(n < 1 for n in size):
                raise SpecError(self.path, f"{o.key}.scale_factor", f"scales {t} to nothing (spatial size {list(size)})")
        align = a["align_corners"] if a["mode"] == "bilinear" else None
        return Interpolate(key=o.key, mode=a["mode"], size=size, scales=scales,
                           align_corners=bool(align) if align is not None else (False if a["mode"] == "bilinear" else None))

    def expand(self, o: OpSpec, entry, t: TensorType) -> Op:
        shape = o.args["shape"]
        pname = self.param(o)
        if pname:  # the parameter broadcast over the input's batch: torch's expand rule against [N, *shape]
            pshape = tuple(self.spec.params[pname].shape)
            lead = len(shape) + 1 - len(pshape)  # new dims in front of the parameter's (the batch's among them)
            sample, ok = [], lead >= 0
            for i, s in enumerate(shape, start=1):
                p = pshape[i - lead] if ok and i >= lead else None
                ok = ok and (s != -1 or p is not None) and (p is None or s in (-1, p) or p == 1)
                sample.append(p if s == -1 else s)
            if not ok or (lead == 0 and pshape[0] != 1):
                raise SpecError(self.path, f"{o.key}.shape", f"cannot expand parameter '{pname}' {list(pshape)} to "
                                f"[{t.shape[0]}, {', '.join(map(str, shape))}]: its dims align with the last ones, each of "
                                "size 1 or the size given (-1 keeps it); where it has the batch's place its size there is 1")
            return Expand(key=o.key, shape=tuple(sample), param=pname)
        if len(shape) != t.rank - 1:
            raise SpecError(self.path, f"{o.key}.shape", f"{list(shape)} has {len(shape)} dims; a sample of {t} has "
                            f"{t.rank - 1} (the batch stays first)")
        shape = tuple(n if s == -1 else s for s, n in zip(shape, t.shape[1:]))
        if any(s != n and n != 1 for s, n in zip(shape, t.shape[1:])):
            raise SpecError(self.path, f"{o.key}.shape", f"cannot expand {t} to [{t.shape[0]}, "
                            f"{', '.join(map(str, shape))}]: only dims of size 1 grow")
        return Expand(key=o.key, shape=shape)

    def elementwise(self, o: OpSpec, entry: ElementwiseOp, t: TensorType) -> Op:
        a = o.args
        pname = self.param(o)
        view = ()
        if pname:
            pshape = self.spec.params[pname].shape
            if a.get("view") is not None:
                view = _resolve_view(a["view"], math.prod(pshape), f"{o.key}.view", self.path, f"parameter '{pname}'")
                pshape = view
            _check_broadcast(pshape, t, f"{o.key}.param", self.path, pname)
        tensor = a.get("tensor")
        vt = self.value(o, tensor, "tensor")
        if vt is not None:
            _check_value_broadcast(vt, t, f"{o.key}.tensor", self.path, tensor)
        consts = tuple(a[name] for name, _ in entry.consts)
        return Elementwise(key=o.key, fn=o.kind, consts=consts, scalar=a.get("scalar"), param=pname, param_view=view,
                           tensor=tensor, reverse=a.get("reverse", False))

    def reduce(self, o: OpSpec, entry, t: TensorType) -> Op:
        dims = _norm_dims(o.args["dim"], t, o.key, self.path)
        return Reduce(key=o.key, fn=o.kind, dims=dims, kept=dims if o.args["keepdim"] else ())

    def norm(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        if t.rank < 3 and o.kind == "instance_norm":
            raise SpecError(self.path, o.key, f"instance_norm needs a 3- to 5-d input, got shape {t}")
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

    def linear(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        if o.kind == "linear":
            return Linear(key=o.key, module=self.module_name(o, "linear"), in_features=t.shape[-1],
                          out_features=a["out_features"], bias=a["bias"])
        pname = self.param(o)
        if pname:
            shape = self.spec.params[pname].shape
            if len(shape) != 2:
                raise SpecError(self.path, f"{o.key}.param", f"parameter '{pname}' of shape {list(shape)} is not 2-d")
        else:
            vt = self.value(o, a["tensor"], "tensor")
            if vt.shape[0] != t.shape[0]:
                raise SpecError(self.path, f"{o.key}.tensor", f"value '{a['tensor']}' {vt} has another batch than {t}")
            shape = vt.shape[1:]
            if len(shape) < 2:
                raise SpecError(self.path, f"{o.key}.tensor", f"value '{a['tensor']}' {vt} has no matrix per sample")
        return Matmul(key=o.key, param=pname, tensor=a["tensor"], transpose=a["transpose"], operand_shape=tuple(shape))

    def softmax(self, o: OpSpec, entry, t: TensorType) -> Op:
        (dim,) = _norm_dims((o.args["dim"],), t, f"{o.key}", self.path)
        return Softmax(key=o.key, fn=o.kind, dim=dim)

    def batch_norm(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        if t.rank < 2:
            raise SpecError(self.path, o.key, f"batch_norm needs a 2- to 5-d input, got shape {t}")
        return BatchNorm(key=o.key, module=self.module_name(o, "batch_norm"), num_features=t.channels, eps=a["eps"],
                         momentum=a["momentum"], affine=a["affine"], track_running_stats=a["track_running_stats"],
                         rank=t.rank)

    def layer_norm(self, o: OpSpec, entry, t: TensorType) -> Op:
        a = o.args
        if -1 in a["normalized_shape"]:
            raise SpecError(self.path, f"{o.key}.normalized_shape", "sizes must be positive")
        return LayerNorm(key=o.key, module=self.module_name(o, "layer_norm"), normalized_shape=a["normalized_shape"],
                         eps=a["eps"], affine=a["elementwise_affine"], bias=a["bias"])

    def reshape(self, o: OpSpec, entry, t: TensorType) -> Op:
        shape = _resolve_view(o.args["shape"], t.sample_numel, f"{o.key}.shape", self.path, f"a sample of {t}")
        return Reshape(key=o.key, shape=shape)

    def dropout(self, o: OpSpec, entry, t: TensorType) -> Op:
        return Dropout(key=o.key, p=o.args["p"])


def _resolve_view(shape: tuple, numel: int, key: str, path: str, what: str) -> tuple[int, ...]:
    """``shape`` with its -1 filled in, for ``numel`` elements."""
    known = math.prod(v for v in shape if v != -1)
    if -1 in shape:
        if numel % known:
            raise SpecError(path, key, f"cannot view {what} ({numel} elements) as {list(shape)}")
        shape = tuple(numel // known if v == -1 else v for v in shape)
    if math.prod(shape) != numel:
        raise SpecError(path, key, f"cannot view {what} ({numel} elements) as {list(shape)}")
    return tuple(shape)


def _check_value_broadcast(vt: TensorType, t: TensorType, key, path, name):
    """A value operand: the activation's rank and batch, each other size equal or 1."""
    if vt.rank != t.rank or vt.shape[0] != t.shape[0] or any(v not in (1, n) for v, n in zip(vt.shape[1:], t.shape[1:])):
        raise SpecError(path, key, f"value '{name}' of shape {vt} does not broadcast to the activation {t}")


def build_pipeline(spec: Spec) -> Pipeline:
    """Spec -> Pipeline with inferred types; semantic errors name the op's key."""
    path = spec.path
    b = _Builder(spec)
    inputs = {}
    for i in spec.inputs or ():
        ti = TensorType(i.shape)
        _check_bounds(None, ti, ti, f"{i.key}.shape", path)
        inputs[i.name] = ti
    if not inputs:
        inputs = {"x": TensorType(spec.input_shape)}
    for name in inputs:
        if name in spec.params:
            raise SpecError(path, f"params.{name}", f"parameter '{name}' has the name of an input")
    b.values = dict(inputs)
    t = next(iter(inputs.values()))
    for p in spec.params.values():
        if math.prod(p.shape) > max_elements():
            raise SpecError(path, f"{p.key}.shape", f"{math.prod(p.shape)} elements; at most {max_elements()} "
                            "(KGEN_MAX_ELEMENTS) are allowed")
    ops, types = [], [t]
    for o in spec.ops:
        entry = OPS[o.kind]
        t_in = b.value(o, o.src, "from") if o.src is not None else t
        op = getattr(b, entry.role)(o, entry, t_in)
        if o.src is not None:
            op = replace(op, src=o.src)
        try:
            t = op.infer(t_in)
        except ShapeError as e:
            raise SpecError(path, o.key, str(e)) from None
        _check_bounds(op, t_in, t, o.key, path)
        ops.append(op)
        types.append(t)
        if o.name is not None:
            for taken, what in ((b.values, "value"), (spec.params, "parameter"), (b.modules, "module")):
                if o.name in taken:
                    raise SpecError(path, f"{o.key}.as", f"'{o.name}' is already the name of a {what}")
            ops.append(Capture(key=f"{o.key}.as", name=o.name))
            types.append(t)
            b.values[o.name] = t

    for name, p in spec.params.items():
        if name not in b.used and not p.unused:
            raise SpecError(path, p.key, f"parameter '{name}' is declared but no op uses it (mark it `unused: true` "
                            "to create it for the state_dict only)")
        if name in b.used and p.unused:
            raise SpecError(path, f"{p.key}.unused", f"parameter '{name}' is marked unused but an op reads it")
    known = set(b.modules) | set(spec.params)
    _check_member_paths(b.modules, spec.params, path)
    for i, m in enumerate(spec.members):
        if m not in known:
            raise SpecError(path, f"constructor.members[{i}]", f"'{m}' is neither a submodule nor a parameter of the ops")
    pipe = Pipeline(
        name=spec.name,
        path=path,
        input=types[0],
        ops=tuple(ops),
        types=tuple(types),
        params={n: Param(n, p.shape, p.init, p.unused) for n, p in spec.params.items()},
        precision=spec.precision,
        intermediates=spec.intermediates,
        rewrites=dict(spec.rewrites),
        conv_layout=spec.conv_layout,
        conv_impl=spec.conv_impl,
        conv_norm=spec.conv_norm,
        linear_impl=spec.linear_impl,
        example=dict(spec.example),
        description=spec.description,
        spec=spec,
        inputs=inputs,
        values=dict(b.values),
        member_order=tuple(spec.members),
        dtypes=spec.dtypes,
        dtype=spec.dtypes[0],
        outputs=_check_outputs(spec, inputs, b.values, ops),
    )
    held = {t.name for m in pipe.members() for t in m.tensors + m.buffers}
    for i in spec.init:
        if i.member not in held:
            raise SpecError(path, f"{i.key}.member", f"'{i.member}' is not a parameter or running statistic of the "
                            "model's members")
    idents = {n: f"input '{n}'" for n in inputs}
    idents.setdefault("x", "x")
    for arg in pipe.tensor_args() + pipe.buffer_args() + [TensorArg(v, v, ()) for v in pipe.values if v not in inputs]:
        if arg.ident in idents:
            raise SpecError(path, "params", f"parameter names '{arg.name}' and '{idents[arg.ident]}' collide as '{arg.ident}'")
        idents[arg.ident] = arg.name
    return pipe


def _check_outputs(spec: Spec, inputs: dict, values: dict, ops: list) -> tuple[str, ...]:
    """The spec's ``outputs:``: each a value an op computes (an input returned unchanged is refused:
    the op's outputs may not alias its arguments), the last op's result among them (ops after the
    last output would compute nothing the model returns)."""
    path = spec.path
    for i, name in enumerate(spec.outputs):
        key = f"outputs[{i}]"
        if name in inputs:
            raise SpecError(path, key, f"'{name}' is an input; an output is a value an op computes (an input "
                            "returned unchanged is not supported)")
        if name not in values:
            named = [n for n in values if n not in inputs]
            raise SpecError(path, key, f"unknown value '{name}'; the values named with `as:` are: "
                            f"{', '.join(named) if named else 'none'}")
    if spec.outputs:
        last = ops[-1]
        if not (isinstance(last, Capture) and last.name in spec.outputs):
            o = spec.ops[-1]
            raise SpecError(path, "outputs", f"the last op's result ({o.key}) is not an output: name it with `as:` and "
                            "list it, or remove the ops after the last output (they compute nothing the model returns)")
    return spec.outputs


def _check_member_paths(modules: dict, params: dict, path: str) -> None:
    """Submodules and parameters are leaves of the model's tree: no member lies inside another
    (a parameter ``conv.scale`` inside the submodule ``conv``), since the model builds the
    containers of a path (``layer1``, ``layer1.0``) as plain modules."""
    members = {m: (f"{modules[m]}.name", "submodule") for m in modules}
    members.update({n: (p.key, "parameter") for n, p in params.items()})
    for name, (key, what) in members.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            outer = ".".join(parts[:i])
            if outer in members:
                raise SpecError(path, key, f"{what} '{name}' lies inside the {members[outer][1]} '{outer}'; "
                                "members of a nested model are leaves of its tree")


def load_pipeline(path) -> Pipeline:
    return build_pipeline(load_spec(path))
