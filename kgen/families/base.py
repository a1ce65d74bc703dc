"""What a template family is, and the schedule helpers the families share.

A family computes one kind of stage. It declares:

- which op sequences it can absorb into one stage (``accepts``): every op's
  op-table entry must list the family, and the sequence must fit the family's
  pattern (``fits``);
- its stage type and how a stage is made, with its schedule, at plan time
  (``make_stage``); every tunable number is a field of the stage's schedule;
- its candidates for a request (``candidates``): one stage by default; a family
  with several ways to compute the same stage (memory layouts, tile
  configurations) lists each under its own label, and the plan chooses;
- the work of one of its stages for the cost model (``work``): FLOPs, bytes
  moved, launches (``kgen.cost`` turns it into time);
- its templates: ``templates/<name>/<piece>.j2`` for each generated file it
  contributes to (``pieces``). ``binding.cpp.j2`` defines the macros
  ``host(st)`` (code before ``forward``, e.g. the stage's own op) and
  ``call(st)`` (the stage's lines in ``forward``, defining ``t<index>``);
  a family that generates kernels also renders ``stage.h`` (the math),
  ``kernel.cu`` (CUDA schedule) and ``kernel_cpu.cpp`` (C++ schedule).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

from ..buffer import Buffer
from ..ir import Op, Pipeline, TensorType
from ..ops import AMPLIFYING, OPS
from ..stage import Stage
from ..target import H100_NAME, Target


# ATen's copy of a tensor between NC[D]HW and channels_last (Tensor.contiguous(memory_format=...)) is a transposing
# elementwise copy that moves its bytes at about a quarter of the DRAM rate: 1.73 ms for the 1.93 GB of a
# [10, 480, 224, 224] float32 input on the H200 (floor 0.45 ms; KernelBench level 3 #6, 2026-12-03).
ATEN_RELAYOUT_SHARE = 0.26


@dataclass(frozen=True)
class Work:
    """One piece of a stage's work for the cost model: time = launches * launch cost
    + calls * call_s + latency_s + max(flops / flop_rate, bytes / (bandwidth * bandwidth_share))."""

    what: str
    flops: float = 0.0
    bytes: float = 0.0
    flop_rate: float = 0.0  # FLOP/s these FLOPs run at (0: the target's FP32 rate)
    bandwidth_share: float = 1.0  # of the target's DRAM bandwidth, what these bytes move at
    launches: int = 1  # kernel launches (each costs the target's launch_s)
    calls: int = 0  # library calls with a host-side cost of their own (a cuDNN convolution)
    call_s: float = 0.0  # seconds per such call
    latency_s: float = 0.0  # seconds of waiting that no rate covers (a chain of dependent loads)


@dataclass(frozen=True)
class Candidate:
    """One way a family computes a request: ``label`` names it in plans, explain and
    tuning files (``family`` or ``family:variant``)."""

    label: str
    stage: Stage


@dataclass
class StageRequest:
    """What the planner hands a family to make a stage of."""

    index: int
    ops: list[Op]
    types: tuple[TensorType, ...]  # types[i] is ops[i]'s input; types[-1] the stage's output
    input: Buffer  # what the stage reads
    next_family: "Family | None"  # the family of the stage after it
    pipeline: Pipeline  # rewritten
    target: Target
    batch: int  # the example batch (schedules that depend on the batch count on it)
    start: int  # where ops[0] is in pipeline.ops (a copy stage, of no ops: len(pipeline.ops))

    @property
    def dtype(self) -> str:
        """The dtype the stage computes in: the plan's (a compile-time parameter, like the sizes)."""
        return self.pipeline.dtype


class Family:
    name: ClassVar[str]
    stage_kind: ClassVar[str]  # what its stages compute ("conv"): peers share it
    generates_kernel: ClassVar[bool]  # renders kernels; its stage is also the op kgen::NAME_stageK
    reads_channels_last: ClassVar[bool] = False  # reads a channels_last input as fast as a contiguous one
    # reads a view of the previous stage's tensor in place, any strides (buffer.view_buffer: a permute, a slice, an
    # expand), so that the view's stage copies nothing
    reads_views: ClassVar[bool] = False
    reads_view_operands: ClassVar[bool] = False  # and a view given as a value operand (a matmul's, a cat's)
    writes_output: ClassVar[bool] = True  # False: its output is its input (a stage that only reads, batch_stats)
    pieces: ClassVar[tuple[str, ...]]  # generated files it contributes to, from templates/<name>/<piece>.j2
    cuda_includes: ClassVar[tuple[str, ...]] = ()  # headers (under the output root) its kernel.cu piece needs
    summary: ClassVar[str]
    # the dtypes it has kernels for; ATen-backed families compute every dtype ATen does
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)

    def accepts(self, ops: list[Op]) -> bool:
        """Whether one stage of this family can compute ``ops``."""
        return all(self.name in OPS[op.op_name].families for op in ops) and self.fits(ops)

    def fits(self, ops: list[Op]) -> bool:
        """The family's pattern over the kinds of ops (their order, how many of each)."""
        raise NotImplementedError

    def unsupported(self, req: StageRequest) -> str | None:
        """Why this family declines a request it accepts by its ops (its input buffer, the
        precision, sizes it is not made for); None when it takes it."""
        return None

    def declines(self, req: StageRequest) -> str | None:
        """Why the family offers nothing for ``req``: a dtype it has no kernels for, else ``unsupported``."""
        if req.dtype not in self.dtypes:
            return f"no {req.dtype} kernels yet"
        return self.unsupported(req)

    def make_stage(self, req: StageRequest) -> Stage:
        raise NotImplementedError

    def candidates(self, req: StageRequest) -> list[Candidate]:
        """The ways this family computes ``req``, its preferred one first. By default one:
        ``make_stage``. A family with schedules or layouts to choose between returns one
        candidate per configuration (labels ``NAME:config``), or none where it declines."""
        return [Candidate(self.name, self.make_stage(req))]

    def work(self, stage: Stage, batch: int, target: Target) -> list[Work]:
        """The stage's work at ``batch`` for the cost model. By default one kernel that
        reads its input tiles and writes its output once, FLOPs on the CUDA cores."""
        flops = batch * sum(op.flops(t_in, t_out) for op, t_in, t_out in typed_ops(stage))
        nbytes = self.read_bytes(stage, batch) + value_bytes(stage) * batch * stage.out_type.sample_numel
        return [Work(self.name, flops, nbytes)]

    def read_bytes(self, stage: Stage, batch: int) -> float:
        """Bytes one pass over the stage's input costs: a channels_last input read by a
        family that walks it in contiguous order wastes part of each memory sector."""
        elements = batch * sum(t.stored for t in stage.input.tiles)
        buf = stage.input
        wasted = buf.layout == "channels_last" and not self.reads_channels_last_fast(buf, stage.ops)
        return value_bytes(stage) * elements * (STRIDED_READ_FACTOR if wasted else 1)

    def reads_channels_last_fast(self, buf: Buffer, ops=()) -> bool:
        """Whether a stage of this family reads the channels_last input ``buf`` (its channels are
        ``buf.logical[0]``; it may be sub-pixel phase tiles or a cropped view) at full speed; ``ops``:
        the stage's ops (or the ops from its first on, where the stage is not made yet). By default
        the family's ``reads_channels_last``; a family's kernels may depend on the sizes."""
        return self.reads_channels_last

    def view_output(self, stage: Stage):
        """Where the stage only views its input (a permute, a slice, an expand): the view's buffer, which the stage
        hands on without a copy where every reader reads views (``plan._views_read_in_place``); else None."""
        return None

    def absorbs_epilogue(self, stage: Stage, nxt: Stage) -> bool:
        """Whether ``stage`` takes the next stage as its epilogue (a generated convolution may)."""
        return False

    def writes_channel_slice(self, stage: Stage) -> bool:
        """Whether the kernel that writes ``stage``'s output (its own, or that of the stage absorbing it) can write
        it into a channel slice of a larger tensor (samples ``Stage.out_sample`` apart): a cat of it then copies
        nothing."""
        return False

    def gathers_statistics(self, stage: Stage, nxt: Stage) -> bool:
        """Whether ``stage``'s kernel gathers the next stage's statistics (a batch_stats stage) per tile
        while it writes its output, so that the next stage only merges them (a generated convolution may)."""
        return False

    def stage_json(self, stage: Stage) -> dict:
        """The family's fields of a stage for plan.json."""
        return {}

    def explain_lines(self, stage: Stage) -> list[str]:
        """How the stage runs, in words, for `kgen explain` (its kernels and why)."""
        return []

    def binding_includes(self, stage: Stage) -> list[str]:
        """Headers binding.cpp includes for the stage (beyond kgen_runtime.h)."""
        return []

    def template(self, piece: str) -> str:
        return f"{self.name}/{piece}.j2"

    def __repr__(self) -> str:
        return f"<family {self.name}>"


# ---------------------------------------------------------------- shared helpers

FLOAT_BYTES = 4  # a float32 value (shared memory, fp32 statistics; a stage's values: value_bytes)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A block's tiles in shared memory (the layer_norm and softmax tiles forms: values as float), at most: room beside
# them for their statistics within STATIC_SMEM_BYTES
TILE_SMEM_BYTES = 40 * 1024
STATIC_SMEM_BYTES = 48 * 1024  # a block's static shared memory at most
VECTOR_WIDTHS = (4, 2, 1)  # float32 values per load of a vector, widest first (float4, float2, float)
VECTOR_WIDTHS_16 = (8, 4, 2, 1)  # 16-bit values per load: 16-byte vectors too


def vector_widths(dtype: str) -> tuple[int, ...]:
    """Values per vector load or store of ``dtype``, widest (16 bytes) first."""
    return VECTOR_WIDTHS if dtype == "float32" else VECTOR_WIDTHS_16


def value_bytes(stage: Stage) -> int:
    """Bytes of one value a stage reads or writes in memory: its dtype's size (a 16-bit stage moves half
    a float32 one's bytes; its arithmetic is fp32 either way)."""
    return DTYPE_BYTES[stage.dtype]
STRIDED_READ_FACTOR = 4  # a channels_last input read in contiguous order: each warp load touches a sector per thread (cost model)


# Forward convolutions (2-d and 3-d, no groups: what was measured) with at least this many input channels
# ran TF32 in eager's cuDNN call wherever TF32 was allowed: every one of KernelBench level 2's at its batch,
# 16 -> 64 2-d (K = 144) to 64 -> 128 (reports/cudnn_calibration_h100.json, H100, cuDNN 9.19); below it cuDNN mixes fp32 kernels
# (3 and 8 input channels: 2-d 8 -> 64 fp32, 3-d 8 -> 16 TF32, 3-d 8 -> 64 fp32). Products more
# accurate than eager's differ from them by eager's own TF32 error, which KernelBench's check sees
# (#25, 16 -> 64 then a min over channels: 1/5 with split TF32).
EAGER_TF32_MIN_CIN = 16
# The GPU the two rules on eager's own cuDNN calls (transposed, EAGER_TF32_MIN_CIN) were measured on. cuDNN
# picks its kernels per GPU (on an H200, eager's call for maxpool_sum's transposed convolution is fp32-accurate,
# 3.6e-8 relative to float64, where the H100's is TF32): on any other GPU, until `kgen tune` measures eager's
# calls there, the plan assumes fp32 ones and takes fp32-level products, never less accurate than eager.
EAGER_RULES_DEVICE = H100_NAME


def later_ops(req: StageRequest) -> list:
    """The pipeline's ops after the stage's (first) op."""
    return req.pipeline.ops[req.start + 1:]


def follows(req: StageRequest, op_names: tuple[str, ...]) -> bool:
    """Whether one of ``op_names`` comes after the stage's op in the pipeline."""
    return not req.pipeline.names_after[req.start].isdisjoint(op_names)


# ops whose kgen stage sums in another order than ATen's call: before a batch norm run as eager's call they are
# ATen's too, each in a stage of its own (plan.eager_call_cuts)
EAGER_SOFTMAXES = ("softmax", "log_softmax")


def before_eager_batch_norm(pipe: Pipeline, i: int) -> bool:
    """Whether op ``i`` (a convolution, a softmax) comes before a training-mode batch norm that runs as eager's call
    (Pipeline.eager_batch_norms): then it runs as eager's own call too, whose bits the norm sees."""
    return pipe.eager_batch_norms and "batch_norm" in pipe.names_after[i]


def conv_precision(req: StageRequest) -> tuple[bool, str]:
    """Whether the convolution of ``req`` (a spec at precision tf32) needs fp32-level products to be as
    accurate as eager PyTorch, and why. TF32 products where eager's own cuDNN call is TF32: every
    transposed convolution (cuDNN's data-gradient kernels ran TF32 in all 19 KernelBench level-2
    problems that have one, 3 -> 16 channels included: bench/cudnn_calibrate.py), every
    forward one of EAGER_TF32_MIN_CIN or more input channels (whatever follows), and where a sum or
    mean over its values follows (the products' rounding averages out). fp32-level
    elsewhere: each output value carries a convolution value's error (elementwise ops, max or min pools
    and reductions, or the convolution is the output), or a normalization (it removes the scale and
    leaves the relative error) or an exponential (softmax and logsumexp turn the absolute error of
    large logits into a relative error) follows; and cuDNN runs many small forward convolutions in
    plain fp32 even where TF32 is allowed (3 or 8 input channels, k3, 2-d and 3-d). Where `kgen tune` measured
    eager's call on the render target (Pipeline.eager_conv_tf32), that measurement replaces the first two rules:
    TF32 products where it ran TF32, else the rules on what follows. The first two rules hold on the GPU they were
    measured on (EAGER_RULES_DEVICE); elsewhere, unmeasured, only the rules on what follows decide."""
    conv = getattr(req.ops[0], "conv", req.ops[0])  # as written (a LoweredConv wraps it)
    measured = dict(req.pipeline.eager_conv_tf32).get(conv.module)  # by `kgen tune` on this GPU, if it was
    if measured:
        return False, "eager's cuDNN call for it runs TF32 (measured by `kgen tune` on this GPU)"
    unmeasured_device = measured is None and req.target.name != EAGER_RULES_DEVICE
    if measured is None and unmeasured_device:
        measured = False  # assume fp32 kernels: the rules below on what follows decide
    if measured is None and conv.transposed:
        return False, "eager's cuDNN call for a transposed convolution runs TF32"
    if measured is None and conv.groups == 1 and conv.rank >= 2 and conv.in_channels >= EAGER_TF32_MIN_CIN:
        return False, f"eager's cuDNN call for a forward convolution of {EAGER_TF32_MIN_CIN} or more input channels runs TF32"
    unknown = (f" (eager's cuDNN precision on {req.target.name} is not measured: `kgen tune` measures it)"
               if unmeasured_device else "")
    if follows(req, AMPLIFYING):
        return True, "a normalization or an exponential follows" + unknown
    if not req.pipeline.sum_after[req.start]:
        return True, "no sum or mean over its values follows (each output carries a convolution value's error)" + unknown
    return False, "a sum or mean over its values follows"


def split_around(ops, is_core) -> tuple[list, Op | None, list]:
    """(the ops before the one op ``is_core`` picks, that op, the ops after it): a family that fuses
    elementwise ops on both sides of its one op (layer_norm, softmax)."""
    i = next((i for i, op in enumerate(ops) if is_core(op)), len(ops))
    return list(ops[:i]), (ops[i] if i < len(ops) else None), list(ops[i + 1:])


def group_words(threads: int, block_threads: int, unit: str, warp: int = 32) -> str:
    """`kgen explain`'s words for ``threads`` sharing one ``unit`` (a row, a slice) in blocks of ``block_threads``."""
    if threads == block_threads:
        return f"a block of {threads} threads per {unit}"
    if threads == warp:
        return f"a warp per {unit}"
    return f"{threads} lanes per {unit} ({warp // threads} {unit}s per warp)"


def input_words(buf: Buffer) -> str:
    """`kgen explain`'s words for how a fused stage reads its input buffer."""
    if buf.phased:
        return f"{len(buf.tiles)} sub-pixel phase tiles read in place"
    if buf.flat:
        return "a plain contiguous input"
    return f"a {buf.layout} buffer read in place"


def fused_stage_json(stage: Stage) -> dict:
    """plan.json's fields of a fused stage (pool_reduce, norm, layer_norm, softmax): its input buffer and schedule."""
    return {"input_buffer": asdict(stage.input), "schedule": asdict(stage.schedule)}


def typed_ops(stage: Stage):
    """(op, input type, output type) of each op of a stage (the eager stage's ops read named values too: its
    own ``chain``)."""
    if hasattr(stage, "chain"):
        return stage.chain()
    known = stage.typed[0] if stage.typed else None  # (ops, input type, result)
    if known is not None and known[1] is stage.in_type and len(known[0]) == len(stage.ops) and \
            all(a is b for a, b in zip(known[0], stage.ops)):
        return known[2]
    types = [stage.in_type]
    for op in stage.ops:
        types.append(op.infer(types[-1]))
    out = list(zip(stage.ops, types, types[1:]))
    stage.typed[:] = [(tuple(stage.ops), stage.in_type, out)]
    return out



def index_type(stage: Stage) -> str:
    """int when every per-sample index of the stage fits in 32 bits (cheaper divisions), else long long."""
    sizes = [math.prod(t.dims) for t in stage.input.tiles] + [stage.in_type.sample_numel, stage.out_type.sample_numel]
    return "int" if max(sizes) < 2**31 - 1 else "long long"


def target_blocks_per_sm(target: Target, threads: int, waves: int) -> int:
    """Blocks per SM a split reduction aims for: ``waves`` times what the SM holds at once."""
    return waves * (target.max_threads_per_sm // threads)


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()
