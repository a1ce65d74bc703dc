"""How a convolution is computed: the rewrites decide it, the conv implementations carry it out.

The IR's ``Conv`` says what is computed (the convolution as written). A
rewritten pipeline holds a ``LoweredConv`` instead: the same ``Conv`` with

- a ``lowering``, one of ``Direct`` (as written), ``Folded`` (an average pool
  folded into box-filtered weights with a multiplied stride) and ``Subpixel``
  (a strided transposed convolution as stride^d ordinary phase convolutions),
  each with its own geometry and its own float64 ``run``;
- ``crop`` (dead-region rewrite): the prefix of the output, per spatial dim,
  that consumers read; only that region is computed;
- ``bias_deferred`` (a plan step): the next fused stage adds the bias.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .ir import Conv, Member, Op, TensorType, conv_out, fmt


@dataclass(frozen=True)
class Direct:
    """One convolution with the op's own geometry (transposed or not)."""

    name: ClassVar[str] = "direct"

    def kernel(self, conv: Conv) -> tuple[int, ...]:
        """Kernel extent of the convolution that is run."""
        return conv.kernel

    def stride(self, conv: Conv) -> tuple[int, ...]:
        return conv.stride

    def weight(self, conv: Conv, w: torch.Tensor) -> torch.Tensor:
        return w

    def out_size(self, conv: Conv, L: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size for input ``L``, before any crop."""
        return conv.out_size(L)

    def can_crop(self, conv: Conv) -> bool:
        return not conv.transposed  # a transposed convolution computes everything

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
            for l, e, k, s, p, d in zip(L, crop, self.kernel(conv), self.stride(conv), conv.padding, conv.dilation)
        )

    def physical_out(self, conv: Conv, L: tuple[int, ...], crop: tuple | None) -> tuple[int, ...]:
        """Spatial size the convolution produces from the input prefix it reads (at least
        the crop, which is a view of it)."""
        return self.out_size(conv, self.input_extent(conv, L, crop) if crop else L)

    def run(self, conv: Conv, x, w, b, crop):
        if crop is not None:
            for d, e in enumerate(self.input_extent(conv, tuple(x.shape[2:]), crop)):
                x = x.narrow(2 + d, 0, e)
        y = conv.apply(x, self.weight(conv, w), b, self.stride(conv))
        if crop is not None:
            for d, e in enumerate(crop):
                y = y.narrow(2 + d, 0, e)
        return y

    def flops(self, conv: Conv, t_in: TensorType, t_out: TensorType, crop: tuple | None) -> int:
        if conv.transposed:
            return conv.flops(t_in, t_out)
        return 2 * conv.in_channels // conv.groups * math.prod(self.kernel(conv)) * t_out.sample_numel

    def describe(self, conv: Conv) -> str:
        return ""


@dataclass(frozen=True)
class Folded(Direct):
    """conv then avg_pool as one convolution: w'[u] = mean over pool taps t of
    w[u - t*stride], kernel (Kp-1)*s + K, stride s*sp. Needs no dilation."""

    name: ClassVar[str] = "folded"
    pool_kernel: tuple = ()
    pool_stride: tuple = ()

    def kernel(self, conv):
        return tuple((kp - 1) * s + k for k, s, kp in zip(conv.kernel, conv.stride, self.pool_kernel))

    def stride(self, conv):
        return tuple(s * sp for s, sp in zip(conv.stride, self.pool_stride))

    def weight(self, conv, w):
        """Box-filter the kernel, as a transposed convolution of w with a box."""
        kp = self.pool_kernel
        co, ci = w.shape[:2]
        box = torch.full((1, 1) + kp, 1.0 / math.prod(kp), dtype=w.dtype, device=w.device)
        conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[conv.rank - 1]
        wf = conv_t(w.reshape((co * ci, 1) + conv.kernel), box, dilation=conv.stride)
        return wf.reshape((co, ci) + self.kernel(conv))

    def out_size(self, conv, L):
        return tuple(conv_out(l, k, s, p, 1) for l, k, s, p in zip(L, self.kernel(conv), self.stride(conv), conv.padding))

    def describe(self, conv):
        return f" folded with avg_pool(k={fmt(self.pool_kernel)}) -> k={fmt(self.kernel(conv))}, s={fmt(self.stride(conv))}"


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


DIRECT = Direct()


@dataclass(frozen=True)
class LoweredConv(Op):
    """A convolution (``conv``, as written) and how it is computed."""

    conv: Conv = None
    lowering: Direct | Subpixel = DIRECT
    crop: tuple | None = None
    bias_deferred: bool = False  # the next fused stage adds the bias (plan step)

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

    def infer(self, t):
        self.conv.check_input(t)
        out = self.conv.output_type(t, self.lowering.out_size(self.conv, t.spatial))
        return out if self.crop is None else TensorType(out.shape[:2] + tuple(self.crop))

    def flops(self, t_in, t_out):
        return self.lowering.flops(self.conv, t_in, t_out, self.crop)

    def run(self, x, tensors):
        c = self.conv
        b = tensors[c.bias_name] if c.bias and not self.bias_deferred else None
        return self.lowering.run(c, x, tensors[c.weight_name], b, self.crop)

    def describe(self):
        text = self.conv.describe() + self.lowering.describe(self.conv)
        if self.crop is not None:
            text += f", computing only the first {fmt(self.crop)}"
        if self.bias_deferred:
            text += ", bias added by the next stage"
        return text


def lowered(op: Op) -> LoweredConv | None:
    """A convolution op as a LoweredConv (a plain Conv is the direct lowering); None for other ops."""
    if isinstance(op, LoweredConv):
        return op
    if isinstance(op, Conv):
        return LoweredConv(key=op.key, conv=op)
    return None
