"""conv_aten: a convolution stage run by ATen (cuDNN on the GPU) from the generated binding.

One implementation of the conv stage (``kgen.stage.ConvStage``), in every
lowering: direct (also transposed), folded (the box-filtered weight is made at
run time) and sub-pixel (one ATen convolution per phase, each writing its own
tile, which the next fused stage reads in place). It narrows its input to the
prefix a cropped output needs. Its candidates are the memory formats of its
output (channels_last, contiguous), in every dtype (16-bit: the generated input
copy moves the stored values); the plan chooses.
Templates: ``templates/conv_aten/``.

The cost of a cuDNN convolution (``conv_work``; the eager family uses it too),
calibrated roughly on the H100 (docs/performance.md, issue #10): tensor cores at
``CUDNN_FRACTION`` of their peak on large problems, less when the GEMM's N
(output channels) or K (input channels x taps) leaves cuDNN's tiles partly
empty; a transposed convolution run as written (cuDNN's data-gradient kernels)
at a fraction of that; tens of microseconds per call on top of the math
(small problems); NCHW costs a forward convolution a conversion of its input
and output (a transposed one run as written is faster in NCHW: docs/performance.md).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass

from ..buffer import Buffer, Tile, dense_buffer, strides_of
from ..spec import DTYPES
from ..lowering import Direct, Folded, Subpixel, TapSums, lowered
from ..stage import ConvStage
from ..target import Target
from ..ops import NORMALIZATIONS
from .base import (ATEN_RELAYOUT_SHARE, DTYPE_BYTES, Candidate, Family, StageRequest, Work, before_eager_batch_norm,
                   conv_precision, follows, value_bytes)

LAYOUTS = ("channels_last", "contiguous")
# K = input channels x taps and output channels above which cuDNN runs its large tensor-core GEMMs (TF32
# where allowed, in eager PyTorch too) and beats the generated convolution (docs/performance.md)
CUDNN_GEMM_K = 512
CUDNN_GEMM_COUT = 128
# The rates below are fitted (least squares in log time) to 170 cuDNN calls on the H100: every imported
# KernelBench problem's first convolution in each form this family can call it, TF32 allowed
# (reports/cudnn_calibration_h100.json; bench/fit_conv_work.py). The fit leaves a typical
# error of ~1.5x (rms log error 0.39, was 0.81 with the hand-set values): a guide, not a measurement.
CUDNN_FP32_FRACTION = 0.32  # of the fp32 peak, cuDNN's fp32 convolutions (TF32 off; fitted on forward calls)
# cuDNN's fp32 transposed calls (TF32 off, as written) against CUDNN_FP32_FRACTION at the same fill (N, K as
# CUDNN_FULL_N, CUDNN_FULL_K): strided, stride 1, and 3-d against 2-d. Fitted to the 62 transposed calls' TF32-off
# times on an H200 (reports/cudnn_calibration_h200.json, 2026-12-02): each kind of transposed call within 5% of the
# model on average (the flat fp32 forward rate had put 3 -> 16 channel ConvTranspose3d calls at 1.3 ms where they
# take 11.5: #60 ran one and was slower than eager; docs/performance.md, The cost model).
FP32_TRANSPOSED_STRIDED_EFFICIENCY = 0.70
FP32_TRANSPOSED_STRIDE1_EFFICIENCY = 2.0
FP32_TRANSPOSED_3D_EFFICIENCY = 0.59
CUDNN_FRACTION = 0.53  # of the tensor-core peak on convolutions that fill its tiles (~210 of 400 TFLOP/s)
CUDNN_FULL_N = 96  # output channels (per group) and input channels x taps (below) at which the rate stops falling:
CUDNN_FULL_K = 320  # below them it falls in proportion (kept out of the fit: fit_conv_work.py says why)
# cuDNN's data-gradient kernels for a transposed convolution run as written, against the
# equivalent forward convolution's rate (stride 1; strided), and in NCHW against channels_last
# Refit on an H200 (reports/cudnn_calibration_h200.json, 2026-12-02) with a strided call's taps rounded up to a
# multiple of the stride (conv_work), over the 145 calls whose TF32-allowed time shows TF32 kernels (the other 25
# ran cuDNN's fp32 kernels anyway, as fast as with TF32 off: small NC[D]HW forward calls and the k5 s2 transposed
# ones, priced as fp32 where `kgen tune` measured eager's call so): rms log error over them 0.37 -> 0.32, strided
# transposed calls' spread 1.6-1.8x -> 1.25x (#34's k4 s2 ConvTranspose3d, 2.5x overpriced before, at 0.85x).
# CUDNN_FRACTION and NCHW_CONVERSION stay the H100's (refit, they moved to 0.56 and 1.4-1.9 with the rows kept).
TRANSPOSED_STRIDE1_EFFICIENCY = 0.76
TRANSPOSED_STRIDED_EFFICIENCY = 0.62
TRANSPOSED_NCHW_EFFICIENCY = 0.69
TRANSPOSED_3D_EFFICIENCY = 0.92  # 3-d against 2-d
# ... but a 3-d stride-1 call as written in channels_last (its data-gradient kernel over every tap) at 0.35 of the 2-d
# rate: measured without a bias (kgen adds a deferred bias in the next stage) on an H200 (2026-12-04,
# bench/cudnn_bias.py, reports/cudnn_bias_h200.json), the three such calls of level 2 (#13, #61,
# #77) took 1.8-3.2x the time the terms above give against the 2-d stride-1 calls' 0.48x; #77's (64 -> 128, k5)
# 5.7 ms where its flipped-kernel forward call takes 4.1, and the model had put it at 3.7 (kgen 0.81x eager).
TRANSPOSED_3D_STRIDE1_CL_EFFICIENCY = 0.35
# ... in 16 bits (bfloat16 and float16 together): the same terms fitted on their own, to 312 calls (every form of
# the 63 level-2 problems' first convolution, each dtype) on an H200 (reports/cudnn_calibration_h200_bf16.json and
# _f16.json, 2026-12-02; `bench/cudnn_calibrate.py --dtype`, `bench/fit_conv_work.py --dtype`). Refit with the
# sub-pixel phases at the full rate (conv_work) and a single flipped-kernel phase priced as the dense call it is:
# rms log error 0.46 -> 0.36 over the 312 calls.
# float16 ran 1.18x faster than bfloat16 (geometric mean over the same calls); one set of terms serves both.
# CUDNN16_FRACTION and BIAS16_PASS are set from torch.profiler's kernels of KernelBench #1 (Conv2d 64 -> 128, k3,
# batch 128, bfloat16 channels_last, 2026-12-02): cuDNN's kernel 0.454 ms for 300 GFLOP (660 TFLOP/s of 790), then
# ATen's bias add 0.709 ms for the output's 1.04 GB read and written (2.9x its DRAM time). Left to the fit (every
# call adds a bias) the two traded against each other (fraction 4.2, pass 4.3: no call bound by its FLOPs).
CUDNN16_FRACTION = 0.84
TRANSPOSED16_STRIDE1_EFFICIENCY = 1.00
TRANSPOSED16_STRIDED_EFFICIENCY = 1.08
TRANSPOSED16_NCHW_EFFICIENCY = 0.14  # strided; at stride 1 (below) NCHW costs cuDNN far less
TRANSPOSED16_STRIDE1_NCHW_EFFICIENCY = 0.60
TRANSPOSED16_3D_EFFICIENCY = 0.61
NCHW16_CONVERSION = 2.5  # NCHW_CONVERSION (below) of a 16-bit call
# Input channels (per group, per tap) below which a 16-bit call's rate falls, as (channels / full) ** power (fitted):
# cuDNN's 16-bit kernels took 5-8 TFLOP/s with 3 input channels, 14-33 with 8 and 62 with 16, against ~240 from 32
# up (the calibration; the TF32 terms' K = channels x taps does not see it: 8 channels x 27 taps fill its K). The
# 3-d forward calls with 3 or 8 channels stay 1.3-1.6x slower than the model (#7, #8, #48).
CUDNN16_FULL_CHANNELS = 32
CUDNN16_CHANNELS_POWER = 0.66
# ATen adds a kept bias to a cuDNN output in a pass of its own (Convolution.cpp: output.add_(bias)), at this
# multiple of the output's read and write at DRAM bandwidth (above); 16-bit: BIAS16_PASS. A bias the plan defers to
# the next stage (plan.defer_conv_bias) costs nothing here.
BIAS16_PASS = 2.9
# float32: the calls' rates above were fitted with their bias, so this pass is counted twice where a bias is kept
# (level 2's plans are the same at 0 and 1). Fitted with the rates on calls timed with and without their bias
# (`bench/fit_conv_work.py --bias-less reports/cudnn_bias_h200.json`) it is 1.46, CUDNN_FRACTION 0.84, NCHW_CONVERSION
# 2.1: rms log error 0.46 -> 0.28 over 308 calls, but with them #11 and #58 move to calls that measured slower
# without their bias (docs/roadmap.md): the rates stay until terms per kind of call keep those right.
BIAS_PASS = 1.0
# A forward convolution in NCHW: cuDNN's tensor-core kernels are NHWC, so it converts the input and the
# output (each a read and a write: 2x the bytes; the fit gives 1.86x)
NCHW_CONVERSION = 1.86
# ... and a sub-pixel phase's NCHW output is every stride-th value of the whole output: its conversion
# writes half-used sectors. Set by hand (H200 `kgen tune`, 2026-11-27, 1feed18): the fitted model put #34's
# (ConvTranspose3d 32 -> 64, k4 s2) NCHW phases at 3.40 ms against 3.52 channels_last; they took
# 5.47 against 3.08 (#93, #100: 1.13x and 1.33x the model). Set with the bytes at 3.0 TB/s, where the H200's
# target now has 4.3 (kgen.target): its conversions now cost the H200 0.70x what it was set against (not reset).
PHASE_NCHW_WRITE = 2.0
# Host and setup cost of one cuDNN convolution call beyond its math: small sub-pixel
# phase convolutions took 45-60 us each on the H100 (issue #10's 8 and 9 phase cases)
CUDNN_CALL_S = 30e-6


TAP_SUM_MAX_SEGMENTS = 64  # segment sums (doubles) a thread of the generated tap-sum kernel keeps


@dataclass(frozen=True)
class TapSumKernel:
    """The generated tap-sum kernel of a convolution summed over every spatial dim (conv_aten's
    kernel.cu): a block per (sample, channel) plane reads it once; each thread adds its values into
    one double per segment (the pieces the taps' input ranges cut each dim into: a value is in one
    segment of each dim), the block combines them in a fixed order, and a tap's sum is the sum of
    the segments inside its ranges (no subtraction: an inf a tap does not read stays out of it)."""

    spatial: tuple  # the input plane's sizes
    segments: tuple  # per dim: ((lo, hi), ...) covering [0, L)
    runs: tuple  # per dim, per tap: (first, end) segment indices of its range (first >= end: empty)

    @staticmethod
    def of(lc, spatial) -> "TapSumKernel | None":
        lw = lc.lowering
        if not isinstance(lw, TapSums) or lw.rest(lc.conv):
            return None
        segments, runs = [], []
        for L, taps in zip(spatial, lw.ranges(lc.conv, spatial)):
            cuts = sorted({0, L} | {min(max(v, 0), L) for r in taps for v in r})
            segments.append(tuple(zip(cuts, cuts[1:])))
            runs.append(tuple((cuts.index(lo), cuts.index(hi)) if lo < hi else (0, 0)
                              for lo, hi in ((min(max(a, 0), L), min(max(b, 0), L)) for a, b in taps)))
        k = TapSumKernel(tuple(spatial), tuple(segments), tuple(runs))
        return k if k.count <= TAP_SUM_MAX_SEGMENTS else None

    @property
    def count(self) -> int:
        """Segment sums per plane."""
        return math.prod(len(s) for s in self.segments)

    @property
    def taps(self) -> int:
        return math.prod(len(r) for r in self.runs)

    def row_boxes(self) -> list[tuple[tuple[int, int], ...]]:
        """The segments of the leading dims (all but the last), row-major: each a box of rows."""
        return list(itertools.product(*self.segments[:-1]))

class ConvAten(Family):
    name = "conv_aten"
    stage_kind = "conv"
    generates_kernel = False
    pieces = ("kernel.cu", "binding.cpp")  # kernel.cu: the input copy into channels_last, the tap-sum kernel
    MAX_COPY_CHANNELS = 256  # input channels of the generated copy (its 32-position tile fits in shared memory)
    summary = "ATen/cuDNN convolution, in the lowering the rewrites chose"
    dtypes = DTYPES  # ATen's convolution computes each (16-bit: eager's own call, below)

    def fits(self, ops):
        return len(ops) == 1 and lowered(ops[0]) is not None

    def unsupported(self, req: StageRequest) -> str | None:
        if req.pipeline.conv_impl == "gemm":
            return "the spec asks for the generated convolution (plan.conv: gemm)"
        if req.dtype != "float32" and type(lowered(req.ops[0]).lowering) not in (Direct, Subpixel):
            # a folded pool's box-filtered weights or a tap sum would be rounded to the dtype where eager rounds none
            return f"no {req.dtype} form of this lowering (only the convolution as written, cropped or as sub-pixel phases)"
        if req.dtype != "float32" and not req.input.dense:
            return f"its {req.dtype} input is not one tensor (NC[D]HW or channels_last)"
        return None

    def layouts(self, req: StageRequest, conv) -> tuple[str, ...]:
        """Memory formats of the output, preferred first: channels_last when the next stage
        reads it as fast (cuDNN is faster in channels_last, measured on the H100:
        docs/performance.md), except for a transposed convolution run as written."""
        if conv.conv.rank < 2 or isinstance(conv.lowering, TapSums):
            return ("contiguous",)  # ATen has no channels_last format for 1-d convolutions; tap sums are small
        if req.pipeline.conv_layout != "auto":
            return (req.pipeline.conv_layout,)
        if before_eager_batch_norm(req.pipeline, req.start):
            return ("contiguous",)  # eager's own call (with TF32 as eager allows it: fp32_products)
        if self.eager_rounding_only(req, conv):
            # eager's own call, or channels_last with the operands rounded as eager's call rounds them (where the
            # generated copy makes its input: ConvStage.eager_rounding)
            rounded = req.input.dense and self._kernel_copy("channels_last", req.input, conv)
            return ("contiguous", "channels_last") if rounded else ("contiguous",)
        direct_transposed = conv.transposed
        nxt = req.next_family
        fast = nxt is not None and nxt.reads_channels_last_fast(self._output(req, conv, "channels_last")[0],
                                                                req.pipeline.ops[req.start + len(req.ops):])
        return LAYOUTS if fast and not direct_transposed else LAYOUTS[::-1]

    def candidates(self, req: StageRequest) -> list[Candidate]:
        conv = lowered(req.ops[0])
        return [Candidate(f"{self.name}:{layout}", self.make_stage(req, layout)) for layout in self.layouts(req, conv)]

    def make_stage(self, req: StageRequest, layout: str | None = None) -> ConvStage:
        conv = lowered(req.ops[0])
        t_in, t_out = req.types
        layout = layout or self.layouts(req, conv)[0]
        st = ConvStage(req.index, list(req.ops), t_in, t_out, input=req.input, conv=conv, layout=layout)
        st.fp32_products = self.fp32_products(req, conv, layout)
        st.eager_rounding = layout == "channels_last" and self.eager_rounding_only(req, conv)
        st.eager_fp32_kernels = (req.dtype == "float32" and self.as_eager(conv, layout)
                                 and dict(req.pipeline.eager_conv_tf32).get(conv.conv.module) is False)
        st.output, phases = self._output(req, conv, layout)
        st.phases = list(phases)
        st.input_extent = st.phases[0].input_extent if st.phases else conv.input_extent(t_in.spatial)
        return st

    @staticmethod
    def _output(req: StageRequest, conv, layout: str) -> tuple[Buffer, tuple]:
        """The buffer the convolution writes in ``layout``, and its sub-pixel phases (none: one call)."""
        t_in, t_out = req.types
        return _output_of(conv, t_in.spatial, t_out.shape[1:], layout)

    def eager_rounding_only(self, req: StageRequest, conv) -> bool:
        """Whether only eager's own call (NC[D]HW, as written), or a channels_last call whose operands are rounded
        first as that call rounds them (ConvStage.eager_rounding), rounds this convolution's operands as eager
        does: a forward convolution with TF32 products (cuDNN's large GEMMs) that a normalization follows.
        cuDNN rounds the operands to TF32 with ties away from zero in its NC[D]HW forward kernels and to
        even in its channels_last ones (H100: lab tf32_lab/cudnn_rounding.py in docs/performance.md);
        the normalization scales that difference up to 5-7e-4 (KernelBench's #52, #17: the check failed
        0/5 in channels_last, passes 5/5 as eager's call). Transposed convolutions round to even in
        every form tried, so their forms stay free; after an exponential the ties' differences stay small
        (#43's logsumexp: 5e-6 in channels_last)."""
        if conv.transposed or not isinstance(conv.lowering, Direct) or isinstance(conv.lowering, Folded):
            return False
        if req.dtype != "float32":  # TF32's rounding: 16-bit operands' products are exact in every form
            return False
        if req.pipeline.precision != "tf32" or self.fp32_products(req, conv, "channels_last"):
            return False
        return follows(req, NORMALIZATIONS)

    @staticmethod
    def as_eager(conv, layout: str) -> bool:
        """Whether the stage's cuDNN call is the one eager PyTorch makes (the convolution as written, NC[D]HW)."""
        return layout == "contiguous" and isinstance(conv.lowering, Direct) and not isinstance(conv.lowering, Folded)

    @staticmethod
    def fp32_products(req: StageRequest, conv, layout: str) -> str:
        """Why this convolution runs with cuDNN's TF32 off ("" where it keeps the spec's precision):
        a small convolution (below CUDNN_GEMM_K and CUDNN_GEMM_COUT) that needs fp32-level products
        (base.conv_precision) and is not the call eager PyTorch makes (another memory format, sub-pixel
        phases, a folded pool): cuDNN picks its kernels per call, and in channels_last it ran
        KernelBench's 8 -> 64 channel k3 convolutions (2-d and 3-d) in TF32 where eager's NC[D]HW call
        ran fp32 (bench/cudnn_precision.py; kgen 3.6e-4 to 9.7e-4 off eager, above
        KernelBench's 1e-4). The same call as eager's keeps TF32 allowed: cuDNN picks what eager gets."""
        c = conv.conv
        if isinstance(conv.lowering, TapSums):
            return "a convolution of input sums (each the sum of many values, whose rounding TF32 would keep)"
        if req.pipeline.precision != "tf32" or req.dtype != "float32":
            return ""  # (TF32 is float32's: cuDNN multiplies 16-bit operands exactly in every form)
        as_eager = ConvAten.as_eager(conv, layout)
        k = c.in_channels // c.groups * math.prod(c.kernel)  # the largest sub-pixel phase has at most these taps
        if as_eager or k > CUDNN_GEMM_K or c.out_channels > CUDNN_GEMM_COUT:
            return ""
        fp32_level, why = conv_precision(req)
        return f"{why}, and in this form cuDNN may pick TF32 kernels where eager's call runs fp32" if fp32_level else ""

    def tap_sum_kernel(self, st: ConvStage) -> TapSumKernel | None:
        """The generated kernel that sums a contiguous input per tap (a convolution summed over every
        spatial dim; CUDA builds, at run time a contiguous float input), or None: ATen's calls do it."""
        if not st.input.flat:
            return None
        return TapSumKernel.of(st.conv, st.in_type.spatial)

    def _kernel_copy(self, layout: str, given: Buffer, conv) -> bool:
        """Whether a stage of ``layout`` reading ``given`` gets its input through the generated copy from NC[D]HW
        into channels_last (input_copy's "kernel")."""
        return layout == "channels_last" and given.layout == "contiguous" and conv.conv.in_channels <= self.MAX_COPY_CHANNELS

    def input_copy(self, st: ConvStage) -> str | None:
        """How the input reaches the convolution when it must be copied first (narrowed to
        the extent read, or into the output's memory format): "kernel" (the generated
        copy from NC[D]HW into channels_last; at run time a GPU input that is not a
        contiguous NC[D]HW tensor takes ATen's), "aten" (Tensor.contiguous); None: it
        is read as it is."""
        if st.layout == st.input.layout and tuple(st.input_extent) == tuple(st.in_type.spatial):
            return None
        if self._kernel_copy(st.layout, st.input, st.conv):
            return "kernel"
        return "aten"

    def work(self, st: ConvStage, batch: int, target: Target) -> list[Work]:
        # The weights a stage derives (flipped, phase, folded, re-laid) are kept between calls.
        lc, c = st.conv, st.conv.conv
        bias = c.bias and not lc.bias_deferred
        read = batch * c.in_channels * math.prod(st.input_extent)
        out = []
        copy = self.input_copy(st)
        if copy:
            relayout = copy == "aten" and st.layout != st.input.layout
            out.append(Work("input copy", 0, 2 * value_bytes(st) * read,
                            bandwidth_share=ATEN_RELAYOUT_SHARE if relayout else 1.0))
        if st.phases:
            for ph in st.phases:
                taps = math.prod(ph.taps)
                flops = 2 * batch * c.in_channels * c.out_channels * taps * math.prod(ph.count)
                out += conv_work(f"phase {ph.residue}", flops, read, batch * c.out_channels * math.prod(ph.conv_out),
                                 c.out_channels, c.in_channels * taps, st.layout, target, fp32=bool(st.fp32_products),
                                 phase=len(st.phases) > 1, dtype=st.dtype, channels=c.in_channels, bias=bias)
            return out
        if isinstance(lc.lowering, TapSums):  # the input's tap sums in ATen calls, then a small convolution of them
            sums = batch * c.in_channels * math.prod(c.kernel[d] for d in lc.lowering.dims) * math.prod(
                n for d, n in enumerate(st.in_type.spatial) if d not in lc.lowering.dims)
            calls = 1 if self.tap_sum_kernel(st) else lc.lowering.aten_calls(c, st.in_type.spatial)
            out.append(Work("tap sums", batch * st.in_type.sample_numel, value_bytes(st) * read, launches=calls))
            read = sums
        flops = batch * lc.flops(st.in_type, st.out_type)
        written = batch * sum(math.prod(t.dims) for t in st.output.tiles)
        K = c.in_channels // c.groups * math.prod(lc.kernel)
        out += conv_work("convolution", flops, read, written, c.out_channels // c.groups, K, st.layout, target,
                         transposed_stride=c.stride if lc.transposed else None, dtype=st.dtype,
                         channels=c.in_channels // c.groups, bias=bias, kernel=c.kernel,
                         fp32=bool(st.fp32_products) or st.eager_fp32_kernels)
        return out

    def explain_lines(self, st: ConvStage) -> list[str]:
        calls = (f"{len(st.phases)} ATen convolutions (one per sub-pixel phase; cuDNN on the GPU)" if len(st.phases) > 1
                 else "the input's per-tap sums (a generated kernel: a block per plane), then one ATen product of them"
                 if self.tap_sum_kernel(st)
                 else "the input's per-tap sums (ATen), then one ATen convolution of them" if isinstance(st.conv.lowering, TapSums)
                 else "one ATen convolution (cuDNN on the GPU)")
        copy = {"kernel": "; the input is copied into channels_last first by a generated kernel (ATen's copy where it is"
                          " not a contiguous NC[D]HW tensor)",
                "aten": "; the input is copied into that layout (or narrowed) first", None: ""}[self.input_copy(st)]
        tf32 = (f"; cuDNN with TF32 off: {st.fp32_products}" if st.fp32_products else
                "; cuDNN's fp32 kernels although TF32 is allowed (eager's call, as `kgen tune` measured it)"
                if st.eager_fp32_kernels else
                "; on CUDA its input (in the copy) and weight rounded to TF32 ties away from zero first, as eager's "
                "NC[D]HW call rounds them: its products are eager's" if st.eager_rounding else "")
        return [f"{calls}, output {st.layout}{copy}{tf32}"]

    def stage_json(self, st: ConvStage) -> dict:
        d = dict(lowering=st.conv.lowering.name, layout=st.layout, input_extent=list(st.input_extent), input_copy=self.input_copy(st),
                 fp32_products=st.fp32_products, eager_rounding=st.eager_rounding)
        if st.phases:
            d["phases"] = [asdict(p) for p in st.phases]
        return d


def conv_work(what: str, flops: float, read: int, written: int, n: int, k: int, layout: str, target: Target,
              transposed_stride: tuple | None = None, fp32: bool = False, phase: bool = False,
              dtype: str = "float32", channels: int | None = None, bias: bool = False,
              kernel: tuple | None = None) -> list[Work]:
    """One cuDNN convolution call: ``read`` input and ``written`` output elements, a GEMM of
    N = ``n`` output channels and K = ``k`` (input channels x taps); ``transposed_stride``:
    the stride of a transposed convolution run as written; ``fp32``: TF32 off (fp32 kernels);
    ``phase``: a sub-pixel phase, whose output is a strided view of the whole output; ``dtype``:
    its operands' (16-bit: the 16-bit tensor cores at CUDNN16_FRACTION of their peak and the 16-bit
    transposed terms; values of 2 bytes; ``channels``: input channels per group and tap, CUDNN16_FULL_CHANNELS;
    ``bias``: ATen's pass that adds a kept bias, BIAS_PASS / BIAS16_PASS)."""
    half = dtype != "float32"
    fill = min(1.0, n / CUDNN_FULL_N) * min(1.0, k / CUDNN_FULL_K)
    if half:
        fill *= min(1.0, (channels or CUDNN16_FULL_CHANNELS) / CUDNN16_FULL_CHANNELS) ** CUDNN16_CHANNELS_POWER
        # a sub-pixel phase: the full rate (fitted as a factor on its fill, the phases took 10x the forward calls',
        # saturating it: their small K and N do not slow cuDNN's 16-bit kernels as they do a whole convolution's)
        rate = target.product_flops(dtype) * CUDNN16_FRACTION * (1.0 if phase else fill)
    else:
        rate = target.fp32_flops * CUDNN_FP32_FRACTION if fp32 else target.tensor_flops * CUDNN_FRACTION * fill
    nbytes = DTYPE_BYTES[dtype]
    conv = lambda rate: Work(what, flops, nbytes * (read + written), rate, calls=1, call_s=CUDNN_CALL_S)  # noqa: E731
    after = [Work(f"{what}: bias (ATen's add)", 0, (BIAS16_PASS if half else BIAS_PASS) * 2 * nbytes * written)] if bias else []
    if transposed_stride is not None:
        strided = any(s > 1 for s in transposed_stride)
        if fp32:  # cuDNN's fp32 data-gradient kernels: slow at small sizes as its TF32 ones are, in both layouts
            rank3 = FP32_TRANSPOSED_3D_EFFICIENCY if len(transposed_stride) == 3 else 1.0
            return [conv(rate * fill * rank3 * (FP32_TRANSPOSED_STRIDED_EFFICIENCY if strided
                                                else FP32_TRANSPOSED_STRIDE1_EFFICIENCY))] + after
        if half:
            nchw = TRANSPOSED16_NCHW_EFFICIENCY if strided else TRANSPOSED16_STRIDE1_NCHW_EFFICIENCY
            rank3 = TRANSPOSED16_3D_EFFICIENCY
            stride1, strided_eff = TRANSPOSED16_STRIDE1_EFFICIENCY, TRANSPOSED16_STRIDED_EFFICIENCY
        else:
            nchw, rank3 = TRANSPOSED_NCHW_EFFICIENCY, TRANSPOSED_3D_EFFICIENCY
            if not strided and layout != "contiguous":
                rank3 = TRANSPOSED_3D_STRIDE1_CL_EFFICIENCY
            stride1, strided_eff = TRANSPOSED_STRIDE1_EFFICIENCY, TRANSPOSED_STRIDED_EFFICIENCY
            if kernel is not None:  # TF32 data-gradient kernels run ceil(k / s) taps per residue
                rate /= math.prod(-(-k // s) * s / k for k, s in zip(kernel, transposed_stride))
        nchw = nchw if layout == "contiguous" else 1.0
        rank3 = rank3 if len(transposed_stride) == 3 else 1.0
        return [conv(rate * nchw * rank3 * (strided_eff if strided else stride1))] + after
    if layout == "contiguous":
        conversion = NCHW16_CONVERSION if half else NCHW_CONVERSION
        return [Work(f"{what}: NCHW to NHWC", 0, conversion * nbytes * read), conv(rate),
                Work(f"{what}: NHWC to NCHW", 0, conversion * (PHASE_NCHW_WRITE if phase else 1.0) * nbytes * written)] + after
    return [conv(rate)] + after


FAMILY = ConvAten()


@functools.lru_cache(maxsize=512)  # layouts and make_stage ask for it per layout, for every candidate plan
def _output_of(conv, in_spatial: tuple, logical: tuple, layout: str) -> tuple[Buffer, tuple]:
    """ConvAten._output's answer, a function of values: ``logical`` is the output's (C, *S)."""
    C = conv.conv.out_channels
    if isinstance(conv.lowering, Subpixel):
        phases = tuple(conv.phases(in_spatial))
        tiles = []
        for ph in phases:
            dims = (C,) + ph.conv_out
            strides, sample = strides_of(dims, layout)
            tiles.append(Tile(dims, strides, sample, ph.offset, ph.residue))
        # stride 1 has a single phase: a dense tile, maybe offset
        phase_stride = conv.conv.stride if len(tiles) > 1 else ()
        return Buffer(logical, layout, tuple(tiles), phase_stride=phase_stride), phases
    # a cropped output is a view of what the convolution produces from the input prefix
    return dense_buffer(logical, (C,) + conv.physical_out(in_spatial), layout), ()
