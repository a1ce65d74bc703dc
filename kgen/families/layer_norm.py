"""The layer_norm family: a norm whose rows fit in registers, with the elementwise ops around it, in one pass.

A LayerNorm over ``normalized_shape`` normalizes each *row* of R =
prod(normalized_shape) values: the last dims of a sample, contiguous in an
NC[D]HW tensor. A GroupNorm (or InstanceNorm) normalizes groups of channels,
also contiguous in NC[D]HW order: its rows are the (sample, group) pairs, R =
channels per group x spatial size, and its affine part is per channel (so
per row and value, where a LayerNorm's is per value). A GEMM's [N, C] output
in groups of 64 channels is such a norm: the norm family's statistics and
apply kernels read it twice with a warp per group; here a thread group holds
the group once. A row of at most ``MAX_ROW_VALUES`` values is held in
registers by one group of threads: a warp or part of one for R <= 256
(``WARP_ROW_VALUES``), a block for longer rows. Each thread loads its share of
the row (vector loads where the input is a plain contiguous tensor and the
row divides into whole vectors per thread; the kernel checks the pointers'
alignment at launch), applies the prologue ops, and the group sums the row in
a fixed butterfly (warp shuffles, then shared memory across a block's warps):
first the mean, then, from the same registers, the sums of the centered values
and of their squares. The corrected two-pass form (mean + sum(x - mean) / R,
var = sum((x - mean)^2) / R - (sum(x - mean) / R)^2) removes the rounding of
the first mean, so a row far from zero (1e4 + N(0, 1)) keeps fp32 accuracy.
Then y = (x - mean) / sqrt(var + eps) * weight + bias and the ops after the
norm, and one store per value. A NaN or an infinity in a row makes the whole
row NaN, as PyTorch's layer_norm does (the mean, and with it every centered
value, is NaN or infinite). Everything is fp32 on the GPU; the C++ build sums
a row in double (templates/layer_norm/kernel_cpu.cpp.j2).

The input: a plain contiguous tensor is read row by row (``load_flat``); any
other buffer (sub-pixel phase tiles, a cropped or channels_last convolution
output) through the shared ``load`` helper (templates/common.j2), in place,
like every generated family: the planner adds no copy before a generated
kernel. A channels_last input puts a row's values a channel count apart, so
``reads_channels_last_fast`` is False (the cost model charges that read 4x,
and an ATen convolution before the norm writes NC[D]HW).

Declines: a row of more than ``MAX_ROW_VALUES`` values (``unsupported``). As
the planner groups ops greedily before any family is asked to make a stage,
``fits`` then takes the layer_norm alone, so the op stays an ATen stage of its
own and the ops around it go to the other fused families; a group norm's
groups that long go to the norm family (which also takes the ops around it).
Templates: ``templates/layer_norm/``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..buffer import flat_buffer
from ..ir import Elementwise, LayerNorm, Norm
from ..spec import DTYPES
from ..stage import Stage
from .base import (FLOAT_BYTES, STATIC_SMEM_BYTES, TILE_SMEM_BYTES, Family, StageRequest, fused_stage_json, group_words,
                   index_type, input_words, pow2_ceil, split_around, vector_widths)

CUDA_THREADS = 256  # threads per block
WARP = 32
WARP_ROW_VALUES = 256  # rows up to this long: a warp (or part of one) per row; longer rows: a block per row
MAX_ROW_VALUES = 1024  # longest row held in registers (at most 4 values per thread of a block); longer: declined
BYTES_IN_FLIGHT = 32  # bytes a thread loads before it uses any (several rows when rows are short)
CPU_TASK_VALUES = 4096  # values of work per ATen task on the CPU
# The tiles form: a channels_last input whose rows run along its last spatial dim (a layer norm over W after a
# channels_last convolution): the W x C values at one outer position are contiguous there, so a block reads them
# whole into shared memory (as float, a column of padding), a thread normalizes each channel's row, and the block
# writes the NC[D]HW rows from the tile. Read in place, a row's values lie a channel count apart (a memory sector
# per value).
MAX_TILE_ROW = 64  # longest row a thread holds in registers (the tiles form)
TILE_PART_VALUES = 16  # fewest values of a row one thread sums (the tiles form): fewer leave it barrier-bound


@dataclass(frozen=True)
class Schedule:
    cuda_threads: int  # threads per block
    row_threads: int  # threads that share one row: a power of two up to a warp, or the whole block
    vector: int  # values per load and store (1 where the input is not a plain tensor or rows do not divide)
    rows_in_flight: int  # rows a thread group holds at once (their loads issued together)
    cpu_grain: int  # rows per ATen task on the CPU
    index_type: str  # of per-sample indices: int when they fit in 32 bits
    form: str = "rows"  # "rows": thread groups over rows read in place; "tiles": channels_last tiles (MAX_TILE_ROW)
    tiles_per_block: int = 0  # the tiles form: (sample, outer position) tiles a block holds at once
    row_parts: int = 1  # the tiles form: threads that sum one row's parts for its statistics


@dataclass
class LayerNormStage(Stage):
    prologue: list[Elementwise] = field(default_factory=list)  # before the norm, on each loaded value
    norm: LayerNorm | Norm = None  # a Norm: group_norm / instance_norm, a row per (sample, group)
    post: list[Elementwise] = field(default_factory=list)  # after the norm (and its affine part)
    schedule: Schedule = None
    value_bytes: int = 4  # bytes per value of its input and output (2: a 16-bit plan's)

    @property
    def row_size(self) -> int:
        """R: values normalized together (the normalized dims; a group's channels x the spatial size)."""
        return row_size(self.norm, self.in_type)

    @property
    def grouped(self) -> bool:
        """A group norm's rows: (sample, group), the affine part per channel."""
        return isinstance(self.norm, Norm)

    @property
    def row_dims(self) -> int:
        """How many of the sample's dims (C, *S) a layer norm's row spans (the last ones)."""
        return len(self.norm.normalized_shape)

    @property
    def weight_name(self) -> str | None:
        return self.norm.tensor_names()[0] if self.norm.tensor_names() else None

    @property
    def bias_name(self) -> str | None:
        return self.norm.tensor_names()[1] if len(self.norm.tensor_names()) > 1 else None

    @property
    def rows(self) -> int:
        """Rows per sample."""
        return self.in_type.sample_numel // self.row_size


def row_size(op: LayerNorm | Norm, t) -> int:
    """Values per row: a layer norm's normalized dims; a group norm's group of channels over ``t``'s spatial dims."""
    if isinstance(op, Norm):
        return op.num_channels // op.num_groups * math.prod(t.spatial)
    return math.prod(op.normalized_shape)


def row_schedule(r: int, widths: tuple[int, ...], flat: bool) -> tuple[int, int]:
    """(threads per row, values per load) for rows of ``r`` values: whole vectors per thread, from a plain
    tensor (row starts are then multiples of the vector), the widest first. A row of at most
    WARP_ROW_VALUES takes as few lanes as hold it in those vectors (a GEMM row's group of 64 16-bit values:
    8 lanes of one 16-byte vector, not 32 lanes of two values); a longer row a block."""
    if r > WARP_ROW_VALUES:
        return CUDA_THREADS, next(v for v in widths if v == 1 or (flat and r % (CUDA_THREADS * v) == 0))
    for v in widths:
        threads = min(WARP, pow2_ceil(-(-r // v)))
        if v == 1 or (flat and r % (threads * v) == 0):
            return threads, v
    raise AssertionError("widths end with 1")


def tiles_per_block(st: LayerNormStage) -> int:
    """The tiles form's tiles per block, 0 where it does not apply: a layer norm over the last dim of a dense
    channels_last input (not sub-pixel phases) with rows of at most MAX_TILE_ROW values and at most a block's
    threads of channels, a tile in TILE_SMEM_BYTES."""
    buf, t = st.input, st.in_type
    if st.grouped or st.row_dims != 1 or t.rank < 3 or buf.layout != "channels_last" or not buf.dense:
        return 0
    channels, r = t.shape[1], st.row_size
    tile_bytes = r * (channels + 1) * FLOAT_BYTES
    if r > MAX_TILE_ROW or channels > CUDA_THREADS or tile_bytes > TILE_SMEM_BYTES:
        return 0
    # with each tile's rows' statistics (3 floats a row), its bases and sample (3 x 8 bytes) and outer position
    # (4), and the parts' sums (3 floats per thread at most), within a block's static shared memory
    per_tile = tile_bytes + 3 * FLOAT_BYTES * channels + 3 * 8 + 4
    fits = (STATIC_SMEM_BYTES - 3 * FLOAT_BYTES * CUDA_THREADS) // per_tile
    return max(1, min(CUDA_THREADS // channels, TILE_SMEM_BYTES // tile_bytes, fits))


def tile_row_parts(st: LayerNormStage, tiles: int) -> int:
    """Threads per row summing it (the tiles form): the most, a power of two, that the block's threads hold
    for every row of its tiles, each part at least TILE_PART_VALUES values."""
    rows, parts = tiles * st.in_type.shape[1], 1
    while 2 * parts * rows <= CUDA_THREADS and st.row_size // (2 * parts) >= TILE_PART_VALUES:
        parts *= 2
    return parts


class LayerNormFamily(Family):
    name = "layer_norm"
    dtypes = DTYPES  # 16-bit: loads converted to float, float arithmetic and statistics, stores rounded
    stage_kind = "layer_norm"
    generates_kernel = True
    reads_channels_last = False  # a row's values lie a channel count apart in channels_last
    pieces = ("stage.h", "kernel.cu", "kernel_cpu.cpp", "binding.cpp")
    summary = "layer or group norm over rows held in registers, with the elementwise ops around it, one pass"

    def fits(self, ops):
        """elementwise* (layer_norm | group_norm | instance_norm) elementwise*; a layer_norm whose rows
        are too long for registers alone (``unsupported`` then declines it, and the ATen stage computes
        it). A group norm's row size depends on the spatial size, known to ``unsupported`` only."""
        norms = [op for op in ops if isinstance(op, (LayerNorm, Norm))]
        if len(norms) != 1 or not all(isinstance(op, (Elementwise, LayerNorm, Norm)) for op in ops):
            return False
        return isinstance(norms[0], Norm) or row_size(norms[0], None) <= MAX_ROW_VALUES or len(ops) == 1

    def unsupported(self, req: StageRequest) -> str | None:
        i = next(i for i, op in enumerate(req.ops) if isinstance(op, (LayerNorm, Norm)))
        r = row_size(req.ops[i], req.types[i])
        if r > MAX_ROW_VALUES:
            return f"rows of {r} values: more than the {MAX_ROW_VALUES} a block holds in registers"
        return None

    def read_bytes(self, stage: LayerNormStage, batch: int) -> float:
        """The tiles form reads a channels_last input in its own order: whole sectors."""
        if stage.schedule is not None and stage.schedule.form == "tiles":
            return stage.value_bytes * batch * sum(math.prod(t.dims) for t in stage.input.tiles)
        return super().read_bytes(stage, batch)

    def make_stage(self, req: StageRequest) -> LayerNormStage:
        types = req.types
        st = LayerNormStage(req.index, list(req.ops), types[0], types[-1], input=req.input, output=flat_buffer(types[-1]))
        st.prologue, st.norm, st.post = split_around(req.ops, lambda op: isinstance(op, (LayerNorm, Norm)))
        st.value_bytes = 4 if req.dtype == "float32" else 2
        r = st.row_size
        widths = vector_widths(req.dtype)
        tiles = tiles_per_block(st)
        if tiles:  # a thread per row; values per load of a tile (whole vectors of it; the launch checks alignment)
            form = dict(row_threads=1, vector=next(v for v in widths if (r * st.in_type.shape[1]) % v == 0), rows_in_flight=1,
                        form="tiles", tiles_per_block=tiles, row_parts=tile_row_parts(st, tiles))
        else:
            row_threads, vector = row_schedule(r, widths, st.input.flat)
            per_thread = -(-r // (row_threads * vector)) * vector  # values a thread holds of one row
            form = dict(row_threads=row_threads, vector=vector, rows_in_flight=max(1, BYTES_IN_FLIGHT // st.value_bytes // per_thread))
        st.schedule = Schedule(cuda_threads=CUDA_THREADS, cpu_grain=max(1, CPU_TASK_VALUES // r), index_type=index_type(st), **form)
        return st

    def explain_lines(self, st: LayerNormStage) -> list[str]:
        sc = st.schedule
        r = st.row_size
        if sc.form == "tiles":
            c = st.in_type.shape[1]
            return [f"{st.rows} rows of {r} values per sample along the last dim of a channels_last buffer: a block reads "
                    f"{sc.tiles_per_block} tile(s) of {r} positions x {c} channels (contiguous there) into shared memory, "
                    f"{sc.row_parts} thread(s) per channel's row sum it (fp32: the mean, then the centered variance), and "
                    f"every thread normalizes and stores the NC[D]HW rows from the tile, consecutive threads at consecutive "
                    f"positions"]
        per_thread = -(-r // (sc.row_threads * sc.vector)) * sc.vector
        who = group_words(sc.row_threads, sc.cuda_threads, "row", WARP)
        loads = ({4: "float4", 2: "float2", 1: "scalar"}[sc.vector] if st.value_bytes == 4 else
                 {8: "16-byte", 4: "8-byte", 2: "4-byte", 1: "scalar"}[sc.vector]) + " loads"
        source = input_words(st.input)
        if not st.input.phased and not st.input.flat and st.input.layout == "channels_last":
            source += " (a row's values a channel count apart)"
        affine = ("weight and bias" if st.bias_name else "weight") if st.weight_name else "no affine part"
        if st.grouped:
            affine += " per channel"
        return [f"{st.rows} rows of {r} values per sample{' (its groups)' if st.grouped else ''}, {who}: {per_thread} values per thread in registers, "
                f"{sc.rows_in_flight} row(s) in flight, {loads} from {source}",
                f"mean, then the centered variance from the same registers (fp32, fixed-order butterfly); {affine} "
                f"in registers; one store per value"]

    def stage_json(self, st: LayerNormStage) -> dict:
        return fused_stage_json(st)


FAMILY = LayerNormFamily()
