"""The softmax family: softmax, log_softmax or logsumexp over one axis, with the elementwise ops around it.

A *slice* is the L values the op normalizes (softmax, log_softmax) or reduces
(logsumexp) together: the values along its axis (softmax's dim; logsumexp's
dims when they are consecutive, e.g. [2, 3]) at one position of the other dims.
With O positions of the dims before the axis and I of the dims after it, value
j of slice (o, i) lies at (o * L + j) * I + i of a sample. Two forms:

- columns (I > 1: softmax over the channels of an N,C,[D],H,W tensor): a
  thread per slice, looping over its L values I apart, neighbouring lanes at
  neighbouring positions i, so every load of a warp is coalesced; a slice of
  more than ``COLUMN_VALUES_PER_THREAD`` values is shared by 2 lanes 16 apart
  (up to 64 channels) or 4 lanes 8 apart (value j: lane j % lanes'), so that a
  warp's load still covers whole 32-byte sectors (8 positions) and a thread
  holds at most 32 values up to 128 channels.
- rows (I = 1: the features of an [N, F] GEMM output): a group of threads
  per slice, as in the layer_norm family: part of a warp or a warp for rows of
  up to ``WARP_SLICE_VALUES``, a block (``BLOCK_VALUES_PER_THREAD`` values per
  thread, up to ``MAX_BLOCK_THREADS`` threads) for longer rows; value j is
  thread j % threads' (coalesced).

- tiles (a dense channels_last input, the slice its channels: softmax or
  log_softmax over the channels of a channels_last convolution output): a
  block reads ``tile_positions`` consecutive positions' channels (contiguous
  there) into shared memory, ``slice_threads`` threads per slice gather over
  their part of its channels (neighbouring threads at neighbouring positions),
  and every thread writes NC[D]HW rows (one channel, consecutive positions),
  the op and the ops after it computed as it stores. Read in place, a warp's
  32 slices lie a channel count apart.

Each thread gathers (max, sum of exp(v - max)) over its values, the max first
where it holds them in registers (``cached``: at most ``MAX_CACHED_PER_THREAD``
values a thread, ``MAX_CACHED_PER_BLOCK`` a block), else pushed one by one
while loading (``kgen::expsum_push``); a row's threads merge their pairs in a
fixed butterfly (warp shuffles, then shared memory across a block's warps):
m = max(m1, m2), s = s1 * exp(m1 - m) + s2 * exp(m2 - m) (templates/kgen_math.h,
``ExpSum``). Then logsumexp = m + log(s) (one store per slice), softmax =
exp(v - m) / s, log_softmax = (v - m) - log(s), each followed by the ops after
the op, one store per value. Where the values are not held, softmax and
log_softmax read the slice a second time (the prologue recomputed). NaN and
infinities are PyTorch's: a NaN in a slice makes its logsumexp and every
softmax output NaN; a +inf makes logsumexp +inf and the softmax NaN; a slice of
-inf gives -inf and NaN. Everything is fp32 on the GPU; the C++ build takes
the max and then sums exp(v - max) in double (templates/softmax/kernel_cpu.cpp.j2).

The input: a plain contiguous tensor is read by flat index; any other buffer
(sub-pixel phase tiles, a cropped or channels_last convolution output) through
the shared ``load`` helper, in place. ``reads_channels_last`` is False: in
channels_last a column's values are adjacent and neighbouring threads' a
channel count apart.

Declines nothing its ops fit; a logsumexp over dims that are not consecutive
(e.g. [1, 3]) does not fit and stays an ATen stage. Alone, the op is also the
aten family's candidate (the plan chooses). Templates: ``templates/softmax/``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..buffer import Buffer, flat_buffer
from ..ir import Elementwise, Op, Reduce, Softmax
from ..spec import DTYPES
from ..stage import Stage
from ..target import Target
from .base import (EAGER_SOFTMAXES, FLOAT_BYTES, TILE_SMEM_BYTES, Family, StageRequest, Work, before_eager_batch_norm,
                   fused_stage_json, group_words, index_type, input_words, pow2_ceil, split_around, vector_widths)

CUDA_THREADS = 256  # threads per block where part of a warp or a warp takes a row
WARP = 32
COLUMN_THREADS = 128  # threads per block in the columns form
COLUMN_VALUES_PER_THREAD = 32  # columns: enough threads per slice for this many values each ...
MAX_COLUMN_SLICE_THREADS = 4  # ... up to 4 (a warp's loads then cover 8 neighbouring positions: whole 32-byte sectors)
WARP_SLICE_VALUES = 256  # rows up to this long: a warp (or part of one) per row; longer rows: a block per row
BLOCK_VALUES_PER_THREAD = 16  # a block per row: enough threads for this many values each ...
MAX_BLOCK_THREADS = 1024  # ... up to CUDA's block limit
MAX_CACHED_PER_THREAD = 64  # values a thread holds in registers at most; more: read twice (softmax)
MAX_CACHED_PER_BLOCK = 16384  # values a block holds in registers at most (64 KB, a quarter of an SM's registers)
# A softmax over the channels of a channels_last input is read at full speed up to this many channels (a warp's
# 32 slices then span 16 KB in fp32, in L1 across its loads; measured at 64: #49 on the H200)
CHANNELS_LAST_SLICE_CHANNELS = 128
STREAM_UNROLL = 8  # values a thread loads before it uses any, where it does not hold its slice
TILE_THREADS = 256  # threads per block of the tiles form
MAX_TILE_SLICE = 256  # the tiles form takes slices of at most this many channels (a block's in TILE_SMEM_BYTES)
TILE_LANES_PER_POSITION = 8  # a warp's load covers 8 vectors (128 bytes in fp32) of each of 4 positions
CPU_TASK_VALUES = 4096  # values of work per ATen task on the CPU


@dataclass(frozen=True)
class Schedule:
    # "columns": a thread per slice, neighbours at neighbouring positions; "rows": threads share a slice; "tiles":
    # a channels_last input's positions through shared memory
    form: str
    cuda_threads: int  # threads per block
    # threads sharing one slice: rows: a power of two up to a warp (neighbouring lanes), or the whole block;
    # columns: 1 to MAX_COLUMN_SLICE_THREADS lanes of a warp, 32 / slice_threads lanes apart; tiles: threads
    # tile_positions apart, each gathering over a part of the slice
    slice_threads: int
    cached: bool  # each thread holds its values of a slice in registers (else a second pass reads them again)
    unroll: int  # values loaded before they are used where they are not held
    cpu_grain: int  # slices per ATen task on the CPU
    index_type: str  # of per-sample indices: int when they fit in 32 bits
    tile_positions: int = 0  # tiles: positions (slices) a block takes
    vector: int = 1  # tiles: values per load (the launch checks the input's alignment)
    lanes_per_position: int = 1  # tiles: neighbouring lanes loading one position's vectors together


@dataclass
class SoftmaxStage(Stage):
    prologue: list[Elementwise] = field(default_factory=list)  # before the op, on each loaded value
    op: Op = None  # the Softmax (softmax, log_softmax) or the logsumexp Reduce
    post: list[Elementwise] = field(default_factory=list)  # after it, on each output value
    schedule: Schedule = None

    @property
    def fn(self) -> str:
        """softmax | log_softmax | logsumexp"""
        return self.op.fn

    @property
    def axis(self) -> tuple[int, ...]:
        """The dims of a slice (indices into the input's shape; consecutive)."""
        return slice_axis(self.op)

    @property
    def length(self) -> int:
        """L: values per slice."""
        return math.prod(self.in_type.shape[d] for d in self.axis)

    @property
    def inner(self) -> int:
        """I: positions of the dims after the axis (the stride of a slice's values)."""
        return math.prod(self.in_type.shape[self.axis[-1] + 1:])

    @property
    def slices(self) -> int:
        """Slices per sample."""
        return self.in_type.sample_numel // self.length


def slice_axis(op: Op) -> tuple[int, ...]:
    return tuple(op.dims)  # a softmax's (its dim, or the span of dims it takes as one) or a logsumexp's


def is_slice_op(op: Op) -> bool:
    """softmax, log_softmax, or a logsumexp over consecutive dims (one axis of their product)."""
    if isinstance(op, Softmax):
        return True
    return (isinstance(op, Reduce) and op.fn == "logsumexp" and not op.origin
            and op.dims == tuple(range(op.dims[0], op.dims[0] + len(op.dims))))


def tile_positions(st: SoftmaxStage) -> int:
    """The tiles form's positions per block (a power of two, at least a warp's), 0 where it does not apply: a
    softmax or log_softmax over the channels of a dense channels_last input (not sub-pixel phases), at most
    MAX_TILE_SLICE channels, a tile in TILE_SMEM_BYTES."""
    buf = st.input
    if (st.fn == "logsumexp" or st.axis != (1,) or st.inner == 1 or buf.layout != "channels_last" or not buf.dense
            or buf.phased or st.length > MAX_TILE_SLICE):
        return 0
    row_bytes = (st.length + 1) * FLOAT_BYTES  # a position's channels and a column of padding
    positions = TILE_THREADS
    while positions > WARP and positions * row_bytes > TILE_SMEM_BYTES:
        positions //= 2
    return positions if positions * row_bytes <= TILE_SMEM_BYTES else 0


def per_thread(st: SoftmaxStage) -> int:
    """Values of a slice each thread handles."""
    return -(-st.length // st.schedule.slice_threads)


class SoftmaxFamily(Family):
    name = "softmax"
    dtypes = DTYPES  # 16-bit: loads converted to float, float arithmetic and statistics, stores rounded
    stage_kind = "softmax"
    generates_kernel = True
    reads_channels_last = False  # a column's values are adjacent in channels_last, neighbouring threads' C apart
    # (but see reads_channels_last_fast: a slice over the channels)
    pieces = ("stage.h", "kernel.cu", "kernel_cpu.cpp", "binding.cpp")
    summary = "softmax / log_softmax / logsumexp over one axis, with the elementwise ops around it, one pass"

    def fits(self, ops):
        """elementwise* (softmax | log_softmax | logsumexp over consecutive dims) elementwise*."""
        core = [op for op in ops if not isinstance(op, Elementwise)]
        return len(core) == 1 and is_slice_op(core[0])

    def unsupported(self, req: StageRequest) -> str | None:
        core = next(op for op in req.ops if not isinstance(op, Elementwise))
        # (alone in its stage: plan.eager_call_cuts)
        if core.op_name in EAGER_SOFTMAXES and before_eager_batch_norm(req.pipeline, req.start):
            return ("a training-mode batch norm after it runs as eager's call, and ATen's softmax gives eager's bits "
                    "(its sums in eager's order: Pipeline.eager_batch_norms)")
        return None

    def reads_channels_last_fast(self, buf: Buffer, ops=()) -> bool:
        """A softmax over the channels of a channels_last input: a lane's slice is one position's channels, adjacent
        in memory, and its sectors stay in L1 across the lane's loads (#49, 64 channels: its plan measured at the
        floor of its bytes on the H200); other slices lie a channel count apart."""
        core = next((op for op in ops if not isinstance(op, Elementwise)), None)
        return (core is not None and is_slice_op(core) and slice_axis(core) == (1,) and not buf.phased
                and buf.logical[0] <= CHANNELS_LAST_SLICE_CHANNELS)

    def make_stage(self, req: StageRequest) -> SoftmaxStage:
        types = req.types
        st = SoftmaxStage(req.index, list(req.ops), types[0], types[-1], input=req.input, output=flat_buffer(types[-1]))
        st.prologue, st.op, st.post = split_around(req.ops, lambda op: not isinstance(op, Elementwise))
        length = st.length
        tiles = tile_positions(st)
        if tiles:
            vector = next(v for v in vector_widths(req.dtype) if length % v == 0)
            vectors = length // vector
            lanes = max(d for d in range(1, TILE_LANES_PER_POSITION + 1) if vectors % d == 0)
            st.schedule = Schedule(form="tiles", cuda_threads=TILE_THREADS, slice_threads=TILE_THREADS // tiles,
                                   cached=True, unroll=STREAM_UNROLL, cpu_grain=max(1, CPU_TASK_VALUES // length),
                                   index_type=index_type(st), tile_positions=tiles, vector=vector,
                                   lanes_per_position=lanes)
            return st
        if st.inner > 1:
            wanted = pow2_ceil(-(-length // COLUMN_VALUES_PER_THREAD))
            form, threads, slice_threads = "columns", COLUMN_THREADS, min(MAX_COLUMN_SLICE_THREADS, wanted)
        elif length <= WARP_SLICE_VALUES:
            form, threads, slice_threads = "rows", CUDA_THREADS, min(WARP, pow2_ceil(length))
        else:
            wanted = pow2_ceil(-(-length // BLOCK_VALUES_PER_THREAD))
            form, threads = "rows", min(MAX_BLOCK_THREADS, max(CUDA_THREADS, wanted))
            slice_threads = threads
        values = -(-length // slice_threads)
        cached = values <= MAX_CACHED_PER_THREAD and values * threads <= MAX_CACHED_PER_BLOCK
        st.schedule = Schedule(
            form=form,
            cuda_threads=threads,
            slice_threads=slice_threads,
            cached=cached,
            unroll=STREAM_UNROLL,
            cpu_grain=max(1, CPU_TASK_VALUES // length),
            index_type=index_type(st),
        )
        return st

    def work(self, st: SoftmaxStage, batch: int, target: Target) -> list[Work]:
        """One kernel: the input read once (twice where a softmax's slices are not held in
        registers: the second read finds them in L2 only if the device's resident slices fit
        there, which the model does not assume), the output written once."""
        (one_pass,) = super().work(st, batch, target)
        if st.schedule.cached or st.fn == "logsumexp":
            return [one_pass]
        return [replace(one_pass, bytes=one_pass.bytes + self.read_bytes(st, batch))]

    def explain_lines(self, st: SoftmaxStage) -> list[str]:
        sc = st.schedule
        n = per_thread(st)
        if sc.form == "tiles":
            result = "exp(v - m) / s" if st.fn == "softmax" else "(v - m) - log(s)"
            return [f"{st.slices} slice(s) of {st.length} channels per sample from a channels_last buffer: a block reads "
                    f"{sc.tile_positions} positions' channels (contiguous there) into shared memory, {sc.slice_threads} "
                    f"thread(s) per slice gather (max m, sum s of exp(v - m)) over its parts (fp32), merged in order",
                    f"every thread stores NC[D]HW rows from the tile, consecutive threads at consecutive positions: "
                    f"{result} and the ops after it as it stores"]
        if sc.form == "columns":
            lanes = "a thread" if sc.slice_threads == 1 else f"{sc.slice_threads} lanes {WARP // sc.slice_threads} apart"
            who = (f"{lanes} per slice, its values {st.inner} apart in memory (neighbouring lanes at neighbouring "
                   "positions)")
        else:
            who = group_words(sc.slice_threads, sc.cuda_threads, "slice", WARP)
        source = input_words(st.input)
        held = (f"{n} value(s) per thread in registers" if sc.cached else
                f"{n} values per thread, pushed while loading" + ("" if st.fn == "logsumexp" else "; read again to apply"))
        result = {"logsumexp": "m + log(s), one store per slice", "softmax": "exp(v - m) / s, one store per value",
                  "log_softmax": "(v - m) - log(s), one store per value"}[st.fn]
        return [f"{st.slices} slice(s) of {st.length} values per sample, {who}: {held}, from {source}",
                f"(max m, sum s of exp(v - m)) per thread, merged in a fixed order (fp32); {result}"]

    def stage_json(self, st: SoftmaxStage) -> dict:
        return fused_stage_json(st)


FAMILY = SoftmaxFamily()
