"""conv_gemm: the convolution itself, generated as an implicit GEMM on TF32 tensor cores
(precision ieee: plain fp32 FMAs, the kernel's direct loop).

The kernel is ``templates/conv_gemm/conv_gemm.cuh`` (ordinary C++ templates);
this family renders its problem structs (every size a compile-time constant,
in a 3-D view: a 1-d or 2-d convolution has leading sizes of 1), its schedule
and its epilogue. Lowerings: direct and folded convolutions, and a strided
transposed convolution as its sub-pixel phases (all in one launch); a stride-1
transposed convolution is the single-phase case (the flipped kernel).

Epilogue: a ``pool_reduce`` stage right after the convolution is fused in when
its pools are non-overlapping windows that tiles of the convolution output
hold whole (and the convolution has one phase): the stage's math runs on the
output tile in shared memory (on the accumulators when the stage has no pools and
reduces everything, or is a 2 x 2 x 2 max pool reduced to one value on the window
loop: Fused.register_pool), and the convolution output is never written. A
reduction over spatial dims leaves one partial per tile along them, combined
in index order by the stage's own finalize kernel (deterministic).

A ``norm`` stage is fused in at small K = Cin x taps, on the fp32 direct loop, in
one of two forms. Recompute: pass 1 leaves each tile's (count, mean, M2) per
(sample, channel), a merge kernel combines them per (sample, group) in tile
order, pass 2 computes the convolution again and normalizes in registers (with
a reduction over the channels, a thread holds every channel of its positions).
One pass: a cooperative launch keeps whole samples' tiles on co-resident CTAs;
each CTA stores its tile's moments, counts itself in, waits for the sample's
other tiles, merges their moments as the merge kernel does, and normalizes its
accumulators, still in registers. The convolution output is never written.

Candidate ``conv_gemm:phase_pool`` (Hopper; TF32, bf16/f16 MMAs in 16-bit plans): a strided transposed 3-D convolution into
64 channels whose next stage is a max pool over whole stride periods and a reduction over the
channels runs as one wgmma kernel (``templates/conv_gemm/phase_pool.cuh``) with the GEMM turned
around (M = the output channels, N = positions of an input box all sub-pixel phases share); the
pool_reduce stage is its epilogue on the accumulators. It is offered even where cuDNN's GEMMs
beat the other loops (``_k_rule``): maxpool_sum 0.79 ms against 1.65 for its cuDNN plan.

Candidate ``conv_gemm:pool_ring`` (TF32): a 3 x 3 x 3 convolution into at most 16 channels (stride 1,
no padding, input rows of at most 64 positions) whose next stage is a 2 x 2 x 2 max pool and a reduction
of everything (or of every spatial dim, a partial per channel: 16-bit plans, where the reduction over the
channels after a rounded per-channel mean is a stage of its own) runs as one mma.sync kernel (``templates/conv_gemm/pool_ring.cuh``) with the output
channels as M and the input box a ring of depth slots; the pool_reduce stage is its epilogue on the
accumulators (div_max_gap_bias_sum 0.273 ms against the window loop's 0.338 in the lab).

Otherwise the convolution output is written (NC[D]HW) and the next stage reads it.

bfloat16 and float16 plans: every 16-bit value (float16's subnormals included) is exact in TF32, so a
single TF32 product of two 16-bit operands is exact and, accumulated in fp32, as accurate as eager's
16-bit tensor-core convolution: the window, generic and wgmma loops run unchanged on single TF32
products, only their loads and stores change (conv_gemm.cuh: the cp.async stages hold the values as
stored and the rounding pass converts them; BoxRegs converts in registers). The weights are packed from
a float32 copy once per version; the accumulators are rounded to the dtype before the epilogue where
kgen.plan.rounding_points says (eager's 16-bit convolution output). 16-bit plans keep the bias in the
convolution (a deferred one, kgen.plan.defer_conv_bias, this family declines): it is added to the rounded output and
rounded again (the Store: as it stores; a fused epilogue, phase_pool's and pool_ring's included: before its first
op), as eager's cuDNN call and ATen's bias add after it. phase_pool multiplies the 16-bit input as stored on bf16/f16 wgmma (twice
TF32's rate; the same exact products, k-steps of 16 channels); pool_ring loads it as stored and converts it
where it rounds it to TF32 (the ring's slots). The norm epilogues (the direct loop) are
float32 only for now and decline 16-bit plans.

On the CPU the stage runs ATen's convolution, then the epilogue stage's own
C++ code. Templates: ``templates/conv_gemm/``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from ..buffer import flat_buffer
from ..errors import KgenError
from ..ir import BatchStats, Elementwise, Pool, Reduce
from ..lowering import Direct, Folded, Subpixel, TapSums, lowered
from ..spec import DTYPES
from ..stage import ConvStage, Stage
from ..target import Target
from .batch_stats import MOMENT_BYTES
from .base import (DTYPE_BYTES, FLOAT_BYTES, Candidate, Family, StageRequest, Work, before_eager_batch_norm, conv_precision,
                   later_ops, pow2_floor)
from .conv_aten import CUDNN_GEMM_COUT, CUDNN_GEMM_K

EPILOGUE_BATCH = 4  # Fused.batch where the epilogue's chain calls libm
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may have (H100)
WINDOW_M_TILES = 4  # m-tiles (rows in H) per warp in the window loop
WINDOW_WIDE_WARPS_N = 4  # warp columns of the window loop's 64-channel blocks (schedule)
# The wgmma loop wins where a warpgroup's MMA is at least 16 columns wide with two
# warpgroups per m-block (avgpool_sigmoid_sum's 64 channels: 0.436 ms against 0.685 in
# the lab); at 16 channels the window loop wins (div_max_gap_bias_sum: 0.49 against 0.61).
# Split TF32 (three MMAs re-reading A) gained nothing on KernelBench's convolutions
# (problems 15, 21: 0.74x, 0.84x; 34, 73, 85, 92: 1.00-1.06x), so it keeps mma.sync.
WGMMA_MIN_COUT = 32
# wgmma tile shapes, (tile, warps_m, warps_n, teams), the first whose shared memory fits: teams of
# one warpgroup (m64 x all channels) on 8 x 8 tiles sharing the weights ran avgpool_sigmoid_sum's
# convolution in 0.338-0.358 ms (three teams) and 0.334-0.380 (two) against 0.368-0.397 for one team
# of four warpgroups on 16 x 8 tiles (lab conv_lab: tavg_a, tavg_b, gavg_d; H100, docs/performance.md,
# 1cc3a94); four teams spill (ptxas caps a thread of 512 at 128 registers) and lost
WGMMA_SHAPES = (((1, 8, 8), 4, 1, 3), ((1, 8, 8), 4, 1, 2), ((1, 16, 8), 8, 2, 1), ((1, 8, 8), 4, 2, 1))
STAGES = 2  # cp.async pipeline depth
# Sub-pixel phases of a 3-d transposed convolution with at most this many input channels take 4 x 16 x 16
# tiles of 16 warps on the window loop: a tile is one chunk of K, so the per-tile work (coordinates, the box
# load and its wait, the store) is what the kernel spends; against 2 x 8 x 16 tiles of 4 warps, KernelBench
# #58 / #72 / #96 (3 -> 16 channels, k3 s2) took 2.59 -> 2.38, 4.39 -> 4.22, 2.42 -> 2.22 ms (H100, 2026-11-27, 3a985f9)
PHASE_BIG_TILE_MAX_CIN = 4
PHASE_BIG_TILE_MAX_COUT = 16  # (measured at 16; wider blocks hold more accumulators than 512 threads' 128 registers)
# shared floats of a fused pool_reduce epilogue (kernel.cu.j2 Fused::kScratchFloats: a value per warp); the
# generated kernel asserts that the plan's shared memory covers every epilogue's
FUSED_SCRATCH_FLOATS = 32
PLANE_RESIDUE = 8  # channel planes 8 words apart mod 32: the four k-lanes of a fragment hit distinct banks
# Cost model of the wgmma and generic loops on one convolution: mma.sync runs at about half of
# wgmma's TF32 rate and the kernel reaches about 45% of that on the shipped convolutions
# (~90 TFLOP/s; docs/performance.md, conv_gemm v3)
GEMM_TENSOR_FRACTION = 0.22
# The window loop on one convolution (no sub-pixel phases) after its epilogue walk (2026-11-27, 21d2759): its MMAs
# and its memory traffic add up rather than overlap (one CTA per SM runs its loop, then its epilogue).
# Fitted to `kgen tune` of 11 KernelBench problems (H200, 2026-11-27, 1feed18; docs/performance.md):
# FLOPs / (0.35 x the TF32 peak) + bytes / DRAM bandwidth, rms log error 0.13 (0.27 with the old rate).
# That fit, and the phases' below (H200 too, 1feed18), priced the bytes at 3.0 TB/s, the H100's, which the model
# then used on every device; at the H200's own 4.3 TB/s (kgen.target) the bytes cost 0.70x what was fitted. Not
# refitted: that needs the H200's times again.
WINDOW_TENSOR_FRACTION = 0.35
# Sub-pixel phases (either loop): each phase's tiles store every stride-th output and reload their
# box, so their bytes cost ~6x a streamed pass; the MMAs run at about the window loop's rate (fitted
# to KernelBench #15, #34, #58, #72, #93, #100: within 1.4x; the old model was 2-12x low)
PHASES_TENSOR_FRACTION = 0.34
PHASES_BYTES_FACTOR = 6.0
# A 16-bit plan's convolution in the generic loops (not phase_pool or pool_ring, which are priced on their own
# rates): its time against the float32 terms above. Measured in the level-2 bfloat16 sweep on an H200
# (reports/kernelbench_level2_h200_bf16.md, kgen at 9727fbb): the eight problems whose plan is one such kernel
# took 1.0-3.7x the model (geometric mean 2.3x; #57, #69, #71, Conv2d 8 -> 64 k3 with a 1 GB output: 2.4-3.7x).
# Not profiled yet: a factor on the whole time, not a term of the loads, the MMAs or the stores.
HALF_TIME_FACTOR = 2.3
# A pass that writes only its tiles' moments (output_dropped) still stages each tile and reduces every value
# per channel: about the time of writing the output once at DRAM speed (one point: KernelBench #72's
# statistics pass, 407 us on an H100 for 1.03 GB of values, where the rest of the model gives 0.10 ms)
DROPPED_OUTPUT_BYTES_FACTOR = 1.0
# The one-pass norm (conv_gemm:onepass): every CTA of a sample merges the sample's per-tile moments
# itself, ONEPASS_MERGE_LANES lanes per group, two passes of dependent L2 loads, once per round of
# co-resident samples (about two 128-thread CTAs per SM at its ~230 registers). KernelBench #21
# (128 tiles per sample, 4 channels per group: 64 terms per lane, 63 rounds) ran 3.97 ms against
# the written form's 2.04; instnorm_clamp_max (14 terms, 8 rounds) 0.19 ms (H200, 2026-11-27)
ONEPASS_CTAS_PER_SM = 2
ONEPASS_MERGE_LANES = 8  # norm_epilogue.j2 kMergeLanes
ONEPASS_MERGE_TERM_S = 0.33e-6  # one term's L2 loads per pass, in a dependent chain (fitted: #21, #79)
# The direct loop reached ~43% of the FP32 rate on instnorm_clamp_max's 3 -> 16 convolution
# in the product's recompute form (4.18 GFLOP per pass in 145 / 139 us, H100, docs/performance.md, 2026-11-23)
DIRECT_FP32_FRACTION = 0.43
# ... and ran instnorm_clamp_max (K = 3 x 27) in 0.35-0.39 ms, as fast as its split-TF32
# window loop and ahead of ATen's fp32 convolution alone (0.51 ms); at K = 8 x 27 and 8 x 36
# (div_max_gap_bias_sum, avgpool_sigmoid_sum) it tied ATen's fp32 path (4.77 / 4.78 ms,
# 5.16 / 5.27 ms) at ~10 TFLOP/s (reports/ieee_h100.md): above this K, ATen's fp32 convolution
DIRECT_MAX_K = 128
DIRECT_MAX_ACC = 128  # accumulators per thread in the direct loop (positions x channels)
# A norm stage may be fused in by computing the convolution twice (statistics, then apply) on
# the direct loop, up to this K (a plan candidate, conv_gemm:recompute): instnorm_clamp_max's
# K = 81 ran 0.33-0.38 ms that way in the lab, about what the written form takes (0.38); the
# same recompute form on the split-TF32 loops took 0.42 (lab conv_lab's dinst_stats/apply, H100; docs/performance.md)
NORM_RECOMPUTE_MAX_K = DIRECT_MAX_K


@dataclass(frozen=True)
class Problem:
    """One convolution as the kernel sees it (3-D view). A sub-pixel phase is one Problem."""

    cin: int
    cout: int
    input: tuple  # (D, H, W) of the input tensor
    out: tuple  # positions computed per dim (a phase: its count)
    kernel: tuple
    stride: tuple
    padding: tuple  # may be negative (a phase's offset)
    dilation: tuple
    out_stride: tuple  # output position = out_stride * m + out_residue
    out_residue: tuple
    full: tuple  # the output tensor's spatial size
    weight_transposed: bool  # the weight is (Cin, Cout, K..)
    weight_kernel: tuple  # its kernel size
    weight_start: tuple  # tap j of this problem is weight tap start + step * j
    weight_step: tuple


@dataclass(frozen=True)
class Schedule:
    tile: tuple  # output box of a CTA tile (D, H, W)
    cin_chunk: int  # input channels per pipeline step: 4 or a multiple of 8
    block_n: int  # output channels per CTA
    warps_m: int
    warps_n: int
    stages: int  # cp.async pipeline depth
    plane_residue: int  # channel plane stride % 32
    loop: str  # main loop (conv_gemm.cuh Loop): "wgmma", "window" (registers; stride 1 in H and W), "generic" or "direct" (fp32)
    mma: str  # tf32 | tf32x3 | fp32 (the direct loop)
    smem_bytes: int  # what the CTA needs (checked against the limit)
    teams: int = 1  # wgmma loop: teams of warps_m x warps_n warps sharing the resident weights
    input_bytes: int = FLOAT_BYTES  # bytes of an input value (2: a 16-bit plan's cp.async stages hold half as many floats)


@dataclass(frozen=True)
class Fused:
    """How the epilogue stage (pool_reduce) runs on an output tile, per spatial dim (D, H, W)."""

    window: tuple  # the composed pool window (= its stride)
    pooled_tile: tuple  # pooled positions per tile
    pooled: tuple  # the pooled output's spatial size
    kept: tuple  # dims the reduction keeps: "c", "d", "h", "w"
    reduced: tuple  # dims it reduces
    splits: int  # tiles along the reduced spatial dims: partials per output
    lanes: int  # threads that share one output's reduction inside a tile
    registers: bool  # no pools, everything reduced: the epilogue works on the accumulators (no staged tile)
    # one 2 x 2 x 2 max pool, then everything reduced, on the window loop: a thread max-pools the
    # 2 x 2 (H, W) its accumulators hold, the partner warp one depth on gives the depth pair
    # through shared memory (no staged tile; lab 0.464 -> 0.413 ms for div_max)
    register_pool: bool = False
    scratch: int = 32  # the epilogue's shared-memory scratch, floats
    # an elementwise epilogue: channels a thread computes before it stores any, so that their
    # chains overlap; EPILOGUE_BATCH where the chain calls libm (tanhf, expf, erff: long dependent
    # chains), else 1
    batch: int = 1

    @property
    def elementwise(self) -> bool:
        """Nothing reduced and no pool: one value per output (the template's per-position walk)."""
        return not self.reduced and self.window == (1, 1, 1) and self.lanes == 1 and self.splits == 1


@dataclass(frozen=True)
class FusedNorm:
    """How a norm epilogue stage runs (conv_gemm module docstring): the convolution twice, or
    once on co-resident CTAs."""

    tiles: int  # tiles per sample: (count, mean, M2) partials per (sample, channel)
    groups: int  # the norm's groups: statistics per (sample, group)
    reduce: str  # the reduction over the channels fused after it ("" if none)
    one_pass: bool = False  # one pass: a sample's tiles on co-resident CTAs that wait for each other


# conv_gemm:phase_pool (phase_pool.cuh): lab tconv_lab's kernel (docs/performance.md) ran maxpool_sum's whole
# pipeline at 288-296 TFLOP/s of useful FLOPs (H100, 0.75-0.77 ms; 221 GFLOP), ~0.6 of the TF32 peak
PHASE_POOL_TENSOR_FRACTION = 0.58
# Output positions of a tile from which the Store gathers a following batch norm's statistics: per tile
# and channel a warp's two shuffle trees (H100, training mode, gathered / the statistics kernel: #72's
# 1024-position tiles 2.43 / 2.70 ms, #73's 256 1.09-1.10 / 1.17-1.22, #15's 64 1.79-1.89 / 1.54-1.61)
GATHER_MIN_TILE = 256
PHASE_POOL_MAX_N = 128  # positions of one wgmma (wgmma.cuh's widest)
PHASE_POOL_MAX_ACC = 160  # accumulators per thread (a warpgroup holds 64 channels x the tile's positions)
PHASE_POOL_MAX_PHASES = 27  # phase_pool.cuh kMaxPhases
PHASE_POOL_MAX_PIECES = 128  # taps a warpgroup streams per tile (kMaxPiecesPerWg)
PHASE_POOL_RING = 4  # weight taps in flight per warpgroup (kRing)
PHASE_POOL_MAX_WORKERS = 256  # CTAs a split last round may use (kMaxWorkers)
PHASE_POOL_TABLE_BYTES = (4 * (2 + 2 + 2 * PHASE_POOL_MAX_PHASES + PHASE_POOL_MAX_PHASES + 3 * PHASE_POOL_MAX_PHASES)
                          + 2 * 2 * 2 * PHASE_POOL_MAX_PIECES)  # sizeof(PhasePoolTables): ints, then two short tables


@dataclass(frozen=True)
class PhasePool:
    """conv_gemm:phase_pool: a strided transposed convolution with the next stage (a max pool over
    whole stride periods, a reduction over the channels) in one wgmma kernel (phase_pool.cuh). Per
    spatial dim (D, H, W) unless said otherwise."""

    stride: tuple
    tq: tuple  # positions q of one phase per pool window (window / stride)
    pooled: tuple  # the pooled output's size
    emin: tuple  # the smallest input offset of any tap: where the box starts
    box: tuple  # the input box of a tile (a row padded to a multiple of 8 positions)
    phases: tuple  # per warpgroup: its phases (index (rd SH + rh) SW + rw)
    taps: tuple  # per phase: its taps
    residues: tuple  # per phase: (rd, rh, rw)
    offsets: tuple  # per warpgroup: each of its taps' offset in the box (positions)
    weight_taps: tuple  # per warpgroup: each of its taps' weight tap ((kd KH + kh) KW + kw)
    piece_floats: int  # one tap's weights as the MMAs take them (TF32, or the 16-bit type two to a float)
    smem_bytes: int


def _phase_taps(k: int, s: int, p: int, r: int) -> list[tuple[int, int]]:
    """(weight tap, input offset) of sub-pixel phase r along one dim: output s q + r reads input q + e."""
    return [(j, (r + p - j) // s) for j in range(k) if (r + p - j) % s == 0]


@functools.lru_cache(maxsize=256)  # asked for by unsupported and candidates, for every candidate plan
def phase_pool_layout(c, window: tuple, pooled: tuple, elem_bytes: int = FLOAT_BYTES) -> PhasePool | str:
    """The phase_pool kernel's layout for transposed convolution ``c`` pooled by ``window`` into
    ``pooled`` with operands of ``elem_bytes`` (4: TF32 MMAs, k-steps of 8 channels; 2: the 16-bit input as
    stored on bf16/f16 MMAs, k-steps of 16), or why it does not apply."""
    if not c.transposed or c.rank != 3:
        return "a transposed 3-D convolution only"
    if c.in_channels % 8 or c.out_channels != 64:
        return f"{c.in_channels} -> {c.out_channels} channels (needs a multiple of 8 -> 64)"
    if any(d != 1 for d in c.dilation):
        return "dilation"
    stride, kernel, padding = tuple(c.stride), tuple(c.kernel), tuple(c.padding)
    if any(w % s for w, s in zip(window, stride)):
        return f"pool window {window} is not a whole number of strides {stride}"
    tq = tuple(w // s for w, s in zip(window, stride))
    per_dim = [[_phase_taps(k, s, p, r) for r in range(s)] for k, s, p in zip(kernel, stride, padding)]
    if any(not taps for dim in per_dim for taps in dim):
        return "a phase without taps"
    emin = tuple(min(e for taps in dim for _, e in taps) for dim in per_dim)
    emax = tuple(max(e for taps in dim for _, e in taps) for dim in per_dim)
    qw = pooled[2] * tq[2]
    box = (tq[0] + emax[0] - emin[0], tq[1] + emax[1] - emin[1], -(-(qw + emax[2] - emin[2]) // 8) * 8)
    n = tq[1] * box[2]
    if n > PHASE_POOL_MAX_N or tq[0] * n // 2 > PHASE_POOL_MAX_ACC:
        return f"a tile of {tq[0]} x {tq[1]} x {box[2]} positions is too large for one warpgroup's accumulators"
    # phase (rd SH + rh) SW + rw: its (weight tap, box offset) pieces
    residues = [(rd, rh, rw) for rd in range(stride[0]) for rh in range(stride[1]) for rw in range(stride[2])]
    if len(residues) > PHASE_POOL_MAX_PHASES:
        return f"more than {PHASE_POOL_MAX_PHASES} phases"
    pieces = [[(((jd * kernel[1]) + jh) * kernel[2] + jw, ((ed - emin[0]) * box[1] + (eh - emin[1])) * box[2] + (ew - emin[2]))
               for jd, ed in per_dim[0][rd] for jh, eh in per_dim[1][rh] for jw, ew in per_dim[2][rw]]
              for rd, rh, rw in residues]
    taps = [len(ps) for ps in pieces]
    groups = _balanced_halves(taps)
    load = [sum(taps[i] for i in g) for g in groups]
    if max(load) > PHASE_POOL_MAX_PIECES:
        return f"{max(load)} taps per warpgroup (at most {PHASE_POOL_MAX_PIECES})"
    offsets = tuple(tuple(o for ph in g for _, o in pieces[ph]) for g in groups)
    weight_taps = tuple(tuple(t for ph in g for t, _ in pieces[ph]) for g in groups)
    k_step = 8 * FLOAT_BYTES // elem_bytes  # an MMA's K: 32 bytes of channels (16-bit: zeros past Cin)
    operand_floats = -(-c.in_channels // k_step) * k_step * elem_bytes // FLOAT_BYTES  # a position's channels
    box_floats = operand_floats * math.prod(box) + 4 * (box[2] - qw + 1)
    piece_floats = operand_floats * 64
    floats = box_floats + 2 * PHASE_POOL_RING * piece_floats + 2 * 64 * (box[2] + 8) + 64 * pooled[2]
    smem = FLOAT_BYTES * floats + PHASE_POOL_TABLE_BYTES
    if smem > SMEM_LIMIT:
        return f"{smem // 1024} KB of shared memory"
    return PhasePool(stride, tq, tuple(pooled), emin, box, tuple(tuple(g) for g in groups), tuple(taps),
                     tuple(residues), offsets, weight_taps, piece_floats, smem)


def _balanced_halves(taps: list[int]) -> list[list[int]]:
    """The phases split between the two warpgroups with the smallest larger share of taps (phase 0
    in the first; among equals the first split found), each in phase order; up to 16 phases by
    trying every split, beyond that the largest phase first onto the lighter warpgroup."""
    n = len(taps)
    if n <= 16:
        best = min(range(0, 1 << n, 2), key=lambda m: max(sum(t for i, t in enumerate(taps) if not m >> i & 1),
                                                         sum(t for i, t in enumerate(taps) if m >> i & 1)))
        return [[i for i in range(n) if not best >> i & 1], [i for i in range(n) if best >> i & 1]]
    load, groups = [0, 0], [[], []]
    for ph in sorted(range(n), key=lambda i: (-taps[i], i)):
        wg = 0 if load[0] <= load[1] else 1
        groups[wg].append(ph)
        load[wg] += taps[ph]
    return [sorted(g) for g in groups]


# conv_gemm:pool_ring (pool_ring.cuh): div_max_gap_bias_sum's convolution + pool + sum in the lab
# (lab dm_lab/kernel_cp.cu in docs/performance.md, H100, batch 128): 0.273 ms for the 50.7 GFLOP it computes (47.6 useful:
# it computes 16 channels x 64 columns x whole row blocks), 186 TFLOP/s
POOL_RING_TENSOR_FRACTION = 0.46
POOL_RING_THREADS = 128  # pool_ring.cuh kThreads
POOL_RING_ROWS = 4  # output rows per step (kRowsPerStep)
POOL_RING_COLUMNS = 64  # output columns a step computes (2 warps x 32)
POOL_RING_CHANNELS = 16  # output channels it computes (one m16 tile; fewer are zero-padded weights)
POOL_RING_TAPS = 27  # a 3 x 3 x 3 kernel (kTaps)
POOL_RING_BOX_W = 68  # box columns (kBoxW): the computed ones + the halo, rounded to 4
POOL_RING_SLOTS = 4  # depth slots of the ring (kRing)
MAX_REMEMBERED_SCHEDULES = 10_000  # schedule()'s answers kept (a process planning many models)


@dataclass(frozen=True)
class PoolRing:
    """conv_gemm:pool_ring: the convolution, a 2 x 2 x 2 max pool and a reduction of everything in one
    mma.sync kernel (pool_ring.cuh). A step: 2 output planes x 4 rows x all columns of one sample."""

    pooled: tuple  # the pooled output's size (D, H, W)
    row_blocks: int  # steps along H per plane pair
    splits: int  # steps per sample: the partials the pool_reduce stage's finalize combines
    packed_floats: int  # the weights as A fragments
    smem_bytes: int
    # the reduction keeps the channels (every spatial dim reduced): a partial per step and channel
    per_channel: bool = False


@functools.lru_cache(maxsize=256)
def pool_ring_layout(c, in_spatial: tuple, pooled: tuple, per_channel: bool = False) -> PoolRing | str:
    """The pool_ring kernel's layout for convolution ``c`` on input ``in_spatial`` pooled (2 x 2 x 2,
    floor mode) into ``pooled``, or why it does not apply; ``per_channel``: the reduction keeps the channels."""
    if c.transposed or c.rank != 3:
        return "a 3-D convolution (not transposed) only"
    if tuple(c.kernel) != (3, 3, 3) or any(s != 1 for s in c.stride) or any(c.padding) or any(d != 1 for d in c.dilation):
        return "a 3 x 3 x 3 kernel, stride 1, no padding or dilation only"
    if c.in_channels % 8 or c.out_channels > POOL_RING_CHANNELS:
        return f"{c.in_channels} -> {c.out_channels} channels (needs a multiple of 8 -> at most 16)"
    if in_spatial[2] % 4 or in_spatial[2] > POOL_RING_COLUMNS:
        return f"input rows of {in_spatial[2]} positions (needs a multiple of 4, at most 64)"
    if 0 in pooled:
        return "no whole pool window"
    octets = c.in_channels // 8
    row_blocks = -(-2 * pooled[1] // POOL_RING_ROWS)
    box_rows = POOL_RING_ROWS + 2
    pair = -(-POOL_RING_SLOTS * box_rows * POOL_RING_BOX_W * 2 // 32) * 32 + 4
    packed = octets * POOL_RING_TAPS * 32 * 4  # an A fragment (32 lanes x 4) per octet and tap
    # scratch (pool_ring.cuh kScratchFloats): per warp its sum (per channel: its 16), two steps apart
    scratch = 2 * POOL_RING_THREADS // 32 * (POOL_RING_CHANNELS if per_channel else 1)
    smem = FLOAT_BYTES * (octets * 4 * pair + packed + scratch)
    if smem > SMEM_LIMIT:
        return f"{smem // 1024} KB of shared memory"
    return PoolRing(tuple(pooled), row_blocks, pooled[0] * row_blocks, packed, smem, per_channel)


# A pointwise (1-tap) convolution over an NC[D]HW input is a GEMM whose K rows are whole channel planes: cuDNN
# reads them whole, the generated loops' tiles read short rows of each. Measured on the H200 at [10, C, 224, 224]
# (2026-12-03), cuDNN against the generated convolution: 480 -> 192 0.91 / 3.14 ms, 480 -> 96 0.52 / 4.36,
# 480 -> 64 0.50 / 1.55, 256 -> 64 0.31 / 0.90; 480 -> 16 (the window loop) 0.62 / 0.34, the generated one faster.
POINTWISE_CUDNN_K = 256
POINTWISE_CUDNN_COUT = 64


def _max_taps(lc, in_spatial) -> int:
    """Kernel taps of the convolution, or of its largest sub-pixel phase (K = Cin x this)."""
    if not isinstance(lc.lowering, Subpixel):
        return math.prod(lc.kernel)
    return max(math.prod(ph.taps) for ph in lc.phases(in_spatial))


def _pool_epilogue_window(ops) -> tuple | None:
    """The pool window when ``ops`` (what follows a convolution, up to the first other op) are
    elementwise ops, one max pool of non-overlapping windows (floor mode), elementwise ops and a
    reduction over the channels alone, then elementwise ops: the epilogue phase_pool computes."""
    pools = [o for o in ops if isinstance(o, Pool)]
    reduces = [o for o in ops if isinstance(o, Reduce)]
    if len(pools) != 1 or len(reduces) != 1 or not all(isinstance(o, (Elementwise, Pool, Reduce)) for o in ops):
        return None
    p, r = pools[0], reduces[0]
    if ops.index(p) > ops.index(r) or p.kind != "max" or not p.non_overlapping or p.ceil_mode or tuple(r.dims) != (1,):
        return None
    return tuple(p.kernel)


def _is_pool_2x2x2(p: Pool) -> bool:
    """A 2 x 2 x 2 max pool of non-overlapping windows, floor mode, no padding or dilation."""
    return (p.kind == "max" and tuple(p.kernel) == (2, 2, 2) and tuple(p.stride) == (2, 2, 2) and not any(p.padding)
            and not p.ceil_mode and all(d == 1 for d in p.dilation))


def _pool_ring_reduction(ops, rank: int) -> str | None:
    """Whether ``ops`` (what follows a convolution) are elementwise ops, one 2 x 2 x 2 max pool, elementwise
    ops and a reduction, then elementwise ops: conv_gemm:pool_ring's epilogue. "all": the reduction is of
    every dim (channels and space); "spatial": of every spatial dim (a value per channel); None: neither.
    A second reduction starts a stage of its own (16-bit plans: a per-channel mean, then a sum over the
    channels of its rounded values), so the ops from there on are not the epilogue's."""
    later = [i for i, o in enumerate(ops) if isinstance(o, Reduce)][1:]
    ops = ops[:later[0]] if later else ops
    pools = [o for o in ops if isinstance(o, Pool)]
    reduces = [o for o in ops if isinstance(o, Reduce)]
    if len(pools) != 1 or len(reduces) != 1:
        return None
    p, r = pools[0], reduces[0]
    if ops.index(p) > ops.index(r) or not _is_pool_2x2x2(p):
        return None
    dims = sorted(r.dims)
    return "all" if dims == list(range(1, rank)) else "spatial" if dims == list(range(2, rank)) else None


@dataclass
class ConvGemmStage(ConvStage):
    problems: list = field(default_factory=list)
    schedule: Schedule = None
    fused: Fused | None = None  # a pool_reduce epilogue
    fused_norm: FusedNorm | None = None  # a norm epilogue
    # candidates conv_gemm:recompute and conv_gemm:onepass: the direct-loop schedule they run with
    # the norm stage as the epilogue, and which of the two forms
    norm_schedule: Schedule | None = None
    norm_one_pass: bool = False
    x3_reason: str = ""
    # candidate conv_gemm:phase_pool: the kernel that takes the pool_reduce stage after it (the
    # standalone stage keeps `schedule`)
    phase_pool: PhasePool | None = None
    # candidate conv_gemm:pool_ring: likewise
    pool_ring: PoolRing | None = None
    # the batch_stats stage after it whose per-tile moments its Store epilogue gathers
    moments_for: Stage | None = None
    # ... and nothing reads the output itself (rewrites.batch_stats_pass): on the GPU it is not written
    output_dropped: bool = False
    # a folded convolution whose values a batch norm's batch statistics scale: x rounded as eager's TF32
    # call rounds it, the weights folded from eager's rounded ones and multiplied in split TF32
    # (eager_products_needed)
    eager_products: bool = False

    # ---- what the templates need (text only; the decisions are above)

    def phase_pool_workspace_floats(self) -> int:
        """phase_pool.cuh kWorkspaceFloats: a split last round's partial maxima (per part and warpgroup),
        then its counters."""
        pooled_w = self.phase_pool.pooled[2]
        return 2 * PHASE_POOL_MAX_WORKERS * self.conv.conv.out_channels * pooled_w + PHASE_POOL_MAX_WORKERS

    def phase_pool_packed_floats(self) -> int:
        """phase_pool's packed weights in floats: every phase's taps, as the MMAs take them (TF32 in float32,
        the 16-bit type in 16-bit plans, two to a float)."""
        pp = self.phase_pool
        return sum(len(o) for o in pp.offsets) * pp.piece_floats

    @property
    def rank(self) -> int:
        return self.conv.conv.rank

    @property
    def tf32_half_even(self) -> bool:
        """Whether TF32 operands round ties to even (else away from zero): as eager's cuDNN call rounds
        them, ties to even in its transposed-convolution kernels and away from zero in its NC[D]HW forward
        ones (H100, every layout and form tried: lab tf32_lab/cudnn_rounding.py in docs/performance.md). Behind a
        normalization another rounding than eager's leaves ~5e-4 between the two (KernelBench's #15)."""
        return self.conv.conv.transposed

    def moments_offsets(self) -> list[int]:
        """Per problem (sub-pixel phase), the index of its first tile among a sample's (conv_gemm.cuh
        Geometry kTilesPerSample, phase after phase): where the Store writes a tile's moments."""
        offsets, at = [], 0
        for p in self.problems:
            offsets.append(at)
            at += math.prod(-(-n // t) for n, t in zip(p.out, self.schedule.tile))
        return offsets + [at]

    def moments_tiles(self) -> int:
        """Position tiles of a sample over all problems (a channel's moments per sample)."""
        return self.moments_offsets()[-1]

    def problem_names(self) -> list[str]:
        return ["Problem"] if len(self.problems) == 1 else [f"Phase{i}" for i in range(len(self.problems))]

    def store_staged(self) -> bool:
        """Whether the plain Store epilogue (the conv output written) goes through a staged tile:
        on the mma.sync loops always; on the wgmma loop where the tile fits the plan's shared
        memory (a written output: staged stores ran 0.97-1.01 ms against 1.10-1.15 from the
        accumulators, lab conv_lab's savg_*, docs/performance.md; a fused plan's extra teams may leave no room, and
        its Store only serves the stage run alone); never on the direct loop."""
        sc = self.schedule
        if sc.loop == "direct":
            return False
        if sc.loop != "wgmma":
            return True
        return all(ConvGemm.smem_bytes(q, sc, True) <= sc.smem_bytes for q in self.problems)

    def packed_floats(self) -> int:
        """Packed weight floats of all problems (conv_gemm.cuh: Geometry::kPackedFloats)."""
        sc = self.schedule
        total = 0
        for p in self.problems:
            if sc.loop == "direct":  # [chunk][channel][tap][block_n]
                total += -(-p.cin // sc.cin_chunk) * sc.cin_chunk * math.prod(p.kernel) * sc.block_n
                continue
            taps_hw = p.kernel[1] * p.kernel[2]
            slots = p.kernel[0] * (taps_hw + taps_hw % 2 if sc.cin_chunk == 4 else taps_hw)
            k_steps = sc.cin_chunk * slots // 8
            chunks = -(-p.cin // sc.cin_chunk)
            cblocks = -(-p.cout // sc.block_n)
            splits = 2 if sc.mma == "tf32x3" else 1
            total += cblocks * chunks * k_steps * (sc.block_n // 8) * 32 * 2 * splits
        return total

    def tile_coords(self) -> list[str]:
        """Coordinate names of a position of the convolution output (the epilogue stage's level functions)."""
        return [f"d{i}" for i in range(self.rank)]

    def norm_scratch_floats(self) -> int:
        return norm_scratch_floats(self.schedule)

    def position_decls(self, m: str, clamped: bool = False) -> str:
        """C declarations of the output coordinates (d0, ...) of tile row ``m`` (one problem);
        ``clamped``: into the output (a row past its edge reads parameters in bounds)."""
        parts = []
        for i in range(self.rank):
            dim = "dhw"[3 - self.rank + i]
            coord = f"c.o{dim} + row_{dim}<P>({m})"
            parts.append(f"d{i} = min({coord}, P::kOut{dim.upper()} - 1)" if clamped else f"d{i} = {coord}")
        return "const int " + ", ".join(parts) + ";"

    def spatial_index(self) -> str:
        """Row-major index of (d0, ...) over the convolution output's spatial dims."""
        sizes = self.out_type.spatial
        expr = "d0"
        for i in range(1, self.rank):
            expr = f"({expr}) * {sizes[i]} + d{i}"
        return expr

    def tile_coord_or_zero(self, dim3: int) -> str:
        """The coordinate of 3-D view dim ``dim3`` (0 = D), or 0 where the convolution has no such dim."""
        i = dim3 - (3 - self.rank)
        return f"d{i}" if i >= 0 else "0"

    def _extent(self, dim: str) -> int:
        f = self.fused
        return self.schedule.block_n if dim == "c" else f.pooled_tile["dhw".index(dim)]

    def local_count(self, dims) -> int:
        return math.prod(self._extent(d) for d in dims)

    def unravel_local(self, var: str, dims, tmp: str) -> str:
        """C statements: ``var`` row-major over the tile-local ranges of ``dims`` as l<dim>."""
        if not dims:
            return f"(void){var};"
        lines, rest = [f"int {tmp} = {var};"], list(dims)
        for i, d in enumerate(reversed(rest)):
            n = self._extent(d)
            if i == len(rest) - 1:
                lines.append(f"const int l{d} = {tmp};")
            else:
                lines.append(f"const int l{d} = {tmp} % {n}; {tmp} /= {n};")
        return "\n".join(lines)

    def zero_locals(self, dims) -> str:
        return "\n".join(f"const int l{d} = 0;" for d in dims) or "// (nothing reduced)"

    def absent_locals(self) -> str:
        """Dims the convolution does not have (a 2-d one has no depth): always 0."""
        return "\n".join(f"const int l{d} = 0;" for d in "dhw"[: 3 - self.rank]) or "// (every dim present)"

    def pooled_args(self) -> list[str]:
        return ["pd", "ph", "pw"][3 - self.rank:]

    def kept_index(self) -> str:
        """Row-major index over the epilogue stage's kept dims of its pooled type."""
        f = self.fused
        sizes = {"c": self.conv.conv.out_channels, "d": f.pooled[0], "h": f.pooled[1], "w": f.pooled[2]}
        coord = {"c": "ch", "d": "pd", "h": "ph", "w": "pw"}
        expr = None
        for d in f.kept:
            expr = f"static_cast<long long>({coord[d]})" if expr is None else f"({expr}) * {sizes[d]} + {coord[d]}"
        return expr or "0LL"

    def split_index(self) -> str:
        """The tile's row-major place along the reduced spatial dims."""
        f = self.fused
        expr = "0"
        for i, d in enumerate("dhw"):
            if d not in f.reduced:
                continue
            tiles = -(-f.pooled[i] // f.pooled_tile[i])
            term = f"p{d}0 / kTileP{d.upper()}"
            expr = term if expr == "0" else f"({expr}) * {tiles} + {term}"
        return expr


def _window_m_tiles(sc: Schedule) -> int:
    """The window loop's m-tiles per warp (conv_gemm.cuh Geometry::kMT: 16-row MMA tiles)."""
    return math.prod(sc.tile) // sc.warps_m // 16


def norm_scratch_floats(sc: Schedule) -> int:
    """Shared floats of the norm epilogues (norm_epilogue.j2): per warp row and channel sums,
    then the tile's channel means (the moments); per channel shift and rstd (the apply, which
    uses 2 of the 3 floats per channel this leaves: the plans were measured with this size)."""
    return max(sc.warps_m * sc.block_n + sc.block_n, 3 * sc.block_n)


def _tiles_per_sample(p: Problem, sc: Schedule) -> int:
    return math.prod(-(-o // t) for o, t in zip(p.out, sc.tile))


def _view3(t: tuple, fill) -> tuple:
    return (fill,) * (3 - len(t)) + tuple(t)


class ConvGemm(Family):
    name = "conv_gemm"
    stage_kind = "conv"
    generates_kernel = True
    pieces = ("stage.h", "kernel.cu", "binding.cpp")
    cuda_includes = ("conv_gemm/conv_gemm.cuh", "conv_gemm/phase_pool.cuh", "conv_gemm/pool_ring.cuh")
    summary = ("generated implicit-GEMM convolution on TF32 tensor cores (ieee: fp32 FMAs; 16-bit: TF32 products, exact for "
               "16-bit operands), the next stage fused in")
    dtypes = DTYPES  # 16-bit: loads converted to float, single TF32 products (exact), stores rounded (module docstring)

    def fits(self, ops):
        if len(ops) != 1:
            return False
        lc = lowered(ops[0])
        if lc is None or lc.conv.groups != 1 or isinstance(lc.lowering, TapSums):
            return False  # (a convolution of tap sums is small: ATen's)
        if isinstance(lc.lowering, Subpixel):
            return True
        return not lc.transposed  # a transposed convolution runs as its phases (or folded with a pool)

    def unsupported(self, req: StageRequest) -> str | None:
        """Why this family cannot (or should not) compute the request's convolution; None if it can."""
        if req.pipeline.conv_impl == "aten":
            return "the spec asks for ATen (plan.conv: aten)"
        if not req.input.dense:
            return "its input is not a dense tensor"
        lc = lowered(req.ops[0])
        c = lc.conv
        taps = _max_taps(lc, req.types[0].spatial)
        half = req.dtype != "float32"
        if half and lc.bias_deferred:
            return "a 16-bit convolution adds its own bias (the plan keeps it: plan.defer_conv_bias)"
        try:
            mma = "tf32" if half else "fp32" if req.pipeline.precision == "ieee" else "tf32x3"
            self.schedule(lc, self.problems(lc, req.types[0], req.types[1]), True, mma, req.target, DTYPE_BYTES[req.dtype])
        except KgenError as e:
            return f"no tile fits: {e}"
        forced = req.pipeline.conv_impl == "gemm"
        if not forced and before_eager_batch_norm(req.pipeline, req.start):
            return ("a training-mode batch norm after it runs as eager's call, so this convolution does too "
                    "(its bits are the norm's input: Pipeline.eager_batch_norms)")
        if not forced and not half and req.pipeline.precision == "ieee" and c.in_channels * taps > DIRECT_MAX_K:
            return (f"precision ieee: K = {c.in_channels} channels x {taps} taps is above {DIRECT_MAX_K}, where "
                    "the fp32 direct loop is no faster than ATen's fp32 convolution")
        k_rule = self._k_rule(req)
        if k_rule and not isinstance(self.phase_pool(req), PhasePool) and not isinstance(self.pool_ring(req), PoolRing):
            return k_rule
        return None

    @staticmethod
    def _k_rule(req: StageRequest) -> str | None:
        """Why cuDNN beats the generated loops on this convolution (None: it does not, or the spec
        asks for the generated one); conv_gemm:phase_pool is measured against it, not ruled out."""
        if req.pipeline.conv_impl == "gemm":
            return None
        lc = lowered(req.ops[0])
        c = lc.conv
        taps = _max_taps(lc, req.types[0].spatial)
        if c.in_channels * taps > CUDNN_GEMM_K or c.out_channels > CUDNN_GEMM_COUT:
            return (f"K = {c.in_channels} channels x {taps} taps, {c.out_channels} output channels: "
                    "large enough for cuDNN's tensor-core GEMMs")
        if taps == 1 and c.in_channels >= POINTWISE_CUDNN_K and c.out_channels >= POINTWISE_CUDNN_COUT \
                and req.input.layout == "contiguous":
            return (f"a pointwise convolution of {c.in_channels} channels to {c.out_channels} over an NC[D]HW input: "
                    "cuDNN's GEMM reads its channel rows whole")
        return None

    def _fused_pool_epilogue(self, req: StageRequest) -> list | str:
        """What phase_pool and pool_ring share: TF32 products (16-bit plans: exact), a plain NC[D]HW input and a
        pool_reduce stage next; its ops (the elementwise ops, pools and reductions after the convolution), or why not."""
        if self.mma(req)[0] != "tf32":
            return "TF32 products only"
        if not req.input.flat or req.input.layout != "contiguous":
            return "its input is not a plain NC[D]HW tensor"
        if req.next_family is None or req.next_family.name != "pool_reduce":
            return "no pool_reduce stage after it"
        following = []
        for o in req.pipeline.ops[req.start + len(req.ops):]:
            if not isinstance(o, (Elementwise, Pool, Reduce)):
                break
            following.append(o)
        return following

    def phase_pool(self, req: StageRequest) -> PhasePool | str:
        """The layout of candidate conv_gemm:phase_pool for the request, or why it does not apply:
        a strided transposed convolution (sub-pixel phases) in TF32 on a wgmma target, read from a
        plain NC[D]HW tensor, before a pool_reduce stage of a max pool and a channel reduction."""
        lc = lowered(req.ops[0])
        if not isinstance(lc.lowering, Subpixel):
            return "not a strided transposed convolution"
        if not req.target.wgmma:
            return "no wgmma on this target"
        following = self._fused_pool_epilogue(req)
        if isinstance(following, str):
            return following
        window = _pool_epilogue_window(following)
        if window is None:
            return "the next stage is not a max pool and a reduction over the channels"
        out = req.types[1].spatial
        pooled = tuple(o // w for o, w in zip(out, window))
        if 0 in pooled:
            return "no whole pool window"
        return phase_pool_layout(lc.conv, window, pooled, DTYPE_BYTES[req.dtype])

    def pool_ring(self, req: StageRequest) -> PoolRing | str:
        """The layout of candidate conv_gemm:pool_ring for the request, or why it does not apply: a
        convolution in TF32 read from a plain NC[D]HW tensor (float32: its bias left to the next stage; 16-bit
        plans keep it, the kernel adds it), before a pool_reduce stage of elementwise ops, a 2 x 2 x 2 max pool
        and a reduction of everything or of every spatial dim."""
        lc = lowered(req.ops[0])
        if type(lc.lowering) is not Direct:  # a crop (dead region) is fine: it keeps every whole pool window
            return "not a plain convolution"
        if lc.conv.bias and not lc.bias_deferred and req.dtype == "float32":
            return "the convolution adds its own bias"
        following = self._fused_pool_epilogue(req)
        if isinstance(following, str):
            return following
        reduction = _pool_ring_reduction(following, req.types[1].rank)
        if reduction is None:
            return "the next stage is not a 2 x 2 x 2 max pool and a reduction of everything or of every spatial dim"
        pooled = tuple(o // 2 for o in req.types[1].spatial)
        return pool_ring_layout(lc.conv, tuple(req.types[0].spatial), pooled, reduction == "spatial")

    # ------------------------------------------------------------ problems

    def problems(self, lc, t_in, t_out) -> list[Problem]:
        c = lc.conv
        L, full = _view3(t_in.spatial, 1), _view3(t_out.spatial, 1)
        ones, zeros = (1, 1, 1), (0, 0, 0)
        if isinstance(lc.lowering, Subpixel):
            out = []
            for ph in lc.phases(t_in.spatial):
                K = c.kernel
                out.append(Problem(
                    cin=c.in_channels, cout=c.out_channels, input=L, out=_view3(ph.count, 1), kernel=_view3(ph.taps, 1),
                    stride=ones, padding=_view3(tuple(p - o for p, o in zip(ph.padding, ph.offset)), 0), dilation=ones,
                    out_stride=_view3(c.stride, 1), out_residue=_view3(ph.residue, 0), full=full,
                    weight_transposed=True, weight_kernel=_view3(K, 1),
                    weight_start=_view3(tuple(k - 1 - s for k, s in zip(K, ph.weight_start)), 0),
                    weight_step=_view3(tuple(-s for s in c.stride), 1),
                ))
            return out
        kernel = lc.kernel
        return [Problem(
            cin=c.in_channels, cout=c.out_channels, input=L, out=full, kernel=_view3(kernel, 1),
            stride=_view3(lc.stride, 1), padding=_view3(lc.padding, 0), dilation=_view3(lc.dilation, 1),
            out_stride=ones, out_residue=zeros, full=full, weight_transposed=False,
            weight_kernel=_view3(kernel, 1), weight_start=zeros, weight_step=ones,
        )]

    # ------------------------------------------------------------ schedule

    @staticmethod
    def smem_bytes(p: Problem, sc: Schedule, staged: bool, scratch_floats: int = 0) -> int:
        """Shared memory of a CTA, as conv_gemm.cuh's Geometry lays it out (with the epilogue's scratch)."""
        tile = sc.tile
        box = [(t - 1) * s + (k - 1) * d + 1 for t, s, k, d in zip(tile, p.stride, p.kernel, p.dilation)]
        m = math.prod(tile)
        tile_floats = sc.block_n * (m + (4 - m % 32) % 32) if staged else 0
        splits = 2 if sc.mma == "tf32x3" else 1
        if sc.loop == "direct":  # resident weights | input stages (no rounding: no lo parts) | staged tile
            weights = -(-p.cin // sc.cin_chunk) * sc.cin_chunk * math.prod(p.kernel) * sc.block_n
        else:
            weights = 0
        if sc.loop == "wgmma":  # resident weights | per team: the A buffer (channel quads, W phases) | staged tile, scratch
            weights = splits * -(-p.cin // sc.cin_chunk) * math.prod(p.kernel) * sc.block_n * 8
            row = 4 * p.stride[2] * -(-box[2] // p.stride[2])
            a_buffer = splits * (sc.cin_chunk // 4) * box[0] * box[1] * row
            return 4 * (weights + sc.teams * (a_buffer + tile_floats + scratch_floats))
        vec = (p.input[2] % 4 == 0 and (tile[2] * p.stride[2]) % 4 == 0 and p.padding[2] % 4 == 0
               and sc.plane_residue % 4 == 0)
        row = box[2] + (1 if sc.loop == "window" else 0)
        row = -(-row // 4) * 4 if vec else -(-row // 2) * 2
        plane = box[0] * box[1] * row
        plane += (sc.plane_residue - plane % 32) % 32
        stage = -(-sc.cin_chunk * plane // 4) * 4
        half = sc.input_bytes == 2  # (conv_gemm.cuh kRawStage: the stages as stored, converted into one fp32 buffer)
        floats = weights + sc.stages * (stage // 2 if half else stage) + (stage if sc.mma == "tf32x3" or half else 0)
        if staged and tile_floats + scratch_floats <= stage:
            return 4 * floats  # the staged tile and scratch live in the last chunk's input stage (tile_in_stage)
        return 4 * (floats + tile_floats + scratch_floats)

    def schedule(self, lc, problems: list[Problem], staged: bool, mma: str, target: Target,
                 input_bytes: int = FLOAT_BYTES) -> Schedule:
        """``_schedule``, remembered: planning asks for the same convolution's schedule once per plan it tries
        (every argument is a value)."""
        found = self._remembered_schedule(lc, tuple(problems), staged, mma, target, input_bytes)
        if isinstance(found, KgenError):
            raise found.with_traceback(None)  # (each raise would otherwise lengthen the remembered one's traceback)
        return found

    @functools.lru_cache(maxsize=MAX_REMEMBERED_SCHEDULES)
    def _remembered_schedule(self, lc, problems: tuple[Problem, ...], staged: bool, mma: str, target: Target,
                             input_bytes: int) -> Schedule | KgenError:
        """``_schedule``'s answer, or the KgenError it raised (lru_cache remembers no exceptions)."""
        try:
            return self._schedule(lc, list(problems), staged, mma, target, input_bytes)
        except KgenError as e:
            return e

    def _schedule(self, lc, problems: list[Problem], staged: bool, mma: str, target: Target,
                  input_bytes: int = FLOAT_BYTES) -> Schedule:
        """Tile shapes measured on the H100 (lab conv_lab, docs/performance.md): the wgmma loop
        where it wins (WGMMA_MIN_COUT), in the first of WGMMA_SHAPES that fits (teams of one
        warpgroup on 8 x 8 tiles sharing the weights); else the window loop with 4 m-tiles of 16
        per warp for stride-1 convolutions (4 x 16 x 16 for the phases of a 3-d transposed
        convolution with few input and output channels: PHASE_BIG_TILE_MAX_CIN / _COUT; also where the kernel
        writes only the tiles' moments: 2 x 8 x 16 tiles, 6 CTAs per SM, made #72's pass 453 -> 425 us but its
        moments' merge 41 -> 90 us); 4 x 32 tiles otherwise. fp32 (precision ieee): the direct loop."""
        c = lc.conv
        if mma == "fp32":
            return self.direct_schedule(lc, problems, staged)
        if target.wgmma and mma == "tf32" and c.rank >= 2 and c.in_channels >= 8 and c.out_channels >= WGMMA_MIN_COUT:
            sc = self.wgmma_schedule(problems, -(-c.out_channels // 16) * 16, mma, staged, input_bytes=input_bytes)
            if sc is not None:
                return sc
        cin_chunk = 4 if c.in_channels <= 4 else 8
        block_n = min(-(-c.out_channels // 8) * 8, 64)
        window = all(q.stride[1] == 1 and q.stride[2] == 1 for q in problems)
        loop = "window" if window else "generic"
        # each warp column takes whole 8-column tiles; the window loop's 64-channel blocks in four columns:
        # 16 warps of 128 registers hide its latency better than 8 of 186 (lab, H200: KernelBench #87's
        # convolution alone 2.16 -> 1.85 ms, with its epilogue 2.39 -> 2.31; docs/performance.md)
        warps_n = 2 if block_n > 32 and block_n % 16 == 0 else 1
        # measured on 2-d convolutions only; 3-d ones hold more index registers (KernelBench #90's
        # conv3d 8 -> 64 with a GELU epilogue spilled 20 bytes at 128 registers)
        if window and block_n == 64 and c.rank == 2 and len(problems) == 1:  # not sub-pixel phases (phase_pool, rounds)
            warps_n = WINDOW_WIDE_WARPS_N
        rank = c.rank
        if window:  # (tile, warps_m), largest first; kMT rows in H per warp
            mt = WINDOW_M_TILES if rank >= 2 else 1
            # (TF32 products only: split TF32's second operand parts spill at the 128 registers of 16 warps)
            phases_big = ([((4, 4 * mt, 16), 16)] if len(problems) > 1 and c.in_channels <= PHASE_BIG_TILE_MAX_CIN
                          and block_n <= PHASE_BIG_TILE_MAX_COUT and mma == "tf32" else [])
            tiles = {3: phases_big + [((2, 2 * mt, 16), 4), ((1, 2 * mt, 16), 2), ((1, mt, 16), 1)],
                     2: [((1, 2 * mt, 32), 4), ((1, 2 * mt, 16), 2), ((1, mt, 16), 1)],
                     1: [((1, 1, 64), 4), ((1, 1, 32), 2), ((1, 1, 16), 1)]}[rank]
        else:
            tiles = ([((1, 4, 32), 4), ((1, 2, 32), 4), ((1, 1, 32), 2), ((1, 1, 16), 1)] if rank >= 2
                     else [((1, 1, 128), 4), ((1, 1, 64), 4), ((1, 1, 32), 2), ((1, 1, 16), 1)])
        for tile, warps_m in tiles:  # the largest tile whose input box fits in shared memory
            sc = Schedule(tile, cin_chunk, block_n, warps_m, warps_n, STAGES, PLANE_RESIDUE, loop, mma, 0, input_bytes=input_bytes)
            sc = replace(sc, smem_bytes=max(self.smem_bytes(q, sc, staged) for q in problems))
            if sc.smem_bytes <= SMEM_LIMIT:
                break
        self.check(sc, problems)
        return sc

    def wgmma_schedule(self, problems: list[Problem], block_n: int, mma: str, staged: bool,
                       scratch_floats: int = 0, input_bytes: int = FLOAT_BYTES) -> Schedule | None:
        """The first of WGMMA_SHAPES whose shared memory fits (None if none does)."""
        for tile, warps_m, warps_n, teams in WGMMA_SHAPES:
            # one register stage (conv_gemm.cuh BoxRegs) instead of cp.async stages
            sc = Schedule(tile, 8, block_n, warps_m, warps_n, 1, PLANE_RESIDUE, "wgmma", mma, 0, teams, input_bytes)
            sc = replace(sc, smem_bytes=max(self.smem_bytes(q, sc, staged, scratch_floats) for q in problems))
            if sc.smem_bytes <= SMEM_LIMIT:
                self.check(sc, problems)
                return sc
        return None

    def direct_schedule(self, lc, problems: list[Problem], staged: bool, scratch_floats=lambda sc: 0) -> Schedule:
        """The direct loop: all output channels in one CTA, split over warp columns of at most
        32 channels; positions per thread as many as DIRECT_MAX_ACC accumulators allow (8 at
        16 channels: 4 warps of 32 x 8 positions, lanes along W), about 4 warps; W tiles of 32 unless the
        output is narrower; the largest tile whose stages fit (measured on instnorm_clamp_max's
        3 -> 16 convolution: lab conv_lab's dinst_*, docs/performance.md)."""
        c = lc.conv
        block_n = -(-c.out_channels // 8) * 8
        warps_n = next(w for w in range(1, block_n // 8 + 1) if block_n % (8 * w) == 0 and block_n // w <= 32)
        per_thread = max(2, min(8, DIRECT_MAX_ACC // (block_n // warps_n)) // 2 * 2)
        cin_chunk = min(c.in_channels, 4)  # small stages: a staged epilogue tile still fits beside them
        out_w = max(q.out[2] for q in problems)
        tw = 32 if out_w >= 24 or c.rank == 1 else 16 if out_w >= 12 else 8
        warps_m = max(1, 4 // warps_n)  # at most ~4 warps: 128 accumulators and the loads need ~200 registers
        sc = None
        while warps_m >= 1:
            m = 32 * per_thread * warps_m
            rest = m // tw  # rows of the tile in (D, H)
            tiles = ([(1, 1, m)] if c.rank == 1 else [(1, rest, tw)] if c.rank == 2 else
                     [(2, rest // 2, tw), (1, rest, tw)] if rest >= 2 else [(1, rest, tw)])
            for tile in tiles:
                sc = Schedule(tile, cin_chunk, block_n, warps_m, warps_n, STAGES, PLANE_RESIDUE, "direct", "fp32", 0)
                sc = replace(sc, smem_bytes=max(self.smem_bytes(q, sc, staged, scratch_floats(sc)) for q in problems))
                if sc.smem_bytes <= SMEM_LIMIT:
                    self.check(sc, problems)
                    return sc
            warps_m //= 2
        self.check(sc, problems)  # raises: nothing fits
        return sc

    @staticmethod
    def check(sc: Schedule, problems: list[Problem]) -> None:
        """The kernel's static constraints (conv_gemm.cuh's static_asserts), at plan time."""
        m = math.prod(sc.tile)
        mt = m // sc.warps_m // 16
        direct = sc.loop == "direct"
        rules = {
            "kCI is 4 or a multiple of 8 (the direct loop: any)": direct or sc.cin_chunk == 4 or sc.cin_chunk % 8 == 0,
            "the direct loop and only it computes in fp32": direct == (sc.mma == "fp32"),
            "tile rows split into 16-row MMA tiles per warp": m % (16 * sc.warps_m) == 0,
            "kBN splits into 8-column MMA tiles per warp": sc.block_n % (8 * sc.warps_n) == 0,
            f"shared memory within {SMEM_LIMIT} bytes": sc.smem_bytes <= SMEM_LIMIT,
            "16-bit input: single TF32 products on a tensor-core loop": sc.input_bytes == FLOAT_BYTES or sc.mma == "tf32",
        }
        if sc.loop == "wgmma":
            rules["wgmma loop: tiles of 8 in W and 8k in H, kCI 8, all channels in one block of whole 16-column halves"] = (
                sc.tile[2] == 8 and sc.tile[1] % 8 == 0 and sc.cin_chunk == 8 and sc.warps_m % 4 == 0
                and (m // 64) % (sc.warps_m // 4) == 0 and all(p.cout <= sc.block_n for p in problems)
                and sc.block_n <= 128 and (sc.block_n // sc.warps_n) % 8 == 0)
        if direct:
            rules["direct loop: an even number of positions per thread, 16-byte weight loads, one channel block"] = (
                m % (64 * sc.warps_m) == 0 and (sc.block_n // sc.warps_n) % 4 == 0
                and all(p.cout <= sc.block_n for p in problems))
        if sc.loop == "window":
            rules["window loop: stride 1 in H and W, kCI 4 or 8, warps tile (TD, TH / kMT, TW / 16)"] = (
                all(p.stride[1] == p.stride[2] == 1 for p in problems) and sc.cin_chunk in (4, 8)
                and sc.tile[2] % 16 == 0 and mt > 0 and sc.tile[1] % mt == 0 and sc.plane_residue % 2 == 0
                and sc.tile[0] * (sc.tile[1] // mt) * (sc.tile[2] // 16) == sc.warps_m)
        broken = [rule for rule, ok in rules.items() if not ok]
        if broken:
            raise KgenError(f"conv_gemm schedule {sc} breaks: {'; '.join(broken)}")

    @staticmethod
    def eager_products_needed(req: StageRequest) -> bool:
        """Whether the stage's convolution is a transposed one folded with an average pool whose values
        a batch norm's batch statistics then scale (rewrites.batch_stats_pass). Eager pools its TF32
        convolution's values; the statistics divide by their spread, which shows a difference of one
        TF32 rounding of the folded weights (2e-4 after the norm on KernelBench #72's data, tolerance
        1e-4). So the folded convolution multiplies x rounded as eager rounds it (ties to even) by the
        weights folded from eager's rounded ones in split TF32: eager's products, summed in another
        order (lab tf32_lab/folded_batch_stats.py in docs/performance.md)."""
        lc = lowered(req.ops[0])
        if lc is None or not isinstance(lc.lowering, Folded) or not lc.conv.transposed:
            return False
        scales = {op.scale.name for op in req.pipeline.ops if isinstance(op, BatchStats)}
        return any(isinstance(o, Elementwise) and o.param in scales for o in later_ops(req))

    @classmethod
    def mma(cls, req: StageRequest) -> tuple[str, str]:
        """TF32 products where they are as accurate as eager's, else split TF32 (about fp32
        accuracy; base.conv_precision says which and why). 16-bit plans: TF32 products, exact for 16-bit operands."""
        if req.dtype != "float32":
            if isinstance(lowered(req.ops[0]).lowering, Folded):
                return "tf32", ("tf32: the folded weights (box sums of the 16-bit weights) round to TF32, the input is exact "
                                "in it; the folded pool's mean averages the products' rounding")
            return "tf32", (f"tf32, exact for 16-bit operands ({req.dtype} values are exact in TF32: fp32 accumulation "
                            "as eager's 16-bit tensor-core convolution)")
        if req.pipeline.precision == "tf32" and cls.eager_products_needed(req):
            return "tf32x3", ("eager's transposed convolution, folded with its pool, before a batch norm's statistics: "
                              "x rounded as eager's TF32 call, the folded weights in split TF32")
        if req.pipeline.precision == "ieee":
            return "fp32", "the spec asks for ieee: plain fp32 FMAs (the direct loop)"
        if req.pipeline.precision == "tf32x3":
            return "tf32x3", "the spec asks for tf32x3"
        fp32_level, why = conv_precision(req)
        return ("tf32x3", f"{why}: fp32-level accuracy, as eager's") if fp32_level else ("tf32", f"{why}: TF32 products")

    def make_stage(self, req: StageRequest) -> ConvGemmStage:
        lc = lowered(req.ops[0])
        t_in, t_out = req.types
        st = ConvGemmStage(req.index, list(req.ops), t_in, t_out, input=req.input, conv=lc, layout="contiguous")
        st.problems = self.problems(lc, t_in, t_out)
        st.dtype = req.dtype
        mma, st.x3_reason = self.mma(req)
        st.eager_products = req.dtype == "float32" and req.pipeline.precision == "tf32" and self.eager_products_needed(req)  # (mma: tf32x3)
        # the plain epilogue stores a staged tile (the direct loop stores from its accumulators)
        st.schedule = self.schedule(lc, st.problems, mma != "fp32", mma, req.target, DTYPE_BYTES[req.dtype])
        st.input_extent = tuple(t_in.spatial)
        st.output = flat_buffer(t_out)
        return st

    # ------------------------------------------------------------ epilogue

    def gathers_statistics(self, st: Stage, nxt: Stage) -> bool:
        """A batch_stats stage (its generated kernels) right after a convolution that stores through a
        staged tile and has no epilogue of its own: the Store reads each tile back for its moments per
        channel, so the statistics need no read of the output (KernelBench #72: 1 GB, 0.34 ms). Tiles of at
        least GATHER_MIN_TILE positions: a warp reduces each channel of each tile (two shuffle trees)."""
        from .batch_stats import BatchStatsStage

        # (float32 only: in 16 bits the statistics are of the output rounded to the dtype, as eager's, not of the
        # accumulators the Store reads back)
        return (st.dtype == "float32" and isinstance(nxt, BatchStatsStage) and not nxt.columns and st.epilogue is None and st.fused_norm is None
                and st.phase_pool is None and st.pool_ring is None and st.store_staged()
                and math.prod(st.schedule.tile) >= GATHER_MIN_TILE and nxt.input == st.output)

    def writes_channel_slice(self, st: Stage) -> bool:
        """The convolution's own store (no epilogue, no statistics) addresses samples P::kOutSample apart."""
        return (st.epilogue is None and st.output.flat and st.moments_for is None and st.fused_norm is None
                and st.phase_pool is None and st.pool_ring is None)

    def absorbs_epilogue(self, st: Stage, nxt: Stage) -> bool:
        """A pool_reduce stage whose pools tile the convolution output in whole windows, or
        a norm stage where the convolution is cheap enough to compute twice; for conv_gemm:phase_pool,
        the pool_reduce stage it was planned for."""
        if st.phase_pool is not None:
            return self._absorbs_phase_pool(st, nxt)
        if st.pool_ring is not None:
            return self._absorbs_pool_ring(st, nxt)
        if len(st.problems) != 1 or nxt.input != st.output:
            return False
        if nxt.family.name == "norm":
            return self._absorbs_norm(st, nxt)
        if nxt.family.name != "pool_reduce":
            return False
        window = [1, 1, 1]
        for lv in nxt.levels[1:]:
            p: Pool = lv.pool
            if not p.non_overlapping:
                return False
            for d, k in enumerate(_view3(p.kernel, 1)):
                window[d] *= k
        window = tuple(window)
        red = nxt.reduce
        rank = st.conv.conv.rank
        names = ("c",) + ("d", "h", "w")[3 - rank:]
        reduced = tuple(names[d - 1] for d in (red.dims if red else ()))
        kept = tuple(n for n in names if n not in reduced)
        if "c" in reduced and st.conv.conv.out_channels > st.schedule.block_n:
            return False  # a channel reduction needs every channel in the CTA
        sc = st.schedule
        registers = len(nxt.levels) == 1 and not kept
        if sc.warps_n == WINDOW_WIDE_WARPS_N and (reduced or window != (1, 1, 1)):
            sc = replace(sc, warps_n=2)  # a reducing epilogue's registers do not fit 128 (#82 spilled)
        if sc.loop == "wgmma":  # as many teams as fit beside this epilogue's staged tile (if any)
            sc = self.wgmma_schedule(st.problems, sc.block_n, sc.mma, not registers, FUSED_SCRATCH_FLOATS, sc.input_bytes) or sc
        if any(t % w for t, w in zip(sc.tile, window)):
            return False  # a tile must hold whole windows
        pooled = _view3(nxt.pooled_type.spatial, 1)
        pooled_tile = tuple(t // w for t, w in zip(sc.tile, window))
        register_pool = not kept and self._register_pool(sc, nxt, rank, st.problems[0].out, pooled, pooled_tile)
        scratch = FUSED_SCRATCH_FLOATS
        if register_pool:  # the block sum's, then the depth-1 warps' window maxima (kMT / 2 x kNT x 2 per lane)
            scratch += (sc.warps_m // 2) * 32 * (_window_m_tiles(sc) // 2) * (sc.block_n // 8) * 2
        splits = 1
        for d, n in enumerate(("d", "h", "w")):
            if n in reduced:
                splits *= -(-pooled[d] // pooled_tile[d])
        local_kept = math.prod((sc.block_n if n == "c" else pooled_tile["dhw".index(n)]) for n in kept)
        local_reduced = math.prod((sc.block_n if n == "c" else pooled_tile["dhw".index(n)]) for n in reduced)
        threads = 32 * sc.warps_m * sc.warps_n
        # threads per output: enough that every thread has work (whole warps combine through shared memory)
        lanes = 1 if local_reduced == 1 else min(threads, pow2_floor(local_reduced), max(1, pow2_floor(threads // max(1, local_kept))))
        # the accumulator tile is staged unless the epilogue works on the registers
        smem = max(self.smem_bytes(q, sc, not (registers or register_pool), scratch) for q in st.problems)
        if smem > SMEM_LIMIT:
            return False
        st.schedule = replace(sc, smem_bytes=smem)
        st.fused = Fused(window, pooled_tile, pooled, kept, reduced, splits, lanes, registers, register_pool, scratch)
        if st.fused.elementwise and any(isinstance(op, Elementwise) and op.libm for op in nxt.ops):
            st.fused = replace(st.fused, batch=EPILOGUE_BATCH)
        return True

    @staticmethod
    def _register_pool(sc: Schedule, nxt: Stage, rank: int, out: tuple, pooled: tuple, pooled_tile: tuple) -> bool:
        """Fused.register_pool applies: the window loop (a warp's m-tiles are kMT rows in H at one
        depth, fragment rows g and g + 8 the positions 2g and 2g + 1) with two depths per tile and an
        even kMT, one warp column, and the stage's only pool a 2 x 2 x 2 max pool without padding.
        It writes one partial per tile, so every tile must hold a pooled window: a tile past the last
        whole window (an odd size in floor mode) takes the staged epilogue, which skips such tiles."""
        if sc.loop != "window" or rank != 3 or sc.warps_n != 1 or sc.tile[0] != 2 or len(nxt.levels) != 2:
            return False
        p: Pool = nxt.levels[1].pool
        return (_window_m_tiles(sc) % 2 == 0 and p.kind == "max" and tuple(p.kernel) == (2, 2, 2)
                and tuple(p.stride) == (2, 2, 2) and not any(p.padding) and not p.ceil_mode
                and all(d == 1 for d in p.dilation)
                and all(-(-q // qt) == -(-o // t) for q, qt, o, t in zip(pooled, pooled_tile, out, sc.tile)))

    @staticmethod
    def _absorbs_phase_pool(st: ConvGemmStage, nxt: Stage) -> bool:
        """phase_pool computes nothing but its epilogue: the stage after it must be the one
        ``phase_pool`` planned for (else the plan is not made)."""
        pp = st.phase_pool
        ok = (nxt.family.name == "pool_reduce" and nxt.input == st.output and len(nxt.levels) == 2
              and nxt.reduce is not None and tuple(nxt.reduce.dims) == (1,))
        if ok:
            pool: Pool = nxt.levels[1].pool
            ok = (pool.kind == "max" and pool.non_overlapping
                  and tuple(pool.kernel) == tuple(q * s for q, s in zip(pp.tq, pp.stride))
                  and tuple(nxt.pooled_type.spatial) == pp.pooled)
        if not ok:
            raise KgenError(f"conv_gemm:phase_pool at stage {st.index}: stage {nxt.index} is not the max pool and "
                            "channel reduction it was planned for")
        return True

    @staticmethod
    def _absorbs_pool_ring(st: ConvGemmStage, nxt: Stage) -> bool:
        """pool_ring computes nothing but its epilogue: the stage after it must be the 2 x 2 x 2 max pool
        and reduction (of everything, or of every spatial dim: per_channel) ``pool_ring`` planned for (else the
        plan is not made)."""
        first = 2 if st.pool_ring.per_channel else 1
        ok = (nxt.family.name == "pool_reduce" and nxt.input == st.output and len(nxt.levels) == 2
              and nxt.reduce is not None and sorted(nxt.reduce.dims) == list(range(first, 1 + st.rank + 1))
              and _is_pool_2x2x2(nxt.levels[1].pool) and tuple(nxt.pooled_type.spatial) == st.pool_ring.pooled)
        if not ok:
            raise KgenError(f"conv_gemm:pool_ring at stage {st.index}: stage {nxt.index} is not the max pool and "
                            "reduction it was planned for")
        return True

    def _absorbs_norm(self, st: ConvGemmStage, nxt: Stage) -> bool:
        """The candidates ``conv_gemm:recompute`` and ``conv_gemm:onepass`` take the norm stage after it."""
        sc = st.norm_schedule
        if sc is None:
            return False
        st.schedule = sc
        st.x3_reason = "a normalization follows: fp32 products (the split TF32's accuracy or better)"
        st.fused_norm = FusedNorm(_tiles_per_sample(st.problems[0], sc), nxt.norm.num_groups,
                                  nxt.reduce.fn if nxt.reduce else "", st.norm_one_pass)
        return True

    def norm_schedule(self, st: ConvGemmStage, one_pass: bool, target: Target) -> Schedule | None:
        """The direct-loop schedule of a fused norm, or None where it does not apply: fp32
        products are at least as accurate as the split TF32 a normalization asks for (``mma``);
        K small enough that computing the convolution twice can pay (NORM_RECOMPUTE_MAX_K, the
        shape measured); at most 32 output channels, one warp column (a thread holds every channel
        of its positions: a reduction over them stays in registers). The one-pass form also needs
        a sample's tiles to run at once: at most one per SM here (the kernel checks the device's
        real count at launch). float32 only (16-bit plans: the direct loop has no 16-bit loads yet)."""
        if st.dtype != "float32" or len(st.problems) != 1 or st.schedule.mma not in ("fp32", "tf32x3"):
            return None
        p = st.problems[0]
        if p.cin * math.prod(p.kernel) > NORM_RECOMPUTE_MAX_K:
            return None
        try:
            sc = self.direct_schedule(st.conv, st.problems, False, scratch_floats=norm_scratch_floats)
        except KgenError:
            return None
        if sc.warps_n != 1 or (one_pass and _tiles_per_sample(p, sc) > target.sm_count):
            return None
        return sc

    def candidates(self, req: StageRequest) -> list[Candidate]:
        """The generated loops' candidates (``_loop_candidates``; none where cuDNN's GEMMs win:
        ``_k_rule``), and ``conv_gemm:phase_pool`` and ``conv_gemm:pool_ring`` where they apply
        (``phase_pool``, ``pool_ring``)."""
        out = [] if self._k_rule(req) else self._loop_candidates(req)
        pp = self.phase_pool(req)
        if isinstance(pp, PhasePool):
            st = self.make_stage(req)
            st.phase_pool = pp
            out.append(Candidate(f"{self.name}:phase_pool", st))
        pr = self.pool_ring(req)
        if isinstance(pr, PoolRing):
            st = self.make_stage(req)
            st.pool_ring = pr
            out.append(Candidate(f"{self.name}:pool_ring", st))
        return out

    def _loop_candidates(self, req: StageRequest) -> list[Candidate]:
        """Before a norm stage, three ways (``kgen tune`` measures them; the issue's choice between
        writing the convolution once and computing it twice, and a third that does neither):
        ``conv_gemm`` writes the output and the norm stage reads it twice; ``conv_gemm:recompute``
        takes the norm stage as a two-pass epilogue, ``conv_gemm:onepass`` as a one-pass epilogue
        on co-resident CTAs, where ``norm_schedule`` allows."""
        st = self.make_stage(req)
        written = Candidate(self.name, st)
        form = req.pipeline.conv_norm  # plan.conv_norm
        if form == "written" or req.next_family is None or req.next_family.name != "norm":
            return [written]
        out = [] if form != "auto" else [written]
        for name, one_pass in (("recompute", False), ("onepass", True)):
            if form not in ("auto", name):
                continue
            sc = self.norm_schedule(st, one_pass, req.target)
            if sc is not None:
                alt = self.make_stage(req)
                alt.norm_schedule, alt.norm_one_pass = sc, one_pass
                out.append(Candidate(f"{self.name}:{name}", alt))
        return out or [written]

    def work(self, st: ConvGemmStage, batch: int, target: Target) -> list[Work]:
        """The weight pack, then one launch: the input read once, the output (or, with an
        epilogue fused in, the epilogue's output) written once; split TF32 triples the MMAs;
        the direct loop runs on the FP32 cores."""
        lc, c = st.conv, st.conv.conv
        flops = batch * lc.flops(st.in_type, st.out_type) * (3 if st.schedule.mma == "tf32x3" else 1)
        out_type = st.epilogue.out_type if st.epilogue is not None else st.out_type
        size = DTYPE_BYTES[st.dtype]  # an input or output value (the packed weights are fp32 in every dtype)
        written = (MOMENT_BYTES * c.out_channels * st.moments_tiles() if st.output_dropped else size * out_type.sample_numel)
        nbytes = size * batch * st.in_type.sample_numel + FLOAT_BYTES * math.prod(c.weight_shape()) + batch * written
        rate = (target.fp32_flops * DIRECT_FP32_FRACTION if st.schedule.loop == "direct"
                else target.tensor_flops * GEMM_TENSOR_FRACTION)
        phases = len(st.problems) > 1
        launches = 2 if st.fused is not None and st.fused.splits > 1 else 1  # the fused reduction's finalize
        what = "direct convolution" if st.schedule.loop == "direct" else "implicit GEMM"
        out = [Work("weight pack", 0, 2 * FLOAT_BYTES * math.prod(c.weight_shape()))]
        pp = st.phase_pool
        if pp is not None:  # the input box of each tile (halo included), the pooled output once
            tiles = batch * pp.pooled[0] * pp.pooled[1]
            read = size * tiles * c.in_channels * math.prod(pp.box)
            written = size * batch * out_type.sample_numel
            mma_rate = target.tensor_flops if st.dtype == "float32" else target.half_tensor_flops  # 16-bit: bf16/f16 MMAs
            out.append(Work("phase_pool: transposed convolution + max pool + channel reduction", flops, read + written,
                            mma_rate * PHASE_POOL_TENSOR_FRACTION))
            return out
        pr = st.pool_ring
        if pr is not None:  # what it computes (16 channels, 64 columns, whole row blocks, the pooled planes);
            # each input plane read once per row block (its halo rows again), the partials written
            flops = (2 * batch * c.in_channels * POOL_RING_TAPS * POOL_RING_CHANNELS * (2 * pr.pooled[0])
                     * (POOL_RING_ROWS * pr.row_blocks) * POOL_RING_COLUMNS)
            read = size * batch * st.in_type.sample_numel * (POOL_RING_ROWS + 2) / POOL_RING_ROWS
            written = FLOAT_BYTES * batch * pr.splits * (c.out_channels if pr.per_channel else 1)  # (float partials)
            out.append(Work("pool_ring: convolution + max pool + reduction", flops, read + written,
                            target.tensor_flops * POOL_RING_TENSOR_FRACTION, launches=2 if pr.splits > 1 else 1))
            return out
        if st.fused_norm is not None and st.fused_norm.one_pass:  # one pass; the tiles' moments meet in L2
            fn = st.fused_norm
            moments = FLOAT_BYTES * 3 * batch * c.out_channels * fn.tiles
            out.append(Work(f"{what} + statistics + apply", flops, nbytes + 2 * moments, rate))
            samples_per_round = max(1, ONEPASS_CTAS_PER_SM * target.sm_count // fn.tiles)
            rounds = -(-batch // samples_per_round)
            terms = -(-(c.out_channels // fn.groups) * fn.tiles // ONEPASS_MERGE_LANES)
            out.append(Work(f"moment merges: {rounds} rounds x {terms} terms per lane", 0, 0,
                            latency_s=rounds * 2 * terms * ONEPASS_MERGE_TERM_S, launches=0))
        elif st.fused_norm is not None:  # statistics pass, merge, apply pass (the convolution again)
            moments = FLOAT_BYTES * 3 * batch * c.out_channels * st.fused_norm.tiles
            read = FLOAT_BYTES * batch * st.in_type.sample_numel
            out += [Work(f"{what} + statistics", flops, read + moments, rate),
                    Work("merge statistics", 0, moments),
                    Work(f"{what} + apply", flops, nbytes, rate)]
        elif phases or st.schedule.loop == "window":  # the MMAs, then the memory traffic (fitted; see the rates)
            out += [Work(what, flops, 0, target.tensor_flops * (PHASES_TENSOR_FRACTION if phases else WINDOW_TENSOR_FRACTION),
                         launches=launches),
                    Work("its loads and stores" + (" (sub-pixel phases)" if phases else ""), 0,
                         nbytes * (PHASES_BYTES_FACTOR if phases else 1.0), launches=0)]
        else:
            out.append(Work(what, flops, nbytes, rate, launches=launches))
        if st.output_dropped:
            out.append(Work("its tiles reduced to moments (not stored)", 0,
                            FLOAT_BYTES * batch * st.out_type.sample_numel * DROPPED_OUTPUT_BYTES_FACTOR, launches=0))
        if st.dtype != "float32":  # (every term of the time, the weight pack's aside)
            out = out[:1] + [replace(w, bytes=w.bytes * HALF_TIME_FACTOR, flop_rate=(w.flop_rate or target.fp32_flops) / HALF_TIME_FACTOR,
                                     latency_s=w.latency_s * HALF_TIME_FACTOR) for w in out[1:]]
        return out  # the folded and packed weights are kept between calls (kgen::WeightCache)

    def explain_lines(self, st: ConvGemmStage) -> list[str]:
        pp = st.phase_pool
        if pp is not None:
            loads = [sum(pp.taps[i] for i in g) for g in pp.phases]
            mma = "tf32: " + st.x3_reason if st.dtype == "float32" else f"{st.dtype}: the input's values as stored, exact products"
            return [f"phase_pool (wgmma, {mma}): all {len(pp.taps)} sub-pixel phases in one kernel, "
                    f"M = 64 output channels, N = {pp.tq[1]} x {pp.box[2]} box positions per d-plane; a tile is "
                    f"{pp.tq[0]} x {pp.tq[1]} x {pp.tq[2] * pp.pooled[2]} positions of every phase (one pooled row), "
                    f"its input box {'x'.join(map(str, pp.box))} x {st.conv.conv.in_channels} channels loaded once; "
                    f"two warpgroups ({loads[0]} and {loads[1]} taps) stream the weights tap by tap, "
                    f"{pp.smem_bytes // 1024} KB shared memory",
                    f"stage {st.epilogue.index} (pool_reduce) is its epilogue: max pools of the accumulators, "
                    "the channel reduction in channel order; the convolution output is never written"
                    if st.epilogue is not None else "(its epilogue stage is missing)", self._operands_line(st, "its epilogue's output")]
        pr = st.pool_ring
        if pr is not None:
            return [f"pool_ring (mma.sync, tf32: {st.x3_reason}): M = the output channels (the weights), N = 8 output "
                    f"positions, K = 8 input channels of a tap; a step is 2 planes x {POOL_RING_ROWS} rows x all columns "
                    f"of a sample ({pr.splits} per sample), its input box a ring of {POOL_RING_SLOTS} depth slots (a step "
                    f"loads its 2 new depths); CTAs of {POOL_RING_THREADS} threads, {pr.smem_bytes // 1024} KB shared memory "
                    f"each ({'2' if 2 * pr.smem_bytes <= SMEM_LIMIT else '1'} per SM)",
                    f"stage {st.epilogue.index} (pool_reduce) is its epilogue: 2 x 2 x 2 max pools of each thread's own "
                    f"accumulators, a partial per step{' and channel' if pr.per_channel else ''}; the convolution output is never written"
                    if st.epilogue is not None else "(its epilogue stage is missing)", self._operands_line(st, "its epilogue's output")]
        sc = st.schedule
        teams = f" x {sc.teams} teams sharing the weights" if sc.teams > 1 else ""
        out = [f"{sc.loop} main loop, {sc.mma}: {st.x3_reason}; tile {'x'.join(map(str, sc.tile))} x {sc.block_n} channels, "
               f"{32 * sc.warps_m * sc.warps_n} threads{teams}, {sc.smem_bytes // 1024} KB shared memory"]
        fn = st.fused_norm
        if fn is not None:
            then = f"normalized in registers{', ' + fn.reduce + ' over the channels' if fn.reduce else ''}"
            how = (f"the convolution runs once, the {fn.tiles} tiles of a sample on co-resident CTAs (each waits for "
                   f"the others' statistics, merged in order; then {then})" if fn.one_pass else
                   f"the convolution runs twice (per-tile statistics, merged in order; then {then})")
            out.append(f"stage {st.epilogue.index} (norm) is its epilogue: {how}; its output is never written")
        elif st.fused is not None:
            where = ("its accumulators" if st.fused.registers else
                     "its accumulators, 2 x 2 x 2 max pools in registers and the partner warp's depth" if st.fused.register_pool
                     else "its output tile in shared memory")
            if st.fused.elementwise:
                where += (", each thread's positions channel by channel"
                          + (f", {st.fused.batch} channels computed before any is stored (its chain calls libm)"
                             if st.fused.batch > 1 else ""))
            out.append(f"stage {st.epilogue.index} ({st.epilogue.family.name}) is its epilogue, on {where}; its output is never written")
        elif st.output_dropped:
            out.append(f"on the GPU it writes only stage {st.moments_for.index}'s tile moments: nothing reads its output")
        if st.eager_products:
            out.append("x rounded ties to even and the weights folded from their TF32 values (ties to even), as eager's "
                       "cuDNN transposed convolution rounds them: eager's products, summed in another order")
        if sc.mma == "tf32":
            out.append(self._operands_line(st, "the accumulators"))
        return out

    def _operands_line(self, st: ConvGemmStage, stored: str) -> str:
        """How a TF32 plan's operands are made: rounded to TF32 (float32), or 16-bit values converted (exact),
        the accumulators rounded to the dtype where eager's output is, the bias added, and what is stored."""
        if st.dtype == "float32":
            return f"TF32 operands rounded {self.rounding_words(st)}"
        rounded = " (rounded to " + st.dtype + " before its epilogue, as eager's output)" if st.ops[0] in st.rounded else ""
        if st.conv.conv.bias and not st.conv.bias_deferred:
            rounded += " + its bias" + (" (rounded again)" if st.ops[0] in st.rounded else "")
        then = f"; the accumulators{rounded} stored as {st.dtype}" if stored == "the accumulators" else \
            f"; the accumulators{rounded} into its epilogue, {stored} stored as {st.dtype}"
        return (f"{st.dtype} input loaded as stored and converted to fp32 (exact TF32 operands), the weights packed from "
                f"a float32 copy{then}")

    @staticmethod
    def rounding_words(st: ConvGemmStage) -> str:
        return ("ties to even, as eager's cuDNN transposed convolution" if st.tf32_half_even
                else "ties away from zero, as eager's cuDNN forward convolution")

    def stage_json(self, st: ConvGemmStage) -> dict:
        schedule = asdict(st.schedule)
        if st.schedule.input_bytes == FLOAT_BYTES:
            del schedule["input_bytes"]  # (float32 plans: as they were)
        d = dict(lowering=st.conv.lowering.name, layout=st.layout, schedule=schedule, mma_reason=st.x3_reason,
                 problems=[asdict(p) for p in st.problems])
        if st.fused:
            d["fused_epilogue"] = asdict(st.fused)
        if st.fused_norm:
            d["fused_norm"] = asdict(st.fused_norm)
        if st.phase_pool:
            d["phase_pool"] = asdict(st.phase_pool)
        if st.pool_ring:
            d["pool_ring"] = asdict(st.pool_ring)
            if not st.pool_ring.per_channel:
                del d["pool_ring"]["per_channel"]  # (as plans without it were)
        if st.output_dropped:
            d["output_dropped"] = True
        if st.eager_products:
            d["eager_products"] = True
        return d


FAMILY = ConvGemm()
