"""Split a (rewritten) pipeline into stages and pick a template family and schedule for each.

A stage is one of:

- ``conv``: an ATen convolution (direct, folded or sub-pixel) run from the
  generated binding; it decides the memory layout of its output.
- ``pool_reduce``: elementwise prologue -> a chain of window pools, each
  followed by elementwise ops -> an optional reduction -> an elementwise
  epilogue. One pass over its input.
- ``norm``: per-(sample, group) statistics, then normalize with the
  surrounding elementwise ops and an optional reduction over channels fused in.

Each fused stage reads a ``Buffer``: the logical tensor ``(N, C, *S)`` and how
it lies in memory (its physical size may exceed the logical one when a
convolution was cropped, and a sub-pixel convolution leaves one buffer per
phase). Everything here is static; only the batch is known at run time.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .ir import Conv, Elementwise, Norm, Op, Pipeline, Pool, Reduce, TensorType, subpixel_phases
from .rewrites import Decision, apply_rewrites

CUDA_THREADS = 256
# Aim for this many resident threads when choosing how many threads share one
# output's reduction (132 SMs x 2048 threads on an H100).
TARGET_THREADS = 132 * 2048


@dataclass(frozen=True)
class Tile:
    """One physical buffer: its size per logical dim (C, *S), strides (elements) and offsets."""

    dims: tuple[int, ...]  # physical (C, *S)
    strides: tuple[int, ...]  # per (C, *S)
    sample_stride: int
    offset: tuple[int, ...]  # logical position 0 lies at this physical position (spatial dims)
    residue: tuple[int, ...] = ()  # sub-pixel phase: logical o = stride*m + residue

    @property
    def memory_order(self) -> list[int]:
        """Dims (0 = C, 1.. = spatial) from outermost to innermost."""
        return sorted(range(len(self.dims)), key=lambda d: -self.strides[d])


@dataclass(frozen=True)
class Buffer:
    """A stage's input: the logical shape, and the tile(s) holding it."""

    logical: tuple[int, ...]  # (C, *S)
    layout: str  # contiguous | channels_last
    tiles: tuple[Tile, ...]
    phase_stride: tuple[int, ...] = ()  # sub-pixel: one tile per phase

    @property
    def phased(self) -> bool:
        return bool(self.phase_stride)

    @property
    def flat(self) -> bool:
        """A plain contiguous (C, *S) tensor: element e of a sample lies at e."""
        t = self.tiles[0]
        return not self.phased and self.layout == "contiguous" and t.dims == self.logical and not any(t.offset)

    @property
    def innermost(self) -> int:
        order = [d for d in self.tiles[0].memory_order if self.logical[d] > 1]
        return order[-1] if order else len(self.logical) - 1


def _strides(dims: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], int]:
    """Strides of a (C, *S) sample in ``layout``, and the sample stride."""
    order = list(range(len(dims)))
    if layout == "channels_last":
        order = order[1:] + [0]
    strides = [0] * len(dims)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= dims[d]
    return tuple(strides), step


def dense_buffer(logical, physical, layout) -> Buffer:
    strides, sample = _strides(tuple(physical), layout)
    tile = Tile(tuple(physical), strides, sample, (0,) * (len(physical) - 1))
    return Buffer(tuple(logical), layout, (tile,))


# ---------------------------------------------------------------- stages


@dataclass
class Stage:
    index: int
    kind: str
    ops: list[Op]
    in_type: TensorType
    out_type: TensorType

    @property
    def keys(self) -> list[str]:
        return [o.key for o in self.ops]

    def tensor_names(self) -> list[str]:
        names = []
        for op in self.ops:
            for n in op.tensor_names():
                if n not in names:
                    names.append(n)
        return names


@dataclass
class ConvStage(Stage):
    conv: Conv = None
    layout: str = "contiguous"
    output: Buffer = None  # what the next stage reads
    phases: list = field(default_factory=list)  # SubpixelPhase, for lowering == subpixel
    input_extent: tuple = ()  # prefix of the input that is read (dead region)
    out_physical: tuple = ()  # direct/folded: (C, *S) the ATen call produces


@dataclass
class Level:
    """A pool (None for level 0, the load) followed by elementwise ops."""

    pool: Pool | None
    ew: list[Elementwise]
    in_type: TensorType  # type of the pool's input
    out_type: TensorType


@dataclass
class PoolReduceStage(Stage):
    input: Buffer = None
    levels: list[Level] = field(default_factory=list)
    reduce: Reduce | None = None
    epilogue: list[Elementwise] = field(default_factory=list)
    # schedule
    r_lanes: int = 1  # threads that share one output's reduction
    r_fast: bool = False  # consecutive threads walk the reduction (else the outputs)
    reduce_order: tuple = ()  # reduced dims, outermost first (input memory order)
    kept_dims: tuple = ()  # non-reduced dims of the last level, row-major

    @property
    def pooled_type(self) -> TensorType:
        return self.levels[-1].out_type

    @property
    def reduced_count(self) -> int:
        return math.prod(self.pooled_type.shape[d] for d in self.reduce_order) if self.reduce else 1

    @property
    def kept_count(self) -> int:
        return math.prod(self.pooled_type.shape[d] for d in self.kept_dims)


@dataclass
class NormStage(Stage):
    input: Buffer = None
    prologue: list[Elementwise] = field(default_factory=list)
    norm: Norm = None
    post: list[Elementwise] = field(default_factory=list)
    reduce: Reduce | None = None  # over channels only
    epilogue: list[Elementwise] = field(default_factory=list)


@dataclass
class Plan:
    pipeline: Pipeline  # rewritten
    original: Pipeline
    decisions: list[Decision]
    stages: list[Stage]

    @property
    def name(self) -> str:
        return self.pipeline.name

    def fused_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.kind != "conv"]

    def stage_args(self, stage: Stage) -> list:
        """The parameter tensors (TensorArgs) a fused stage's op takes, in the module's argument order."""
        names = stage.tensor_names()
        return [a for a in self.pipeline.tensor_args() if a.name in names]

    def to_json(self) -> dict:
        def stage_json(s: Stage) -> dict:
            d = {
                "index": s.index,
                "kind": s.kind,
                "ops": [o.describe() for o in s.ops],
                "spec_keys": s.keys,
                "input": str(s.in_type),
                "output": str(s.out_type),
            }
            if isinstance(s, ConvStage):
                d.update(lowering=s.conv.lowering, layout=s.layout, input_extent=list(s.input_extent))
                if s.phases:
                    d["phases"] = [asdict(p) for p in s.phases]
            else:
                d["input_buffer"] = asdict(s.input)
            if isinstance(s, PoolReduceStage):
                d["schedule"] = dict(cuda_threads=CUDA_THREADS, r_lanes=s.r_lanes, r_fast=s.r_fast)
            return d

        return {
            "name": self.name,
            "spec": self.pipeline.path,
            "precision": self.pipeline.precision,
            "rewrites": [asdict(d) for d in self.decisions],
            "ops_before": [o.describe() for o in self.original.ops],
            "ops_after": [o.describe() for o in self.pipeline.ops],
            "stages": [stage_json(s) for s in self.stages],
        }


# ---------------------------------------------------------------- planning


def _group(ops):
    """Split the op chain into [(kind, ops, first_index)] of conv / fused groups."""
    groups, cur, start = [], [], 0

    def close():
        nonlocal cur
        if cur:
            kind = "norm" if any(isinstance(o, Norm) for o in cur) else "pool_reduce"
            groups.append((kind, cur, start))
        cur = []

    for i, op in enumerate(ops):
        has = lambda cls: any(isinstance(o, cls) for o in cur)  # noqa: E731
        if isinstance(op, Conv):
            close()
            groups.append(("conv", [op], i))
            start = i + 1
            continue
        if not cur:
            start = i
        if isinstance(op, Pool) and (has(Reduce) or has(Norm)):
            close()
            start = i
        elif isinstance(op, Norm) and (has(Pool) or has(Reduce) or has(Norm)):
            close()
            start = i
        elif isinstance(op, Reduce) and (
            has(Reduce) or (has(Norm) and op.dims != (1,))
        ):
            close()
            start = i
        cur.append(op)
    close()
    return groups


def _conv_stage(index, conv: Conv, t_in, t_out, layout) -> ConvStage:
    C = conv.out_channels
    if conv.lowering == "subpixel":
        phases = subpixel_phases(conv, t_in.spatial)
        tiles = []
        for ph in phases:
            dims = (C,) + ph.conv_out
            strides, sample = _strides(dims, layout)
            tiles.append(Tile(dims, strides, sample, ph.offset, ph.residue))
        # stride 1 has a single phase: a dense tile, maybe offset
        phase_stride = conv.stride if len(tiles) > 1 else ()
        buf = Buffer(t_out.shape[1:], layout, tuple(tiles), phase_stride=phase_stride)
        return ConvStage(index, "conv", [conv], t_in, t_out, conv=conv, layout=layout, output=buf,
                         phases=phases, input_extent=phases[0].input_extent)
    extent = conv.input_extent(t_in.spatial)
    physical = (C,) + (conv.computed_out(extent) if conv.crop else t_out.spatial)
    buf = dense_buffer(t_out.shape[1:], physical, layout)
    return ConvStage(index, "conv", [conv], t_in, t_out, conv=conv, layout=layout, output=buf,
                     input_extent=extent, out_physical=physical)


def _pool_reduce_stage(index, ops, types, buf: Buffer, batch: int) -> PoolReduceStage:
    levels = [Level(None, [], types[0], types[0])]
    reduce, epilogue = None, []
    for op, t_in, t_out in zip(ops, types, types[1:]):
        if isinstance(op, Pool):
            levels.append(Level(op, [], t_in, t_out))
        elif isinstance(op, Reduce):
            reduce = op
        elif reduce is not None:
            epilogue.append(op)
        else:
            levels[-1].ew.append(op)
            levels[-1].out_type = t_out
    st = PoolReduceStage(index, "pool_reduce", list(ops), types[0], types[-1], input=buf, levels=levels,
                         reduce=reduce, epilogue=epilogue)
    pooled = st.pooled_type
    dims = range(1, pooled.rank)
    red = set(reduce.dims) if reduce else set()
    # reduced dims in the input's memory order, so consecutive r are adjacent in memory
    mem = [d + 1 for d in buf.tiles[0].memory_order]
    st.reduce_order = tuple(d for d in mem if d in red)
    st.kept_dims = tuple(d for d in dims if d not in red)
    st.r_fast = (buf.innermost + 1) in red
    if st.reduced_count == 1:
        st.r_lanes = 1
    elif st.r_fast:
        st.r_lanes = min(CUDA_THREADS, _pow2_floor(st.reduced_count))
    else:
        outputs = batch * st.kept_count
        want = _pow2_ceil(max(1, TARGET_THREADS // max(outputs, 1)))
        st.r_lanes = max(1, min(want, 32, _pow2_floor(st.reduced_count)))
    return st


def _norm_stage(index, ops, types, buf: Buffer) -> NormStage:
    st = NormStage(index, "norm", list(ops), types[0], types[-1], input=buf)
    for op in ops:
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
    return st


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def defer_conv_bias(pipe: Pipeline) -> Pipeline:
    """Move each convolution's bias into the fused stage that reads it.

    cuDNN does not add a bias: ATen adds it in a separate pass over the whole
    convolution output. Adding it where the next stage loads the value costs
    nothing there, and the value is the same (conv, then one rounded add).
    """
    ops = []
    for i, op in enumerate(pipe.ops):
        nxt = pipe.ops[i + 1] if i + 1 < len(pipe.ops) else None
        if isinstance(op, Conv) and op.bias and nxt is not None and not isinstance(nxt, Conv):
            ops.append(replace(op, bias_deferred=True))
            view = (op.out_channels,) + (1,) * op.rank
            ops.append(Elementwise(key=op.key, fn="add", param=op.bias_name, param_view=view))
        else:
            ops.append(op)
    return pipe.with_ops(ops) if len(ops) != len(pipe.ops) else pipe


def make_plan(pipeline: Pipeline, rewrites: dict | None = None) -> Plan:
    """Rewrite ``pipeline`` (per the spec's switches, or ``rewrites``) and split it into stages."""
    rewritten, decisions = apply_rewrites(pipeline, rewrites)
    rewritten = defer_conv_bias(rewritten)
    ops, types = rewritten.ops, rewritten.types
    groups = _group(ops)
    stages: list[Stage] = []
    batch = rewritten.example_batch()
    buf = None  # what the next fused stage reads; None: the (contiguous) input x
    for gi, (kind, gops, start) in enumerate(groups):
        gtypes = types[start : start + len(gops) + 1]
        index = len(stages)
        if kind == "conv":
            nxt = groups[gi + 1][0] if gi + 1 < len(groups) else None
            layout = rewritten.conv_layout
            if layout == "auto":  # measured on the H100: notes/perf.md
                direct_transposed = gops[0].transposed and gops[0].lowering == "direct"
                layout = "channels_last" if nxt == "pool_reduce" and gops[0].rank >= 2 and not direct_transposed else "contiguous"
            st = _conv_stage(index, gops[0], gtypes[0], gtypes[1], layout)
            buf = st.output
        else:
            if buf is None:
                shape = gtypes[0].shape[1:]
                buf = dense_buffer(shape, shape, "contiguous")
            if kind == "norm":
                st = _norm_stage(index, gops, gtypes, buf)
            else:
                st = _pool_reduce_stage(index, gops, gtypes, buf, batch)
            shape = gtypes[-1].shape[1:]
            buf = dense_buffer(shape, shape, "contiguous")
        stages.append(st)
    # A convolution output that is not a plain tensor (sub-pixel phases, a
    # cropped buffer) gets an assembling stage when nothing fused reads it.
    for i in range(len(stages) - 1, -1, -1):
        st = stages[i]
        nxt = stages[i + 1] if i + 1 < len(stages) else None
        if not isinstance(st, ConvStage) or (nxt is not None and nxt.kind != "conv"):
            continue
        plain = not st.output.phased and st.output.tiles[0].dims == st.output.logical
        if plain and (nxt is not None or st.layout == "contiguous"):
            continue
        t = st.out_type
        asm = _pool_reduce_stage(i + 1, [], (t,), st.output, batch)
        stages.insert(i + 1, asm)
    for i, st in enumerate(stages):
        st.index = i
    return Plan(rewritten, pipeline, decisions, stages)
