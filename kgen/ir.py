"""The pipeline IR: typed ops, PyTorch's shape rules, and a torch implementation of each op.

``Op.run`` is the semantics of an op in eager PyTorch. The reference model
(``kgen.reference``) is the spec's ops run through it in float64, and the
rewrite tests compare a rewritten pipeline with the original through it, so a
rewritten op (a folded or sub-pixel convolution, a reduction with a summed
parameter) carries its own ``run`` that computes the rewritten arithmetic.

Shapes are ``(batch, channels, *spatial)``; the batch may be a run-time symbol
(a string), everything else is a compile-time constant.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch
import torch.nn.functional as F

from .errors import SpecError
from .spec import MAX_SIZE, Spec, load_spec, max_elements

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


def _conv_out(L, k, s, p, d):
    return (L + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_out(L, k, s, p, d, ceil_mode):
    """PyTorch's pooling output size (pooling_output_shape in ATen)."""
    num = L + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = num // s + 1
    if ceil_mode and (out - 1) * s >= L + p:
        out -= 1
    return out


def _spatial_rank(kind: str) -> int:
    return int(kind[-2])


def _check_rank(t: TensorType, rank: int, kind: str):
    if len(t.spatial) != rank:
        raise ShapeError(f"{kind} needs a {rank + 2}-d input (batch, channels, {rank} spatial), got shape {t}")


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class Op:
    key: str  # where it came from in the spec, e.g. "ops[1].max_pool3d"

    def infer(self, t: TensorType) -> TensorType:
        raise NotImplementedError

    def run(self, x: torch.Tensor, tensors: Tensors) -> torch.Tensor:
        raise NotImplementedError

    def tensor_names(self) -> tuple[str, ...]:
        """Names of the parameters (state_dict keys) this op reads."""
        return ()

    def flops(self, t_in: TensorType, t_out: TensorType) -> int:
        """Floating-point operations per sample (multiply-adds count 2)."""
        return t_in.sample_numel

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Conv(Op):
    """convNd / conv_transposeNd. ``lowering`` says how it is computed:

    - ``direct``: one ATen convolution, as written.
    - ``folded``: ``fold_kernel``/``fold_stride`` name an average pool folded into
      the weights (box-filtered kernel, multiplied stride).
    - ``subpixel``: a transposed convolution computed as stride^d ordinary
      convolutions, one per output phase (see ``subpixel_phases``).

    ``crop`` (dead-region rewrite) is the prefix of the output, per spatial dim,
    that consumers read; only that region is computed.
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
    lowering: str = "direct"
    bias_deferred: bool = False  # the next fused stage adds the bias (plan step)
    fold_kernel: tuple | None = None
    fold_stride: tuple | None = None
    crop: tuple | None = None

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

    def module_ctor(self) -> tuple[str, dict]:
        """The torch.nn class and keyword arguments of the reference model's submodule."""
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
        return cls, kw

    # -- geometry
    def full_out(self, L: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size of the convolution as written (no rewrite)."""
        if self.transposed:
            return tuple(
                (l - 1) * s - 2 * p + d * (k - 1) + op + 1
                for l, k, s, p, d, op in zip(L, self.kernel, self.stride, self.padding, self.dilation, self.output_padding)
            )
        return tuple(_conv_out(*a) for a in zip(L, self.kernel, self.stride, self.padding, self.dilation))

    def eff_kernel(self) -> tuple[int, ...]:
        """Kernel extent of the convolution that is actually run (folded: box-widened)."""
        if self.lowering == "folded":
            return tuple((kp - 1) * s + k for k, s, kp in zip(self.kernel, self.stride, self.fold_kernel))
        return self.kernel

    def eff_stride(self) -> tuple[int, ...]:
        if self.lowering == "folded":
            return tuple(s * sp for s, sp in zip(self.stride, self.fold_stride))
        return self.stride

    def computed_out(self, L: tuple[int, ...]) -> tuple[int, ...]:
        """Logical output size after the lowering (folded pools shrink it)."""
        if self.lowering == "folded":
            return tuple(
                _conv_out(l, k, s, p, 1) for l, k, s, p in zip(L, self.eff_kernel(), self.eff_stride(), self.padding)
            )
        return self.full_out(L)

    def input_extent(self, L: tuple[int, ...]) -> tuple[int, ...]:
        """The prefix of the input that the cropped output needs (direct/folded); at least
        one element, also when the kept outputs read only padding."""
        if self.crop is None:
            return tuple(L)
        return tuple(
            max(1, min(l, (e - 1) * s - p + d * (k - 1) + 1))
            for l, e, k, s, p, d in zip(L, self.crop, self.eff_kernel(), self.eff_stride(), self.padding, self.dilation)
        )

    def infer(self, t):
        _check_rank(t, self.rank, self.kind)
        if t.channels != self.in_channels:
            raise ShapeError(f"expects {self.in_channels} input channels, got shape {t}")
        if self.out_channels % self.groups or self.in_channels % self.groups:
            raise ShapeError(
                f"groups={self.groups} must divide in_channels ({self.in_channels}) and out_channels ({self.out_channels})"
            )
        if self.transposed and any(op >= max(s, d) for op, s, d in zip(self.output_padding, self.stride, self.dilation)):
            raise ShapeError("output_padding must be smaller than stride or dilation")
        out = self.computed_out(t.spatial)
        if any(o < 1 for o in out):
            raise ShapeError(f"output would be empty: input {t} gives spatial size {list(out)}")
        if self.crop is not None:
            out = self.crop
        return TensorType((t.shape[0], self.out_channels) + tuple(out))

    def flops(self, t_in, t_out):
        if self.lowering == "subpixel":
            taps = sum(
                math.prod(ph.taps) * math.prod(ph.count) for ph in subpixel_phases(self, t_in.spatial)
            )
            return 2 * taps * self.out_channels * self.in_channels // self.groups
        if self.transposed:
            return 2 * t_in.sample_numel * self.out_channels // self.groups * math.prod(self.kernel)
        per_out = 2 * self.in_channels // self.groups * math.prod(self.eff_kernel())
        return per_out * t_out.sample_numel

    # -- torch semantics
    def fold_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Box-filter the kernel: w'[u] = mean over pool taps t of w[u - t*stride]."""
        kp = self.fold_kernel
        co, ci = w.shape[:2]
        box = torch.full((1, 1) + kp, 1.0 / math.prod(kp), dtype=w.dtype, device=w.device)
        conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.rank - 1]
        wf = conv_t(w.reshape((co * ci, 1) + self.kernel), box, dilation=self.stride)
        return wf.reshape((co, ci) + self.eff_kernel())

    def run(self, x, tensors):
        w = tensors[self.weight_name]
        b = tensors[self.bias_name] if self.bias and not self.bias_deferred else None
        if self.lowering == "subpixel":
            return self._run_subpixel(x, w, b)
        if self.crop is not None:
            for d, e in enumerate(self.input_extent(tuple(x.shape[2:]))):
                x = x.narrow(2 + d, 0, e)
        if self.transposed:
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.rank - 1]
            y = fn(x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation)
        else:
            fn = (F.conv1d, F.conv2d, F.conv3d)[self.rank - 1]
            if self.lowering == "folded":
                w = self.fold_weight(w)
            y = fn(x, w, b, self.eff_stride(), self.padding, self.dilation, self.groups)
        if self.crop is not None:
            for d, e in enumerate(self.crop):
                y = y.narrow(2 + d, 0, e)
        return y

    def _run_subpixel(self, x, w, b):
        L = tuple(x.shape[2:])
        phases = subpixel_phases(self, L)
        out_size = self.crop or self.full_out(L)
        y = x.new_empty((x.shape[0], self.out_channels) + tuple(out_size))
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.rank - 1]
        xin = x
        for d, e in enumerate(phases[0].input_extent):
            xin = xin.narrow(2 + d, 0, e)
        for ph in phases:
            yp = conv(xin, ph.weight(w), b, 1, ph.padding)
            index = [slice(None), slice(None)]
            for d in range(self.rank):
                yp = yp.narrow(2 + d, ph.offset[d], ph.count[d])
                index.append(slice(ph.residue[d], None, self.stride[d]))
            y[tuple(index)] = yp
        return y

    def describe(self):
        args = f"{self.in_channels}->{self.out_channels}, k={_fmt(self.kernel)}"
        if any(s != 1 for s in self.stride):
            args += f", s={_fmt(self.stride)}"
        if any(self.padding):
            args += f", p={_fmt(self.padding)}"
        if any(d != 1 for d in self.dilation):
            args += f", dilation={_fmt(self.dilation)}"
        if self.transposed and any(self.output_padding):
            args += f", output_padding={_fmt(self.output_padding)}"
        if self.groups != 1:
            args += f", groups={self.groups}"
        text = f"{self.kind}({args})"
        if self.lowering == "folded":
            text += f" folded with avg_pool(k={_fmt(self.fold_kernel)}) -> k={_fmt(self.eff_kernel())}, s={_fmt(self.eff_stride())}"
        if self.lowering == "subpixel":
            text += f" as {math.prod(self.stride)} sub-pixel conv{self.rank}d"
        if self.crop is not None:
            text += f", computing only the first {_fmt(self.crop)}"
        if self.bias_deferred:
            text += ", bias added by the next stage"
        return text


@dataclass(frozen=True)
class SubpixelPhase:
    """One output phase of a transposed convolution, as an ordinary convolution.

    Output positions o = stride*m + residue (per dim), m < count, equal
    ``conv(x[:input_extent], weight, padding)[offset + m]`` where ``weight`` is the
    flipped kernel sampled every stride taps from ``weight_start``.
    """

    residue: tuple[int, ...]
    taps: tuple[int, ...]
    weight_start: tuple[int, ...]  # into the flipped kernel, step = stride
    padding: tuple[int, ...]
    offset: tuple[int, ...]  # first used position of the phase conv's output
    count: tuple[int, ...]  # outputs of this phase that are used
    conv_out: tuple[int, ...]  # full size of the phase conv's output
    input_extent: tuple[int, ...]  # prefix of the input all phases read
    stride: tuple[int, ...]

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """(Cin, Cout, K...) transposed-conv weight -> (Cout, Cin, T...) phase conv weight."""
        rank = len(self.taps)
        wf = w.flip(tuple(range(2, 2 + rank)))
        index = [slice(None), slice(None)] + [
            slice(st, st + s * (t - 1) + 1, s) for st, s, t in zip(self.weight_start, self.stride, self.taps)
        ]
        return wf[tuple(index)].transpose(0, 1)


def subpixel_phases(conv: Conv, L: tuple[int, ...]) -> list[SubpixelPhase]:
    """Split conv_transpose (stride s, padding p, kernel K) into s^d ordinary convolutions.

    Per dim, output o = s*m + r receives the taps k = k0 + s*t (k0 = (r+p) mod s)
    from inputs i = m + c - t with c = (r+p-k0)/s; as a cross-correlation this is
    kernel W_r[j] = w[k0 + s*(T-1-j)] over inputs m + (c-T+1) + j.
    """
    E = conv.crop or conv.full_out(L)
    per_dim = []  # per dim: list over residues of dicts
    extent = []
    for l, e, k, s, p in zip(L, E, conv.kernel, conv.stride, conv.padding):
        rows = []
        for r in range(s):
            k0 = (r + p) % s
            taps = len(range(k0, k, s))
            c = (r + p - k0) // s
            off = c - taps + 1
            count = -(-(e - r) // s)
            rows.append(dict(r=r, k0=k0, taps=taps, off=off, count=count, start=k - 1 - k0 - s * (taps - 1)))
        need = max(row["count"] - 1 + row["off"] + row["taps"] - 1 for row in rows) + 1
        extent.append(min(l, need))
        per_dim.append(rows)
    phases = []
    for combo in itertools.product(*per_dim):
        pad, offset, conv_out = [], [], []
        for row, l in zip(combo, extent):
            last = row["count"] - 1 + row["off"] + row["taps"] - 1
            P = max(0, -row["off"], last - (l - 1))
            pad.append(P)
            offset.append(row["off"] + P)
            conv_out.append(l + 2 * P - row["taps"] + 1)
        phases.append(
            SubpixelPhase(
                residue=tuple(r["r"] for r in combo),
                taps=tuple(r["taps"] for r in combo),
                weight_start=tuple(r["start"] for r in combo),
                padding=tuple(pad),
                offset=tuple(offset),
                count=tuple(r["count"] for r in combo),
                conv_out=tuple(conv_out),
                input_extent=tuple(extent),
                stride=conv.stride,
            )
        )
    return phases


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
        args = f"k={_fmt(self.kernel)}"
        if self.stride != self.kernel:
            args += f", s={_fmt(self.stride)}"
        if any(self.padding):
            args += f", p={_fmt(self.padding)}"
        if self.kind == "max" and any(d != 1 for d in self.dilation):
            args += f", dilation={_fmt(self.dilation)}"
        if self.ceil_mode:
            args += ", ceil_mode"
        if self.kind == "avg" and any(self.padding) and not self.count_include_pad:
            args += ", count_include_pad=False"
        return f"{self.kind}_pool{self.rank}d({args})"


UNARY = ("relu", "sigmoid", "clamp")
BINARY = ("add", "sub", "mul", "div")


@dataclass(frozen=True)
class Elementwise(Op):
    """relu, sigmoid, clamp, or add/sub/mul/div by a scalar or a broadcast parameter.

    ``param_sum_dims`` (reduction algebra): the parameter enters summed over these
    dims of the activation (e.g. ``(1,)``: sum over channels of a per-channel bias).
    """

    fn: str = "relu"
    scalar: float | None = None
    param: str | None = None
    lo: float | None = None
    hi: float | None = None
    param_sum_dims: tuple = ()
    param_rank: int = 0  # activation rank that param_sum_dims refer to
    param_view: tuple = ()  # shape to view the parameter as (a conv bias [C] as [C, 1, 1])
    param_sum_scale: int = 1  # times the summed parameter counts (it broadcasts along summed dims)

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
        if self.fn == "relu":
            return torch.relu(x)
        if self.fn == "sigmoid":
            return torch.sigmoid(x)
        if self.fn == "clamp":
            return torch.clamp(x, self.lo, self.hi)
        other = self.scalar if self.param is None else self.aligned_param(tensors[self.param], x.dim())
        return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[self.fn](x, other)

    def describe(self):
        if self.fn == "clamp":
            return f"clamp({self.lo}, {self.hi})"
        if self.fn in UNARY:
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

    def tensor_names(self):
        return (f"{self.module}.weight", f"{self.module}.bias") if self.affine else ()

    def module_ctor(self, rank: int) -> tuple[str, dict]:
        if self.kind == "group_norm":
            return "GroupNorm", dict(num_groups=self.num_groups, num_channels=self.num_channels, eps=self.eps, affine=self.affine)
        return f"InstanceNorm{rank}d", dict(num_features=self.num_channels, eps=self.eps, affine=self.affine)

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


def _fmt(t: tuple) -> str:
    return str(t[0]) if len(set(t)) == 1 else "x".join(str(v) for v in t)


# ---------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    init: str


@dataclass(frozen=True)
class TensorArg:
    """A parameter tensor the op takes: state_dict name, C/Python identifier, shape."""

    name: str  # "conv.weight"
    ident: str  # "conv_weight"
    shape: tuple[int, ...]


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

    def creation_order(self) -> list[tuple[str, object]]:
        """Submodules and free parameters in the order the reference model creates them.

        The order of first use in the ops; it matches a hand-written model that
        declares them in forward order, so the same seed gives the same init.
        """
        seen, order = set(), []
        for op in self.ops:
            if isinstance(op, (Conv, Norm)) and op.module not in seen:
                seen.add(op.module)
                order.append(("module", op))
            for name in op.tensor_names():
                if name in self.params and name not in seen:
                    seen.add(name)
                    order.append(("param", self.params[name]))
        return order

    def tensor_args(self) -> list[TensorArg]:
        """Parameter tensors of the op, in creation order (the functional forward's order)."""
        args = []
        for kind, item in self.creation_order():
            if kind == "param":
                args.append(TensorArg(item.name, item.name, item.shape))
                continue
            for name in item.tensor_names():
                if isinstance(item, Conv):
                    shape = item.weight_shape() if name.endswith(".weight") else (item.out_channels,)
                else:
                    shape = (item.num_channels,)
                args.append(TensorArg(name, name.replace(".", "_"), shape))
        return args

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


_DEFAULT_MODULE = {"conv": "conv", "conv_transpose": "conv_transpose", "group_norm": "group_norm", "instance_norm": "instance_norm"}


def build_pipeline(spec: Spec) -> Pipeline:
    """Spec -> Pipeline with inferred types; semantic errors name the op's key."""
    path = spec.path
    t = TensorType(spec.input_shape)
    _check_bounds(None, t, t, "input.shape", path)
    for p in spec.params.values():
        if math.prod(p.shape) > max_elements():
            raise SpecError(path, f"{p.key}.shape", f"{math.prod(p.shape)} elements; at most {max_elements()} "
                            "(KGEN_MAX_ELEMENTS) are allowed")
    ops, types, modules, used = [], [t], {}, set()

    def module_name(o, default):
        name = o.args["name"] or default
        if name in modules:
            hint = "" if o.args["name"] else "; give this op a 'name'"
            raise SpecError(path, f"{o.key}.name", f"module name '{name}' is already used by {modules[name]}{hint}")
        if name in spec.params:
            raise SpecError(path, f"{o.key}.name", f"module name '{name}' clashes with the parameter '{name}'")
        modules[name] = o.key
        return name

    for o in spec.ops:
        a, kind = o.args, o.kind
        if kind.startswith("conv"):
            base = "conv_transpose" if "transpose" in kind else "conv"
            op = Conv(
                key=o.key,
                kind=kind,
                module=module_name(o, _DEFAULT_MODULE[base]),
                in_channels=t.channels,
                out_channels=a["out_channels"],
                kernel=a["kernel_size"],
                stride=a["stride"],
                padding=a["padding"],
                dilation=a["dilation"],
                output_padding=a.get("output_padding") or (0,) * len(a["kernel_size"]),
                groups=a["groups"],
                bias=a["bias"],
            )
        elif kind.startswith(("max_pool", "avg_pool")):
            op = Pool(
                key=o.key,
                kind=kind[:3],
                kernel=a["kernel_size"],
                stride=a["stride"] or a["kernel_size"],
                padding=a["padding"],
                dilation=a.get("dilation") or (1,) * len(a["kernel_size"]),
                ceil_mode=a["ceil_mode"],
                count_include_pad=a.get("count_include_pad", True),
                sources=(o.key,),
            )
        elif kind.startswith("adaptive_avg_pool"):
            rank = _spatial_rank(kind)
            try:
                _check_rank(t, rank, kind)
            except ShapeError as e:
                raise SpecError(path, o.key, str(e)) from None
            spatial = tuple(range(2, 2 + rank))
            op = Reduce(key=o.key, fn="mean", dims=spatial, kept=spatial, origin=kind)
        elif kind in UNARY or kind in BINARY:
            if a.get("param"):
                pname = a["param"]
                if pname not in spec.params:
                    known = ", ".join(sorted(spec.params)) or "none declared"
                    raise SpecError(path, f"{o.key}.param", f"unknown parameter '{pname}' (params: {known})")
                _check_broadcast(spec.params[pname].shape, t, f"{o.key}.param", path, pname)
                used.add(pname)
            op = Elementwise(
                key=o.key, fn=kind, scalar=a.get("scalar"), param=a.get("param"), lo=a.get("min"), hi=a.get("max")
            )
        elif kind in ("sum", "mean", "max"):
            dims = _norm_dims(a["dim"], t, o.key, path)
            op = Reduce(key=o.key, fn=kind, dims=dims, kept=dims if a["keepdim"] else ())
        elif kind in ("group_norm", "instance_norm"):
            op = Norm(
                key=o.key,
                kind=kind,
                module=module_name(o, _DEFAULT_MODULE[kind]),
                num_groups=a["num_groups"] if kind == "group_norm" else t.channels,
                num_channels=t.channels,
                eps=a["eps"],
                affine=a["affine"],
            )
        else:  # pragma: no cover - the spec loader only lets known kinds through
            raise SpecError(path, o.key, f"op {kind!r} has no IR")
        try:
            t = op.infer(t)
        except ShapeError as e:
            raise SpecError(path, o.key, str(e)) from None
        _check_bounds(op, types[-1], t, o.key, path)
        ops.append(op)
        types.append(t)

    for name, p in spec.params.items():
        if name not in used:
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
