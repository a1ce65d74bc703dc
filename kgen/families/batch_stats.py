"""The batch_stats family: training-mode batch norm's statistics (ir.BatchStats), a stage that
reads its input once and passes it on; the stages after it apply the norm as a per-channel affine
(rewrites.batch_norm_batch_stats).

On CUDA two generated kernels: per-block shifted sums of fixed chunks of each (sample, channel)
row (rows of at least MIN_SPATIAL values), or, for shorter rows (BatchNorm1d over [N, C]) and for a
dense channels_last input (read as it lies: rows of channels), per-thread shifted sums of one column
(channel and position, or channel and slot of a group of positions) over an interleaved share of the
rows; then one
block per channel that adds them in index order in double, writes the mean and the scale and updates
the running statistics. ATen's var_mean (its Welford reduction) reads the same bytes at about half the
bandwidth on the H100 (docs/performance.md, 2026-11-27), and over [N, C] it was followed by 8 ATen
calls on C values each (the running statistics, the scale). On the CPU: ATen's var_mean
(kgen::batch_norm_batch_stats). Templates: ``templates/batch_stats/``.

In a 16-bit plan the input, the weight and the running statistics are in the plan's dtype (a model converted
with ``model.to(dtype)``), as ATen's batch norm takes them: the input converted to float where it is loaded,
the statistics in float (the kernels' sums in float, their merge in double, as in float32), the mean and the
scale made in float (the stages after it take them as float: ``TensorArg.dtype``), and each running statistic
updated in float and rounded once to the dtype, as ATen's batch_norm_update_stats does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..buffer import Buffer, flat_buffer
from ..ir import BatchStats
from ..spec import DTYPES
from ..stage import Stage
from ..target import Target
from .base import Family, StageRequest, Work

CUDA_THREADS = 256
PER_THREAD = 16  # values a thread loads before it adds them (loads in flight)
MIN_SPATIAL = 64  # shorter rows (BatchNorm1d: 1) take the column kernel: a block per row would idle
# the column kernel: blocks it aims for (a multiple of the SMs' resident blocks; sample chunks fill the grid's y) and
# the most sample chunks (each thread sums batch / chunks samples of its column)
COLUMN_TARGET_BLOCKS_PER_SM = 8
MAX_SAMPLE_CHUNKS = 64
MOMENT_BYTES = 12  # a tile's (count, mean, M2) in float (kgen::TileMoments)
# blocks per channel that merge gathered tile moments (merge_moments_kernel), each a range in index order, then
# combined in order: one block per channel left the GPU idle (H100, #72's 16 channels x 16384 tiles: 33 us)
MERGE_PARTS = 16


@dataclass
class BatchStatsStage(Stage):
    threads: int = CUDA_THREADS
    per_thread: int = PER_THREAD
    columns: bool = False  # rows shorter than MIN_SPATIAL: the column kernel (a thread per channel and position)
    # a dense channels_last input, read as it lies by the column kernel: a row of the kernel is `slots` consecutive
    # positions' channels (slots * C columns), the output is the input (no copy into NC[D]HW)
    channels_last: bool = False
    slots: int = 1
    target_blocks: int = 0  # the column kernel's grid aims for this many blocks
    max_sample_chunks: int = MAX_SAMPLE_CHUNKS
    merge_parts: int = MERGE_PARTS
    # the stage (a generated convolution) whose kernel gathers per-tile moments of this stage's input
    # while writing it (on CUDA this stage then only merges them: merge_moments_kernel)
    gathered_by: Stage | None = None

    @property
    def stats(self) -> BatchStats:
        return self.ops[0]

    @property
    def spatial(self) -> int:
        return math.prod(self.in_type.spatial)

    @property
    def column_slots(self) -> int:
        """The column kernel's columns per channel: its positions in NC[D]HW, `slots` in channels_last."""
        return self.slots if self.channels_last else self.spatial

    @property
    def rows_per_sample(self) -> int:
        """The column kernel's rows per sample (each of C x column_slots values)."""
        return self.spatial // self.slots if self.channels_last else 1

    @property
    def chunk(self) -> int:
        """Values of a (sample, channel) row one block sums."""
        return self.threads * self.per_thread

    @property
    def chunks(self) -> int:
        """Blocks per (sample, channel) row: the partials of a channel are batch x chunks."""
        return -(-self.spatial // self.chunk)


class BatchStatsFamily(Family):
    name = "batch_stats"
    stage_kind = "batch_stats"
    generates_kernel = False  # its kernels are the binding's helpers, not a stage op of their own
    writes_output = False
    pieces = ("kernel.cu", "binding.cpp")
    summary = "training-mode batch norm's per-channel statistics and running-statistics update (one read)"
    dtypes = DTYPES  # 16-bit: the input and parameters as stored, the statistics in float (module docstring)

    def fits(self, ops):
        return len(ops) == 1 and isinstance(ops[0], BatchStats)

    def make_stage(self, req: StageRequest) -> BatchStatsStage:
        t_in, t_out = req.types
        st = BatchStatsStage(req.index, list(req.ops), t_in, t_out, input=req.input, output=flat_buffer(t_out))
        st.target_blocks = req.target.sm_count * COLUMN_TARGET_BLOCKS_PER_SM
        st.columns = st.spatial < MIN_SPATIAL
        if req.input.layout == "channels_last" and req.input.dense and st.spatial > 1:
            # read as it lies (a copy into NC[D]HW would read and write it once more): rows of channels, grouped
            # into rows of `slots` positions so that a block's loads are whole rows of at most CUDA_THREADS values
            channels = st.stats.norm.num_features
            st.channels_last, st.columns, st.output = True, True, req.input
            st.slots = max(g for g in range(1, max(1, CUDA_THREADS // channels) + 1) if st.spatial % g == 0)
            st.threads = min(CUDA_THREADS, -(-channels * st.slots // 32) * 32)
            st.max_sample_chunks = st.target_blocks  # rows are many and short: as many chunks as blocks
        return st

    def reads_channels_last_fast(self, buf: Buffer, ops=()) -> bool:
        """A dense channels_last input is read as it lies (the column kernel, make_stage); sub-pixel phase tiles
        and a cropped view are copied into NC[D]HW first (where positions are one, the layouts are one)."""
        return buf.dense or math.prod(buf.logical[1:]) == 1

    def work(self, st: BatchStatsStage, batch: int, target: Target) -> list[Work]:
        """One read of the input; nothing written (its output is its input). Gathered by the stage
        before it: one launch that reads the tiles' moments."""
        if st.gathered_by is not None:
            return [Work("merge of the gathered moments", 0, MOMENT_BYTES * self.moments(st, batch), launches=2)]
        return [Work("batch statistics", 0, self.read_bytes(st, batch), launches=2)]

    @staticmethod
    def moments(st: BatchStatsStage, batch: int) -> int:
        """Tile moments (count, mean, M2) the gathering stage writes per call."""
        return batch * st.stats.norm.num_features * st.gathered_by.moments_tiles()

    def call_lines(self, st: BatchStatsStage, fn: str, src: str, ident, buffers) -> list[str]:
        """C++ statements of the stage in forward (after aten_prelude's copies of the running
        statistics it updates): ``fn`` (kgen::batch_norm_batch_stats's arguments) makes the mean
        and the scale, under the names the stages after it take them by (``ident``), and updates
        the copies in training mode (``buffers``: the op's running-statistics arguments in order;
        a norm's update weight is factors[its index // 2]); where the stage before gathers the
        statistics, ``moments{index}`` (its tiles' moments, undefined off CUDA) too."""
        op = st.stats
        w = ident(op.weight) if op.weight else "at::Tensor()"
        if op.norm.track_running_stats:
            rm, rv = op.buffer_names()
            k = list(buffers).index(rm) // 2
            update = f"training ? new_{ident(rm)} : at::Tensor(), training ? new_{ident(rv)} : at::Tensor(), training ? factors[{k}] : 0.0"
        else:
            update = "at::Tensor(), at::Tensor(), 0.0"
        i = st.index
        gathered = f", moments{i}" if st.gathered_by is not None else ""  # the tiles' moments (conv_gemm's binding)
        return [f"const auto stats{i} = {fn}({src}, {w}, {op.norm.eps!r}, {update}{gathered});",
                f"const at::Tensor& {op.mean.ident} = stats{i}.first;",
                f"const at::Tensor& {op.scale.ident} = stats{i}.second;"]

    def explain_lines(self, st: BatchStatsStage) -> list[str]:
        if st.gathered_by is not None:
            how = "instead of writing them (nothing reads them)" if st.gathered_by.output_dropped else "as it writes them"
            return [f"CUDA: stage {st.gathered_by.index}'s kernel gathers (count, mean, M2) of each output tile and channel "
                    f"{how}; {st.merge_parts} blocks per channel merge consecutive ranges of them, combined in order "
                    "(double, Chan's formula), and update the running statistics; CPU: ATen's var_mean"]
        if st.channels_last:
            return [f"CUDA: the channels_last input read as it lies: a thread per column of rows of {st.slots} position(s) x "
                    f"{st.stats.norm.num_features} channels sums it over a share of the rows, then a warp per channel adds "
                    "them in order (double) and updates the running statistics; CPU: ATen's var_mean"]
        if st.columns:
            return [f"CUDA: a thread per channel and position sums its column over a share of the samples (rows of {st.spatial} "
                    "too short for a block each), then a block per channel adds them in order (double) and updates the "
                    "running statistics; CPU: ATen's var_mean"]
        return [f"CUDA: shifted sums of {st.chunk}-value chunks of each (sample, channel) row, then a block per "
                "channel adds them in order (double) and updates the running statistics; CPU: ATen's var_mean"]


FAMILY = BatchStatsFamily()
