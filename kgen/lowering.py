"""How a convolution is computed: the rewrites decide it, the conv implementations carry it out.

The IR's ``Conv`` says what is computed (the convolution as written). A
rewritten pipeline holds a ``LoweredConv`` instead: the same ``Conv`` with

- a ``lowering``, one of ``Direct`` (as written), ``Folded`` (an average pool
  folded into box-filtered weights: a convolution with a multiplied stride, or
  for a transposed convolution an ordinary one with stride pool / stride) and
  ``Subpixel`` (a strided transposed convolution as stride^d ordinary phase
  convolutions), each with its own geometry and its own float64 ``run``;
- ``crop`` (dead-region rewrite): the prefix of the output, per spatial dim,
  that consumers read; only that region is computed;
- ``bias_deferred`` (a plan step): the next fused stage adds the bias.

A matrix product whose output features are only summed in windows is a
``PooledProduct``: the product with its weight rows summed (rewrites.pool_into_linear).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .cexpr import braces
from .ir import BLOCK_ELEMENTS, Conv, Linear, Matmul, Member, Op, TensorType, conv_out, fmt


class WrittenGeometry:
    """The geometry of the convolution that is run, as the op writes it (a lowering overrides what it changes)."""

    def kernel(self, conv: Conv) -> tuple[int, ...]:
        """Kernel extent of the convolution that is run."""
        return conv.kernel

    def stride(self, conv: Conv) -> tuple[int, ...]:
        return conv.stride

    def padding(self, conv: Conv) -> tuple[int, ...]:
        return conv.padding

    def dilation(self, conv: Conv) -> tuple[int, ...]:
        return conv.dilation

    def transposed(self, conv: Conv) -> bool:
        """Whether the convolution that is run is a transposed one."""
        return conv.transposed

    def runtime_weight(self, conv: Conv, src: str) -> str:
        """The C++ expression (kgen_runtime.h) that makes ``weight`` from the parameter ``src`` in a generated binding."""
        return src


@dataclass(frozen=True)
class Direct(WrittenGeometry):
    """One convolution with the op's own geometry (transposed or not)."""

    name: ClassVar[str] = "direct"

    def weight(self, conv: Conv, w: torch.Tensor) -> torch.Tensor:
        return w

    def out_size(self, conv: Conv, L: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size for input ``L``, before any crop."""
        return conv.out_size(L)

    def can_crop(self, conv: Conv) -> bool:
        return not self.transposed(conv)  # a transposed convolution computes everything

    def min_kept(self, conv: Conv) -> tuple[int, ...]:
        """The smallest crop that still computes what the lowering needs, per dim."""
        return (1,) * conv.rank

    def input_extent(self, conv: Conv, L: tuple[int, ...], crop: tuple | None) -> tuple[int, ...]:
        """The prefix of the input that the (cropped) output needs; at least one element,
        also when the kept outputs read only padding."""
        if crop is None:
            return tuple(L)
        return tuple(
            max(1, min(l, (e - 1) * s - p + d * (k - 1) + 1))
            for l, e, k, s, p, d in zip(L, crop, self.kernel(conv), self.stride(conv), self.padding(conv), self.dilation(conv))
        )

    def physical_out(self, conv: Conv, L: tuple[int, ...], crop: tuple | None) -> tuple[int, ...]:
        """Spatial size the convolution produces from the input prefix it reads (at least
        the crop, which is a view of it)."""
        return self.out_size(conv, self.input_extent(conv, L, crop) if crop else L)

    def run(self, conv: Conv, x, w, b, crop):
        if crop is not None:
            for d, e in enumerate(self.input_extent(conv, tuple(x.shape[2:]), crop)):
                x = x.narrow(2 + d, 0, e)
        w = self.weight(conv, w)
        if self.transposed(conv):
            y = conv.apply(x, w, b)
        else:
            fn = (F.conv1d, F.conv2d, F.conv3d)[conv.rank - 1]
            y = fn(x, w, b, self.stride(conv), self.padding(conv), self.dilation(conv), conv.groups)
        if crop is not None:
            for d, e in enumerate(crop):
                y = y.narrow(2 + d, 0, e)
        return y

    def flops(self, conv: Conv, t_in: TensorType, t_out: TensorType, crop: tuple | None) -> int:
        if self.transposed(conv):
            return conv.flops(t_in, t_out)
        return 2 * conv.in_channels // conv.groups * math.prod(self.kernel(conv)) * t_out.sample_numel

    def describe(self, conv: Conv) -> str:
        return ""


@dataclass(frozen=True)
class Folded(Direct):
    """conv then avg_pool (non-overlapping windows of kp) as one ordinary convolution.

    Forward: w'[u] = mean over pool taps t of w[u - t*stride], kernel (kp-1)*s + K,
    stride s*sp (any pool stride). Transposed (stride s, padding p, kp a multiple of s,
    pool stride = kp): pooled output j = mean over u < kp of y[kp*j + u] reads inputs
    i = (kp/s)*j + e with weight w'[e] = (1/kp) * sum over u < kp of w[u + p - s*e]
    (w zero outside [0, K)), so it is a convolution with stride kp/s over the taps
    e_min..e_max where some w[u + p - s*e] exists, padded by -e_min (TransposedFold).
    Needs no dilation."""

    name: ClassVar[str] = "folded"
    pool_kernel: tuple = ()
    pool_stride: tuple = ()

    def folds(self, conv) -> list["TransposedFold"]:
        """Per dim, the folded geometry of a transposed convolution."""
        return [TransposedFold.of(k, s, p, kp) for k, s, p, kp in zip(conv.kernel, conv.stride, conv.padding, self.pool_kernel)]

    def kernel(self, conv):
        if conv.transposed:
            return tuple(f.taps for f in self.folds(conv))
        return tuple((kp - 1) * s + k for k, s, kp in zip(conv.kernel, conv.stride, self.pool_kernel))

    def stride(self, conv):
        if conv.transposed:
            return tuple(kp // s for s, kp in zip(conv.stride, self.pool_kernel))
        return tuple(s * sp for s, sp in zip(conv.stride, self.pool_stride))

    def padding(self, conv):
        if conv.transposed:
            return tuple(f.padding for f in self.folds(conv))
        return conv.padding

    def dilation(self, conv):
        return (1,) * conv.rank

    def transposed(self, conv):
        return False

    def weight(self, conv, w):
        """The box-filtered kernel as (Cout, Cin / groups, kernel...): forward, w'[u] = mean over pool
        taps t of w[u - t*stride]; transposed, window sums of w, flipped, one every stride taps.
        Plain fp32 additions (kgen_runtime.h's fold_avg_pool_weight does the same on the device)."""
        kp = self.pool_kernel
        if not conv.transposed:
            return shifted_sum(w, kp, conv.stride) / math.prod(kp)
        sums = shifted_sum(w, kp, (1,) * conv.rank).flip(tuple(range(2, 2 + conv.rank)))
        index = [slice(None), slice(None)] + [slice(f.start, f.start + s * (f.taps - 1) + 1, s) for f, s in zip(self.folds(conv), conv.stride)]
        return (sums[tuple(index)] / math.prod(kp)).transpose(0, 1)

    def runtime_weight(self, conv, src):
        kp = braces(self.pool_kernel)
        if not conv.transposed:
            return f"kgen::fold_avg_pool_weight({src}, {kp}, {braces(conv.stride)})"
        starts = braces(f.start for f in self.folds(conv))
        return f"kgen::fold_avg_pool_transposed_weight({src}, {kp}, {braces(conv.stride)}, {starts}, {braces(self.kernel(conv))})"

    def out_size(self, conv, L):
        return tuple(conv_out(l, k, s, p, 1) for l, k, s, p in zip(L, self.kernel(conv), self.stride(conv), self.padding(conv)))

    def describe(self, conv):
        return f" folded with avg_pool(k={fmt(self.pool_kernel)}) -> conv k={fmt(self.kernel(conv))}, s={fmt(self.stride(conv))}" + (
            f", p={fmt(self.padding(conv))}" if conv.transposed and any(self.padding(conv)) else "")


def shifted_sum(w: torch.Tensor, copies: tuple, step: tuple) -> torch.Tensor:
    """Per spatial dim d of w (N, C, K...): the sum of copies[d] copies of w, copy t shifted by
    t * step[d] (K + (copies - 1) * step taps)."""
    out = w
    for d, (n, st) in enumerate(zip(copies, step)):
        K = out.shape[2 + d]
        acc = out.new_zeros(out.shape[: 2 + d] + (K + (n - 1) * st,) + out.shape[3 + d :])
        for t in range(n):
            acc.narrow(2 + d, t * st, K).add_(out)
        out = acc
    return out


@dataclass(frozen=True)
class TransposedFold:
    """One dim of a transposed convolution (kernel K, stride s, padding p) folded with an average
    pool of kp = a multiple of s: taps e_min..e_max of the ordinary convolution, its padding
    -e_min, and where its taps start in the flipped window sums of w (one every s)."""

    taps: int
    padding: int
    start: int

    @staticmethod
    def of(K: int, s: int, p: int, kp: int) -> "TransposedFold":
        e_min = -((K - 1 - p) // s)  # ceil((p - K + 1) / s): the first e with some w[u + p - s*e]
        e_max = (p + kp - 1) // s
        # shifted_sum(w, kp, 1)[m] = sum over u < kp of w[m - kp + 1 + u]: w'[e] (m = p - s*e + kp - 1) is,
        # counted from the far end, at K - 1 - p + s*e
        return TransposedFold(taps=e_max - e_min + 1, padding=-e_min, start=K - 1 - p + s * e_min)


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


@dataclass(frozen=True)
class Subpixel:
    """A transposed convolution (groups 1, no dilation or output_padding, stride <= kernel)
    as stride^d ordinary convolutions, one per output phase, each with only its own taps."""

    name: ClassVar[str] = "subpixel"

    def transposed(self, conv: Conv) -> bool:
        return False  # each phase is an ordinary convolution

    def runtime_weight(self, conv: Conv, src: str) -> str:
        return src  # the phases read the transposed convolution's own weight

    def phases(self, conv: Conv, L: tuple[int, ...], crop: tuple | None) -> list[SubpixelPhase]:
        """Split conv_transpose (stride s, padding p, kernel K) into s^d ordinary convolutions.

        Per dim, output o = s*m + r receives the taps k = k0 + s*t (k0 = (r+p) mod s)
        from inputs i = m + c - t with c = (r+p-k0)/s; as a cross-correlation this is
        kernel W_r[j] = w[k0 + s*(T-1-j)] over inputs m + (c-T+1) + j.
        """
        E = crop or conv.out_size(L)
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
            pad, offset, out = [], [], []
            for row, l in zip(combo, extent):
                last = row["count"] - 1 + row["off"] + row["taps"] - 1
                P = max(0, -row["off"], last - (l - 1))
                pad.append(P)
                offset.append(row["off"] + P)
                out.append(l + 2 * P - row["taps"] + 1)
            phases.append(
                SubpixelPhase(
                    residue=tuple(r["r"] for r in combo),
                    taps=tuple(r["taps"] for r in combo),
                    weight_start=tuple(r["start"] for r in combo),
                    padding=tuple(pad),
                    offset=tuple(offset),
                    count=tuple(r["count"] for r in combo),
                    conv_out=tuple(out),
                    input_extent=tuple(extent),
                    stride=conv.stride,
                )
            )
        return phases

    def out_size(self, conv, L):
        return conv.out_size(L)

    def can_crop(self, conv):
        return True

    def min_kept(self, conv):
        return conv.stride  # every phase keeps at least one output

    def input_extent(self, conv, L, crop):
        return self.phases(conv, L, crop)[0].input_extent

    def physical_out(self, conv, L, crop):
        return crop or conv.out_size(L)  # the phases compute exactly the kept outputs

    def run(self, conv, x, w, b, crop):
        L = tuple(x.shape[2:])
        phases = self.phases(conv, L, crop)
        y = x.new_empty((x.shape[0], conv.out_channels) + tuple(crop or conv.out_size(L)))
        fn = (F.conv1d, F.conv2d, F.conv3d)[conv.rank - 1]
        xin = x
        for d, e in enumerate(phases[0].input_extent):
            xin = xin.narrow(2 + d, 0, e)
        for ph in phases:
            yp = fn(xin, ph.weight(w), b, 1, ph.padding)
            index = [slice(None), slice(None)]
            for d in range(conv.rank):
                yp = yp.narrow(2 + d, ph.offset[d], ph.count[d])
                index.append(slice(ph.residue[d], None, conv.stride[d]))
            y[tuple(index)] = yp
        return y

    def flops(self, conv, t_in, t_out, crop):
        taps = sum(math.prod(ph.taps) * math.prod(ph.count) for ph in self.phases(conv, t_in.spatial, crop))
        return 2 * taps * conv.out_channels * conv.in_channels // conv.groups

    def describe(self, conv):
        return f" as {math.prod(conv.stride)} sub-pixel conv{conv.rank}d"


@dataclass(frozen=True)
class TapSums(WrittenGeometry):
    """A convolution whose output is only summed over the spatial dims ``dims`` (keepdim): the sum of
    y[o] over those dims is, per kernel tap k, w[k] times the sum of the inputs tap k reads. So the
    input is reduced first, to one partial sum per tap along each summed dim (the ranges below), and
    a convolution of those sums (taps as extra input channels) runs over the other dims with the
    written geometry; the bias counts once per summed position. Groups 1; a transposed convolution
    without dilation, a forward one with stride 1 along the summed dims (each tap then reads one
    contiguous range of the input). The convolution of the sums runs in fp32: its inputs are sums
    of many values, whose relative error TF32 would keep where the written convolution's averages out."""

    name: ClassVar[str] = "tap_sums"
    dims: tuple = ()  # summed spatial dims, 0-based, increasing

    def rest(self, conv: Conv) -> tuple[int, ...]:
        """The spatial dims the convolution of the sums runs over."""
        return tuple(d for d in range(conv.rank) if d not in self.dims)

    def ranges(self, conv: Conv, L: tuple[int, ...]) -> list[list[tuple[int, int]]]:
        """Per summed dim, per tap k: the input range [lo, hi) whose values tap k multiplies into
        some output position (empty: lo >= hi)."""
        out = conv.out_size(L)
        result = []
        for d in self.dims:
            l, lo_out, k_n, s, p, dl = L[d], out[d], conv.kernel[d], conv.stride[d], conv.padding[d], conv.dilation[d]
            taps = []
            for k in range(k_n):
                if conv.transposed:  # o = s*i - p + k in [0, lo_out)
                    lo, hi = -((k - p) // s), (lo_out - 1 + p - k) // s + 1
                else:  # stride 1: i = o - p + dl*k
                    lo, hi = dl * k - p, dl * k - p + lo_out
                taps.append((max(0, lo), min(l, hi)))
            result.append(taps)
        return result

    def rest_geometry(self, conv: Conv) -> dict[str, tuple[int, ...]]:
        """stride, padding, dilation and output_padding of the convolution of the sums (the other dims)."""
        rest = self.rest(conv)
        return {k: tuple(getattr(conv, k)[d] for d in rest) if k != "output_padding" or conv.transposed else (0,) * len(rest)
                for k in ("stride", "padding", "dilation", "output_padding")}

    def aten_calls(self, conv: Conv, L: tuple[int, ...]) -> int:
        """Kernel launches kgen_runtime.h's tap_sum_convolution makes (the cost model): per summed dim a
        sum per segment of the taps' ranges and their cat, per tap one sum over its run of segments (none
        for a run of one, a zero for an empty one), a cat; then the product or convolution, the bias
        scaling and adds, and copies to contiguous."""
        calls = 4
        for d, taps in zip(self.dims, self.ranges(conv, L)):
            cuts = sorted({0, L[d]} | {min(max(v, 0), L[d]) for r in taps for v in r})
            segments = list(zip(cuts, cuts[1:]))
            runs = [sum(lo <= a and b <= hi for a, b in segments) for lo, hi in taps]
            calls += len(segments) + (len(segments) > 1) + sum(r != 1 for r in runs) + 1
        return calls

    def count(self, conv: Conv, L: tuple[int, ...]) -> int:
        """Output positions summed per (sample, channel, other position)."""
        out = conv.out_size(L)
        return math.prod(out[d] for d in self.dims)

    def weight(self, conv: Conv, w: torch.Tensor) -> torch.Tensor:
        """The convolution of the sums' weight: the summed dims' taps moved into the input channels,
        ([Cin * taps, Cout, K_rest...] transposed, [Cout, Cin * taps, K_rest...] forward)."""
        rank, rest = conv.rank, self.rest(conv)
        order = [0] + [2 + d for d in self.dims] + [1] + [2 + d for d in rest] if conv.transposed else (
            [0, 1] + [2 + d for d in self.dims] + [2 + d for d in rest])
        wp = w.permute(order)
        taps = math.prod(conv.kernel[d] for d in self.dims)
        if conv.transposed:
            return wp.reshape((w.shape[0] * taps, w.shape[1]) + tuple(conv.kernel[d] for d in rest))
        return wp.reshape((w.shape[0], w.shape[1] * taps) + tuple(conv.kernel[d] for d in rest))

    def out_size(self, conv: Conv, L: tuple[int, ...]) -> tuple[int, ...]:
        out = conv.out_size(L)
        return tuple(1 if d in self.dims else n for d, n in enumerate(out))

    def can_crop(self, conv: Conv) -> bool:
        return False

    def input_extent(self, conv: Conv, L: tuple[int, ...], crop) -> tuple[int, ...]:
        return tuple(L)

    def physical_out(self, conv: Conv, L: tuple[int, ...], crop) -> tuple[int, ...]:
        return self.out_size(conv, L)

    def run(self, conv: Conv, x, w, b, crop):
        L = tuple(x.shape[2:])
        t = x
        for d, taps in zip(self.dims, self.ranges(conv, L)):
            sums = [t.narrow(2 + d, lo, hi - lo).sum(2 + d, keepdim=True) if hi > lo else
                    torch.zeros_like(t.narrow(2 + d, 0, 1)) for lo, hi in taps]
            t = torch.cat(sums, dim=2 + d)
        rest = self.rest(conv)
        n = x.shape[0]
        t = t.permute([0, 1] + [2 + d for d in self.dims] + [2 + d for d in rest])
        t = t.reshape((n, -1) + tuple(t.shape[2 + len(self.dims):]))
        wr = self.weight(conv, w)
        bias = None if b is None else b * self.count(conv, L)
        if rest:
            pick = lambda v: tuple(v[d] for d in rest)  # noqa: E731
            if conv.transposed:
                fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[len(rest) - 1]
                y = fn(t, wr, bias, pick(conv.stride), pick(conv.padding), pick(conv.output_padding), 1, pick(conv.dilation))
            else:
                fn = (F.conv1d, F.conv2d, F.conv3d)[len(rest) - 1]
                y = fn(t, wr, bias, pick(conv.stride), pick(conv.padding), pick(conv.dilation))
        else:  # every spatial dim summed: a matrix product over (Cin, taps)
            w2 = wr.reshape(wr.shape[:2])
            y = t.reshape(n, -1) @ (w2 if conv.transposed else w2.t())
            if bias is not None:
                y = y + bias
        return y.reshape((n, conv.out_channels) + self.out_size(conv, L))

    def flops(self, conv: Conv, t_in: TensorType, t_out: TensorType, crop) -> int:
        rest_out = math.prod(t_out.spatial)  # the summed dims are 1
        return 2 * conv.in_channels * conv.out_channels * math.prod(conv.kernel) * rest_out + t_in.sample_numel

    def describe(self, conv: Conv) -> str:
        return f" summed over dims {[2 + d for d in self.dims]}: a convolution of the input's per-tap sums"


DIRECT = Direct()


@dataclass(frozen=True)
class LoweredConv(Op):
    """A convolution (``conv``, as written) and how it is computed."""

    conv: Conv = None
    lowering: Direct | Subpixel | TapSums = DIRECT
    crop: tuple | None = None
    bias_deferred: bool = False  # the next fused stage adds the bias (plan step)
    # on CUDA only (a 16-bit plan: ATen's CPU call adds it inside, as eager's does; Elementwise.cuda_only)
    bias_deferred_on_cuda: bool = False

    @property
    def op_name(self) -> str:
        return self.conv.kind

    @property
    def kernel(self) -> tuple[int, ...]:
        """Kernel extent of the (dense) convolution that is run."""
        return self.lowering.kernel(self.conv)

    @property
    def stride(self) -> tuple[int, ...]:
        return self.lowering.stride(self.conv)

    @property
    def padding(self) -> tuple[int, ...]:
        return self.lowering.padding(self.conv)

    @property
    def dilation(self) -> tuple[int, ...]:
        return self.lowering.dilation(self.conv)

    @property
    def transposed(self) -> bool:
        """Whether the convolution that is run is a transposed one (as written, not in sub-pixel or folded form)."""
        return self.lowering.transposed(self.conv)

    def tensor_names(self):
        return self.conv.tensor_names()

    def member(self) -> Member:
        return self.conv.member()

    def input_extent(self, L: tuple[int, ...]) -> tuple[int, ...]:
        """The prefix of the input that is read."""
        return self.lowering.input_extent(self.conv, L, self.crop)

    def physical_out(self, L: tuple[int, ...]) -> tuple[int, ...]:
        return self.lowering.physical_out(self.conv, L, self.crop)

    def phases(self, L: tuple[int, ...]) -> list[SubpixelPhase]:
        return self.lowering.phases(self.conv, L, self.crop)

    def runtime_weight(self, src: str) -> str:
        return self.lowering.runtime_weight(self.conv, src)

    def infer(self, t):
        self.conv.check_input(t)
        out = self.conv.output_type(t, self.lowering.out_size(self.conv, t.spatial))
        return out if self.crop is None else TensorType(out.shape[:2] + tuple(self.crop))

    def flops(self, t_in, t_out):
        return self.lowering.flops(self.conv, t_in, t_out, self.crop)

    def run(self, x, tensors):
        c = self.conv
        deferred = self.bias_deferred and not (self.bias_deferred_on_cuda and x.device.type != "cuda")
        b = tensors[c.bias_name] if c.bias and not deferred else None
        return self.lowering.run(c, x, tensors[c.weight_name], b, self.crop)

    def describe(self):
        text = self.conv.describe() + self.lowering.describe(self.conv)
        if self.crop is not None:
            text += f", computing only the first {fmt(self.crop)}"
        if self.bias_deferred:
            text += ", bias added by the next stage" + (" (on CUDA; on the CPU by ATen's call)" if self.bias_deferred_on_cuda else "")
        return text


def lowered(op: Op) -> LoweredConv | None:
    """A convolution op as a LoweredConv (a plain Conv is the direct lowering); None for other ops."""
    if isinstance(op, LoweredConv):
        return op
    if isinstance(op, Conv):
        return LoweredConv(key=op.key, src=op.src, conv=op)
    return None


@dataclass(frozen=True)
class PooledProduct(Op):
    """A matrix product (``Linear``, or ``Matmul`` with a parameter) whose output features are only
    summed, ``window`` consecutive ones at a time (the last ``features % window`` dropped): the sum of
    a window's outputs is the product with the window's weight rows summed (and its biases), so the
    product runs with ``features // window`` outputs. The generated binding derives the summed weight
    and bias once per parameter version (kgen::WeightCache)."""

    product: Linear | Matmul = None
    window: int = 1

    @property
    def op_name(self) -> str:
        return self.product.op_name

    @property
    def features(self) -> int:
        """Output features of the product as written."""
        p = self.product
        return p.out_features if isinstance(p, Linear) else p._k_m()[1]

    @property
    def weight_name(self) -> str:
        p = self.product
        return f"{p.module}.weight" if isinstance(p, Linear) else p.param

    @property
    def feature_dim(self) -> int:
        """The weight's dim that holds the output features: rows of a Linear's [out, in] weight (or of a
        transposed matmul operand), columns of a matmul operand [in, out]."""
        p = self.product
        return 0 if isinstance(p, Linear) or p.transpose else 1

    def tensor_names(self):
        return self.product.tensor_names()

    def member(self) -> Member | None:
        return self.product.member()

    def infer(self, t):
        out = self.product.infer(t)
        return TensorType(out.shape[:-1] + (self.features // self.window,))

    def window_sums(self, w: torch.Tensor, dim: int, dtype) -> torch.Tensor:
        """``w`` (as ``dtype``) summed over windows along ``dim``, a block of windows at a time (a
        float32 weight too large to hold in float64 whole)."""
        groups = self.features // self.window
        other = w.numel() // max(1, w.shape[dim])
        step = max(1, BLOCK_ELEMENTS // max(1, other * self.window))
        parts = []
        for g in range(0, groups, step):
            n = min(step, groups - g)
            block = w.narrow(dim, g * self.window, n * self.window).to(dtype)
            shape = list(block.shape)
            shape[dim : dim + 1] = [n, self.window]
            parts.append(block.reshape(shape).sum(dim + 1))
        return torch.cat(parts, dim=dim)

    def run(self, x, tensors):
        p = self.product
        w = self.window_sums(tensors[self.weight_name], self.feature_dim, x.dtype)
        if isinstance(p, Linear):
            b = self.window_sums(tensors[f"{p.module}.bias"], 0, x.dtype) if p.bias else None
            return F.linear(x, w, b)
        return torch.matmul(x, w.transpose(-1, -2) if p.transpose else w)

    def flops(self, t_in, t_out):
        return 2 * t_in.shape[-1] * t_out.sample_numel

    def describe(self):
        groups = self.features // self.window
        summed = "rows" if self.feature_dim == 0 else "columns"
        if groups == 1:
            return f"{self.product.describe()} summed over its outputs: the product with its weight's {summed} summed (one output)"
        return f"{self.product.describe()} summed in windows of {self.window} outputs: the product with its weight's {summed} summed ({groups} outputs)"
