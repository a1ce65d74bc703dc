"""The pool_reduce family: elementwise prologue -> a chain of window pools, each
followed by elementwise ops -> an optional reduction -> an elementwise epilogue,
in one pass over its input.

Each output (n, k) of the stage combines ``kReduced`` values of the last pool
level; on CUDA ``r_lanes`` threads share one output's reduction, and a long
reduction is split across blocks at run time (``kgen::cuda_splits``) when the
batch leaves the device idle. Templates: ``templates/pool_reduce/``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..buffer import dense_buffer, flat_buffer
from ..ir import Elementwise, Pool, Reduce, TensorType
from ..spec import DTYPES
from ..stage import Stage
from .base import DTYPE_BYTES, Candidate, Family, StageRequest, fused_stage_json, index_type, pow2_ceil, pow2_floor, target_blocks_per_sm

CUDA_THREADS = 256  # threads per block
MIN_PER_THREAD = 32  # values a thread combines before a reduction is split across blocks
WAVES = 2  # a split reduction aims for this many times the blocks the device holds at once
MAX_R_LANES_ACROSS = 32  # lanes of one output when threads walk the outputs: >= 8 adjacent outputs per block
# values per lane when lanes walk a reduction adjacent in memory: one value per lane left a short reduction (min
# over 128 channels_last channels) to a shared-memory tree of 7 synchronized steps per 2 outputs (#36, 2026-11-25);
# 4 per lane (a warp per output of 128) left #32's 4.1 M outputs issue-bound (ncu on the H200: SM throughput 85%,
# DRAM 15%: each thread's index math and lane tree for 4 values), so R_FAST_PER_LANE where the outputs fill the
# device, down to R_FAST_MIN_PER_LANE where more lanes are needed to fill it
R_FAST_PER_LANE = 16
R_FAST_MIN_PER_LANE = 4
LOADS_IN_FLIGHT = 16  # loads per thread before their values are combined (a window pool issues its own)
MAX_UNROLL = 8
# outputs of a stage that reduces nothing per thread, their loads all issued first (kernel.cu.j2 map_kernel):
# one output per thread ran #15's and #38's large elementwise stages at ~1.5-1.9 TB/s on an H200
MAP_LOADS_IN_FLIGHT = 4
# bytes of one load or store of consecutive outputs in map_kernel, where the input is a plain contiguous tensor
# read at the output's own index: scalar 4-byte accesses ran ResNet's batch norm + ReLU stages at ~2.1 TB/s on an
# H200, half of what torch.compile's 16-byte accesses reach on the same tensors
MAP_VECTOR_BYTES = 16
MAX_UNROLLED_WINDOW = 512  # window taps up to which the window loops are unrolled
CPU_TASK_VALUES = 4096  # values of work per ATen task on the CPU
TRANSPOSE_TILE = 1024  # values of a shared-memory tile when a channels_last input becomes an NC[D]HW output
MAX_TRANSPOSE_CHANNELS = 32  # channels of such a tile (its positions: TRANSPOSE_TILE / channels)
# The same tile where a thread loads 16 bytes of channels at once (a dense channels_last input, nothing pooled).
# Value by value, the generic tile ran KernelBench #1's bfloat16 ReLU + bias (128 x 128 x 126 x 126, 1 GB moved)
# at 0.94 ms, ~1.1 TB/s: index math per value, and 2-byte loads too few in flight (2026-12-02, H200)
# Of 32 channels x 128 positions: KernelBench #5's tanh over 64 x 513 x 513 planes (4.3 GB moved) ran 1.34 ms in
# tiles of 64 x 64 and 1.15 in 32 x 128 (2-way bank conflicts in the tile's column stores there; H200 lab, 2026-12-04)
VECTOR_TRANSPOSE_TILE = 4096
MAX_VECTOR_TRANSPOSE_CHANNELS = 32
MIN_TRANSPOSE_CHANNELS = 8  # below this a channels_last input is read as it is


@dataclass(frozen=True)
class Schedule:
    cuda_threads: int  # threads per block
    r_lanes: int  # threads that share one output's reduction
    r_fast: bool  # consecutive threads walk the reduction (else the outputs)
    unroll: int  # values a thread loads before it combines them
    min_per_thread: int  # values per thread before a reduction is split across blocks
    target_blocks_per_sm: int  # what a split reduction aims for (the split itself is chosen at run time)
    max_splits: int  # the grid's y limit
    cpu_grain: int  # outputs per ATen task
    cpu_chunk: int  # values per partial sum on the CPU (rounding does not grow with the reduction)
    index_type: str  # of per-sample indices: int when they fit in 32 bits
    # channels of a shared-memory tile that turns a channels_last input into the NC[D]HW output (no
    # reduction; pools and elementwise ops; 0: not used): threads walking the output in its memory order
    # read a channels_last input one value per memory sector, 5-9x below the bandwidth (docs/performance.md, 2026-11-25)
    transpose_channels: int = 0
    transpose_positions: int = 0  # positions of such a tile
    # channels per 16-byte load of that tile (0: value by value), and consecutive positions per store of the
    # NC[D]HW output (the largest power of two up to the same 16 bytes that divides the positions per channel)
    transpose_vector: int = 0
    transpose_store: int = 1
    # the vector tile's ops run where a thread holds one channel's consecutive positions (the store), not where it
    # holds one position's channels (the load): where they read a value from memory in the output's layout (an
    # added input), adjacent across threads there; else at the load, whose one unravel serves a vector's channels
    # (KernelBench #26, H200: 1.77 -> 0.85 ms at the store; #5, #36, #91, value by value stores, ran 7-18% slower so)
    transpose_ops_at_store: bool = False
    # kept dims (1 = channels) in the order consecutive threads walk the outputs, innermost last: the
    # output's row-major order, or the input's memory order where that differs and the threads walk the
    # outputs (a channels_last input reduced over a spatial dim: walking the NC[D]HW output read one value
    # per memory sector, ~8 ms of #13's 16; the scattered writes are the smaller side: docs/performance.md, 2026-11-25)
    kept_walk: tuple = ()
    map_outputs: int = 1  # outputs per thread where nothing is reduced (map_kernel)
    # consecutive outputs a map_kernel thread loads and stores as one vector (1: one at a time); the kernel
    # falls back to one at a time where a pointer is not aligned to the vector at run time
    map_vector: int = 1
    # the vector's input values are one value repeated (an expand along the last dim: Buffer.repeats_vectors), one
    # load each
    map_repeated: bool = False
    # the vector map kernel hands each warp's vectors through shared memory so that lane l computes values l,
    # l + 32, ...: consecutive lanes read consecutive channels' parameters (where a channel holds fewer values
    # than a vector, a warp's loads of a parameter from the vectors' order span 8 cache lines: #41's normalize
    # stage ran at 1.0 TB/s, L1 97% busy)
    map_lane_order: bool = False


@dataclass
class Level:
    """A pool (None for level 0, the load) followed by elementwise ops."""

    pool: Pool | None
    ew: list[Elementwise]
    in_type: TensorType  # type of the pool's input
    out_type: TensorType
    unroll_window: bool = False  # unroll the window loops
    clipped: tuple[bool, ...] = ()  # per spatial dim: a window can leave the input (bounds check)


@dataclass
class PoolReduceStage(Stage):
    levels: list[Level] = field(default_factory=list)
    reduce: Reduce | None = None
    epilogue: list[Elementwise] = field(default_factory=list)
    reduce_order: tuple = ()  # reduced dims, outermost first (input memory order)
    kept_dims: tuple = ()  # non-reduced dims of the last level, row-major
    flat_reduction: bool = False  # no pools, every dim reduced, one dense tile: value r of a sample lies at r
    flat_map: bool = False  # no pools, nothing reduced, a plain contiguous input: output k's value lies at k
    schedule: Schedule = None

    @property
    def pooled_type(self) -> TensorType:
        return self.levels[-1].out_type

    @property
    def reduced_count(self) -> int:
        return math.prod(self.pooled_type.shape[d] for d in self.reduce_order) if self.reduce else 1

    @property
    def kept_count(self) -> int:
        return math.prod(self.pooled_type.shape[d] for d in self.kept_dims)

    @property
    def window_loads(self) -> int:
        """Input values one element of the reduction reads."""
        return math.prod(math.prod(lv.pool.kernel) for lv in self.levels if lv.pool)


def _clipped(pool: Pool, L: int, O: int, d: int) -> bool:
    """Whether a window of ``pool`` can leave the input along spatial dim ``d``."""
    last = (O - 1) * pool.stride[d] - pool.padding[d] + (pool.kernel[d] - 1) * pool.dilation[d]
    return pool.padding[d] > 0 or last >= L


class PoolReduce(Family):
    name = "pool_reduce"
    dtypes = DTYPES  # 16-bit: loads converted to float, float arithmetic and statistics, stores rounded
    stage_kind = "pool_reduce"
    generates_kernel = True
    reads_channels_last = True  # measured on the H100: docs/performance.md
    reads_views = True  # its loads address any tile strides (common.j2 load_fn) ...
    reads_view_operands = True  # ... and so do its value operands' (cexpr.view_index)
    pieces = ("stage.h", "kernel.cu", "kernel_cpu.cpp", "binding.cpp")
    summary = "elementwise -> window pools -> reduction -> elementwise, one pass"

    def fits(self, ops):
        """(elementwise | pool)* [reduction elementwise*]."""
        reduced = False
        for op in ops:
            if isinstance(op, Elementwise) or (isinstance(op, Pool) and not reduced):
                continue
            if isinstance(op, Reduce) and not reduced:
                reduced = True
                continue
            return False
        return True

    def candidates(self, req: StageRequest) -> list[Candidate]:
        """The stage writing a plain NC[D]HW tensor; and, where it maps a channels_last input value by value
        (elementwise ops only) for a next stage, one writing channels_last in the input's own order: no
        transposition, and a next convolution that takes channels_last (cuDNN's tensor-core layout) reads it
        without the copy it would make of an NC[D]HW tensor. The plan chooses (the cost model prices the
        next stage's copy, and the copy of a value another stage reads as a plain tensor)."""
        flat = self.make_stage(req)
        out = [Candidate(self.name, flat)]
        if (req.next_family is not None and req.input.layout == "channels_last" and req.input.dense
                and len(flat.levels) == 1 and flat.reduce is None and not flat.epilogue and flat.in_type.rank >= 4):
            # (ATen's channels_last formats are of 4 and 5 dims: a [N, C, L] view read as channels_last is not one)
            out.append(Candidate(f"{self.name}:channels_last", self.make_stage(req, output_layout="channels_last")))
        return out

    def make_stage(self, req: StageRequest, output_layout: str = "contiguous") -> PoolReduceStage:
        types = req.types
        levels = [Level(None, [], types[0], types[0])]
        reduce, epilogue = None, []
        for op, t_in, t_out in zip(req.ops, types, types[1:]):
            if isinstance(op, Pool):
                levels.append(Level(op, [], t_in, t_out))
            elif isinstance(op, Reduce):
                reduce = op
            elif reduce is not None:
                epilogue.append(op)
            else:
                levels[-1].ew.append(op)
                levels[-1].out_type = t_out
        for lv in levels[1:]:
            p = lv.pool
            lv.unroll_window = math.prod(p.kernel) <= MAX_UNROLLED_WINDOW
            lv.clipped = tuple(_clipped(p, L, O, d) for d, (L, O) in enumerate(zip(lv.in_type.spatial, lv.out_type.spatial)))
        buf = req.input
        shape = tuple(types[-1].shape[1:])
        output = dense_buffer(shape, shape, "channels_last") if output_layout == "channels_last" else flat_buffer(types[-1])
        st = PoolReduceStage(req.index, list(req.ops), types[0], types[-1], input=buf, output=output,
                             levels=levels, reduce=reduce, epilogue=epilogue)
        pooled = st.pooled_type
        red = set(reduce.dims) if reduce else set()
        # reduced dims in the input's memory order, so consecutive r are adjacent in memory
        mem = [d + 1 for d in buf.tiles[0].memory_order]
        st.reduce_order = tuple(d for d in mem if d in red)
        st.kept_dims = tuple(d for d in range(1, pooled.rank) if d not in red)
        tile = buf.tiles[0]
        st.flat_reduction = (
            len(levels) == 1 and not st.kept_dims and not buf.phased and tile.dims == buf.logical
            and not any(tile.offset) and [d - 1 for d in st.reduce_order] == tile.memory_order
        )
        st.flat_map = len(levels) == 1 and reduce is None and buf.flat and output_layout != "channels_last"
        r_fast = (buf.innermost + 1) in red
        tv = self._transpose_vector(st, DTYPE_BYTES[req.dtype])
        tc = self._transpose_channels(st, tv)
        map_vector = self._map_vector(st, tc, DTYPE_BYTES[req.dtype])
        st.schedule = Schedule(
            cuda_threads=CUDA_THREADS,
            r_lanes=self._r_lanes(st, r_fast, req),
            r_fast=r_fast,
            unroll=max(1, min(MAX_UNROLL, LOADS_IN_FLIGHT // st.window_loads)),
            min_per_thread=MIN_PER_THREAD,
            target_blocks_per_sm=target_blocks_per_sm(req.target, CUDA_THREADS, WAVES),
            max_splits=req.target.max_grid_y,
            cpu_grain=max(1, CPU_TASK_VALUES // max(1, st.reduced_count * st.window_loads)),
            cpu_chunk=max(1, math.isqrt(st.reduced_count)),
            index_type=index_type(st),
            transpose_channels=tc,
            transpose_positions=(VECTOR_TRANSPOSE_TILE if tv else TRANSPOSE_TILE) // tc if tc else 0,
            transpose_vector=tv,
            transpose_store=self._transpose_store(st, tv),
            transpose_ops_at_store=bool(tv) and bool(st.operand_values()),
            kept_walk=tuple(d for d in mem if d in st.kept_dims) if not r_fast and not tc else st.kept_dims,
            map_outputs=max(1, MAP_LOADS_IN_FLIGHT // st.window_loads) if st.reduced_count == 1 else 1,
            map_vector=map_vector,
            map_repeated=map_vector > 1 and st.input.repeats_vectors(map_vector),
            map_lane_order=map_vector > 1 and any(op.tensor_names() for op in st.ops) and math.prod(st.in_type.spatial) < map_vector,
        )
        return st

    @staticmethod
    def _map_vector(st: PoolReduceStage, transpose_channels: int, value_bytes: int) -> int:
        """Outputs per vector access in map_kernel: where nothing is reduced or pooled, output k of a sample is
        the input's logical element k, and the output is row-major: consecutive outputs are consecutive values of
        the output and, in runs of whole vectors, of the input (a plain contiguous tensor, or a view whose last
        dims stay contiguous: a permute of outer dims, a slice of rows), or one value of the input repeated (an
        expand along the last dim); the samples stay aligned to the vector where it divides their size."""
        vector = MAP_VECTOR_BYTES // value_bytes
        if (st.reduced_count != 1 or st.reduce is not None or len(st.levels) != 1 or transpose_channels
                or st.output.layout == "channels_last" or st.kept_count % vector
                or not (st.input.element_vectors(vector) or st.input.repeats_vectors(vector))):
            return 1
        return vector

    @staticmethod
    def _transposes(st: PoolReduceStage) -> bool:
        """A channels_last input to an NC[D]HW output with nothing reduced: through shared-memory tiles."""
        return (st.input.layout == "channels_last" and st.output.layout != "channels_last" and st.reduce is None
                and st.pooled_type.shape[1] >= MIN_TRANSPOSE_CHANNELS)

    @classmethod
    def _transpose_channels(cls, st: PoolReduceStage, vector: int) -> int:
        if not cls._transposes(st):
            return 0
        return min(MAX_VECTOR_TRANSPOSE_CHANNELS if vector else MAX_TRANSPOSE_CHANNELS, pow2_floor(st.pooled_type.shape[1]))

    @classmethod
    def _transpose_vector(cls, st: PoolReduceStage, value_bytes: int) -> int:
        """Channels per 16-byte load of a transposing tile: where the input is read at the output's own
        positions (nothing pooled) and each of its tiles (one, or a sub-pixel convolution's phases) holds a
        position's channels as whole aligned vectors."""
        vector = MAP_VECTOR_BYTES // value_bytes
        channels = st.pooled_type.shape[1]
        if not cls._transposes(st) or len(st.levels) != 1 or channels % vector or not st.input.channel_vectors(vector):
            return 0
        return vector

    @staticmethod
    def _transpose_store(st: PoolReduceStage, vector: int) -> int:
        if not vector:
            return 1
        positions = math.prod(st.pooled_type.spatial)
        return math.gcd(vector, positions & -positions)

    def writes_channel_slice(self, st: PoolReduceStage) -> bool:
        """Its kernels (and a convolution's that runs it as its epilogue: conv_gemm's) store output k of sample n at
        n * kOutSample + k, where the output is a plain NC[D]HW tensor."""
        return st.output.flat and (st.absorbed_by is None or st.absorbed_by.family.name == "conv_gemm")

    def explain_lines(self, st: PoolReduceStage) -> list[str]:
        sc = st.schedule
        if st.output.layout == "channels_last":
            return ["channels_last input to a channels_last output, value by value in memory order (the next stage "
                    "reads channels_last)"]
        if sc.transpose_channels:
            how = (f": {sc.transpose_vector} channels per {MAP_VECTOR_BYTES}-byte load, {sc.transpose_store} positions per "
                   "store (value by value where a pointer is not aligned at run time)") if sc.transpose_vector else \
                " (whole memory sectors read and written)"
            return [f"channels_last input to the NC[D]HW output through shared-memory tiles of {sc.transpose_channels} "
                    f"channels x {sc.transpose_positions} positions{how}"]
        if sc.map_vector > 1:
            lanes = ("; each warp's vectors exchanged through shared memory, lane l computing values l, l + 32, ... "
                     "(a per-channel parameter's loads coalesced)") if sc.map_lane_order else ""
            if sc.map_repeated:
                return [f"elementwise over a view that repeats each value along its last dim: one load per {sc.map_vector} "
                        f"outputs, {MAP_VECTOR_BYTES}-byte stores (one at a time where a pointer is not aligned at run time)"]
            what = "a plain contiguous input" if st.input.flat else "a view whose innermost values stay adjacent"
            return [f"elementwise over {what}: {sc.map_vector} consecutive values per {MAP_VECTOR_BYTES}-byte "
                    f"load and store (one at a time where a pointer is not aligned at run time){lanes}"]
        return []

    @staticmethod
    def _r_lanes(st: PoolReduceStage, r_fast: bool, req: StageRequest) -> int:
        """Threads per output: enough lanes that the example batch fills the device; where the lanes walk a
        reduction adjacent in memory, R_FAST_PER_LANE values per lane where the outputs alone fill it (more per
        lane spread each thread's index math and lane tree over more values), at most a block."""
        if st.reduced_count == 1:
            return 1
        outputs = req.batch * st.kept_count
        want = pow2_ceil(max(1, req.target.resident_threads // max(outputs, 1)))
        if r_fast:
            lanes = max(st.reduced_count // R_FAST_PER_LANE, min(want, st.reduced_count // R_FAST_MIN_PER_LANE))
            return min(CUDA_THREADS, pow2_floor(max(1, lanes)))
        return max(1, min(want, MAX_R_LANES_ACROSS, pow2_floor(st.reduced_count)))

    def stage_json(self, st: PoolReduceStage) -> dict:
        return fused_stage_json(st)


FAMILY = PoolReduce()
