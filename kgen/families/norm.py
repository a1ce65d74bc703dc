"""The norm family: group_norm / instance_norm with the elementwise ops around it
and an optional reduction over the channels fused in.

Three steps: per-(sample, group) statistics of shifted values (split across
blocks at run time when the batch leaves the device idle), a finalize step that
turns the partial sums into (shift, mean, rstd), and the apply step.
Templates: ``templates/norm/``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..buffer import Buffer, flat_buffer
from ..ir import Elementwise, Norm, Reduce
from ..spec import DTYPES
from ..stage import Stage
from ..target import Target
from .base import Family, StageRequest, Work, fused_stage_json, index_type, target_blocks_per_sm, typed_ops, value_bytes

CUDA_THREADS = 256  # threads per block
MIN_PER_THREAD = 32  # values per thread before the statistics of a group are split across blocks
WAVES = 2  # a split aims for this many times the blocks the device holds at once
UNROLL = 8  # values a thread loads before it uses them (loads in flight)
PER_THREAD = 8  # outputs per thread of the apply step without a channel reduction
SHIFT_SAMPLES = 32  # values averaged into the shift of a group's statistics
CPU_TASK_VALUES = 4096  # values of work per ATen task on the CPU
WARP = 32
# A group of at most this many values is summed by one warp (several groups per block)
# rather than by a block: a 256-thread block over a GEMM row's group of 64 values idles.
WARP_GROUP_VALUES = WARP * MIN_PER_THREAD
MAX_ROW_CHANNELS = CUDA_THREADS  # channels_last inputs up to this many channels: the row kernels


@dataclass(frozen=True)
class Schedule:
    cuda_threads: int
    min_per_thread: int
    unroll: int
    per_thread: int
    shift_samples: int
    target_blocks_per_sm: int  # what a split aims for (the split itself is chosen at run time)
    max_splits: int  # the grid's y limit
    cpu_stats_grain: int  # (sample, group) pairs per ATen task of the statistics step
    cpu_grain: int  # outputs (rows without a reduction) per ATen task of the apply step
    index_type: str
    # How the CUDA kernels spread the work (chosen from the sizes, see choose_layout):
    # "block": blocks per (sample, group), split; "warp": a warp per (sample, group); "rows": a
    # channels_last input, blocks per sample reading whole rows of channels, split
    stats_by: str = "block"
    # "channel": blocks along one channel; "flat": over all outputs in order (small spatial
    # sizes); with a channel reduction "position": a thread per position, "warp": a warp per
    # position over the channels (fewer positions than a block's threads; with a channels_last
    # input, always: a warp reads a row); "transpose": channels_last rows through a shared tile
    apply_by: str = "channel"


@dataclass
class NormStage(Stage):
    prologue: list[Elementwise] = field(default_factory=list)
    norm: Norm = None
    post: list[Elementwise] = field(default_factory=list)
    reduce: Reduce | None = None  # over channels only
    epilogue: list[Elementwise] = field(default_factory=list)
    schedule: Schedule = None


class NormFamily(Family):
    name = "norm"
    dtypes = DTYPES  # 16-bit: loads converted to float, float arithmetic and statistics, stores rounded
    stage_kind = "norm"
    generates_kernel = True
    pieces = ("stage.h", "kernel.cu", "kernel_cpu.cpp", "binding.cpp")
    summary = "statistics, then normalize, with elementwise ops and a channel reduction fused in"
    reads_channels_last = True  # the row kernels (rows_input; up to MAX_ROW_CHANNELS): docs/performance.md, 2026-11-23

    def fits(self, ops):
        """elementwise* norm elementwise* [reduction-over-channels elementwise*]."""
        norms = reduces = 0
        for op in ops:
            if isinstance(op, Elementwise):
                continue
            if isinstance(op, Norm) and norms == 0:
                norms += 1
            elif isinstance(op, Reduce) and norms == 1 and reduces == 0 and op.dims == (1,):
                reduces += 1
            else:
                return False
        return norms == 1

    def make_stage(self, req: StageRequest) -> NormStage:
        types = req.types
        st = NormStage(req.index, list(req.ops), types[0], types[-1], input=req.input, output=flat_buffer(types[-1]))
        for op in req.ops:
            if isinstance(op, Norm):
                st.norm = op
            elif isinstance(op, Reduce):
                st.reduce = op
            elif st.reduce is not None:
                st.epilogue.append(op)
            elif st.norm is not None:
                st.post.append(op)
            else:
                st.prologue.append(op)
        st.schedule = Schedule(
            cuda_threads=CUDA_THREADS,
            min_per_thread=MIN_PER_THREAD,
            unroll=UNROLL,
            per_thread=PER_THREAD,
            shift_samples=SHIFT_SAMPLES,
            target_blocks_per_sm=target_blocks_per_sm(req.target, CUDA_THREADS, WAVES),
            max_splits=req.target.max_grid_y,
            cpu_stats_grain=1,  # a group is thousands of values
            # with a reduction an output combines every channel; without, a task is a whole row
            cpu_grain=max(1, CPU_TASK_VALUES // st.norm.num_channels) if st.reduce else 1,
            index_type=index_type(st),
            **choose_layout(st.norm.num_channels // st.norm.num_groups, math.prod(st.in_type.spatial),
                            st.reduce.fn if st.reduce else None, rows_input(st)),
        )
        return st

    def reads_channels_last_fast(self, buf: Buffer, ops=()) -> bool:
        return not buf.phased and buf.logical[0] <= MAX_ROW_CHANNELS  # the row kernels; else NC[D]HW order, strided

    def work(self, st: NormStage, batch: int, target: Target) -> list[Work]:
        """Statistics (one pass over the input), finalize, apply (a second pass, and the output)."""
        flops = batch * sum(op.flops(t_in, t_out) for op, t_in, t_out in typed_ops(st))
        read = self.read_bytes(st, batch)
        return [Work("statistics", 0, read, launches=1 if st.schedule.stats_by == "warp" else 2),
                Work("apply", flops, read + value_bytes(st) * batch * st.out_type.sample_numel)]

    def explain_lines(self, st: NormStage) -> list[str]:
        sc = st.schedule
        return [f"statistics by {sc.stats_by}, apply by {sc.apply_by} ({st.input.layout} input)"]

    def stage_json(self, st: NormStage) -> dict:
        return fused_stage_json(st)


def rows_input(st: NormStage) -> bool:
    """Whether the input is one channels_last tensor (rows of channels) narrow enough for the
    row kernels: a block's threads a multiple of the channels, the transposed tile in shared memory."""
    buf = st.input
    return buf.layout == "channels_last" and len(buf.tiles) == 1 and FAMILY.reads_channels_last_fast(buf)


def choose_layout(group_channels: int, spatial: int, reduce_fn: str | None, rows: bool = False) -> dict:
    """stats_by / apply_by for a norm over groups of group_channels x spatial values; ``rows``:
    a channels_last input, read row by row (coalesced) and, without a reduction, transposed
    through shared memory into the NC[D]HW output (no conversion pass before the norm)."""
    if rows and group_channels * spatial > WARP_GROUP_VALUES:
        return dict(stats_by="rows", apply_by="transpose" if reduce_fn is None else "warp")
    stats_by = "warp" if group_channels * spatial <= WARP_GROUP_VALUES else "block"
    if reduce_fn is None:
        apply_by = "flat" if spatial < CUDA_THREADS * PER_THREAD else "channel"
    else:  # the warp combines its lanes in a tree: sum, mean, max and min's combine() takes any order
        apply_by = "warp" if spatial < CUDA_THREADS and reduce_fn in ("sum", "mean", "max", "min") else "position"
    return dict(stats_by=stats_by, apply_by=apply_by)


FAMILY = NormFamily()
