"""The cost model: a plan's time on the target, estimated from its stages' work.

Each family says what one of its stages does at a batch (``Family.work``):
FLOPs and the rate they run at, bytes moved, kernel launches and library
calls. A piece of work takes

    launches * launch_s + calls * call_s + latency_s + max(FLOPs / rate, bytes / (DRAM bandwidth * share))

and a plan's stages run one after another, so their times add. The device
facts come from the target (``kgen.target``, per device: the H200's ~4.3 TB/s,
TF32 tensor cores at ~400 TFLOP/s, a few microseconds per launch); what is particular to a
library (cuDNN reaching ~300 TFLOP/s on large convolutions, much less on small
ones, and tens of microseconds per call) is in its family. The model decides
where a spec's tuning file has no entry for the target (``kgen.plan.choose_plans``);
`kgen explain` prints its estimates next to the measured times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .buffer import flat_buffer, product_slice_dim
from .families.base import ATEN_RELAYOUT_SHARE, DTYPE_BYTES, Work, value_bytes
from .ir import Matmul
from .ops import FUSED
from .stage import Stage
from .target import Target


def dispatch_s(w: Work, target: Target) -> float:
    """The host's time to issue ``w``: its kernel launches and library calls (what a CUDA-graph replay saves)."""
    return w.launches * target.launch_s + w.calls * w.call_s


def work_s(w: Work, target: Target) -> float:
    rate = w.flop_rate or target.fp32_flops
    return (dispatch_s(w, target) + w.latency_s
            + max(w.flops / rate, w.bytes / (target.dram_bytes_per_s * w.bandwidth_share)))


@dataclass
class StageEstimate:
    stage: Stage
    work: list[Work]
    ms: float

    @property
    def flops(self) -> float:
        return sum(w.flops for w in self.work)

    @property
    def bytes(self) -> float:
        return sum(w.bytes for w in self.work)

    @property
    def launches(self) -> int:
        return sum(w.launches for w in self.work)


def estimate(plan, batch: int) -> list[StageEstimate]:
    """Per stage of ``plan`` (a kgen.plan.Plan) at ``batch``: its work and estimated time.
    A stage another one runs as its epilogue costs nothing of its own."""
    out = []
    for st in plan.stages:
        if getattr(st, "absorbed_by", None) is not None:
            continue
        work = (st.family.work(st, batch, plan.target) + relayout_copies(plan, st, batch) + operand_reads(plan, st, batch)
                + product_view_copies(plan, st, batch))
        out.append(StageEstimate(st, work, 1e3 * sum(work_s(w, plan.target) for w in work)))
    return out


def relayout_copies(plan, st: Stage, batch: int) -> list[Work]:
    """The copies a generated stage's binding makes of the tensors it reads as plain NC[D]HW ones (a value
    operand, or the value it starts from: `.contiguous()`) where the stage that wrote one left it channels_last;
    for an ATen op's stage (a cat), the transposing copy its kernel makes of such an operand instead."""
    exprs = getattr(plan, "value_exprs", None)
    if not exprs or not (st.family.generates_kernel or st.family.name == "aten"):
        return []
    read = [exprs[n] for n in plan.stage_values(st) if n in exprs]
    if st.ops and st.ops[0].src is not None:
        read.append(st.source)
    out = []
    for tensor in read:
        src = plan.writer_of(tensor)
        if src is not None and src.output is not None and not src.output.flat and not src.hands_on_view:
            # (a view is made only where every reader reads it in place: plan._views_read_in_place)
            what = ("copied into a plain tensor" if st.family.generates_kernel
                    else f"read channels_last by ATen's {st.ops[0].op_name}")
            out.append(Work(f"{tensor} {what}", 0,
                            2 * value_bytes(src) * batch * src.out_type.sample_numel,
                            bandwidth_share=ATEN_RELAYOUT_SHARE))
    return out


def product_view_copies(plan, st: Stage, batch: int) -> list[Work]:
    """The copies ATen's matmul makes of the views an ATen product stage is handed (its input, its operand) that
    cuBLAS's batched product cannot take as they are (Buffer.batched_matrices): a permute that interleaves the
    batch dims. torch.profiler of Mamba2 (KernelBench level 3, 48) on an H200: 17 such copies, 2.07 ms of its
    6.7 (2026-12-05, 37694e5), which the views read in place had priced at nothing. At the DRAM rate, as the eager
    candidate prices its permutes (kgen.families.eager): the same copy kernel, the last dim kept."""
    if st.family.name != "linear_aten":
        return []
    given = plan.view_values()
    product = next((op for op in st.ops if isinstance(op, Matmul) and op.tensor), None)
    if product is not None and st.input.addressable:  # a batched product of two values: sliced where that saves copies
        w = (given.get(product.tensor) or flat_buffer(plan.pipeline.values[product.tensor])).sizes_and_strides(batch)
        if product.transpose:
            w[-2:] = w[-1:-3:-1]
        d = product_slice_dim(st.input.sizes_and_strides(batch), w, value_bytes(st))
        if d is not None:  # kgen::matmul's bmm per index of dim d on the views
            n = st.input.tiles[0].dims[d - 1]
            return [Work(f"{product.tensor} multiplied in {n} slices of dim {d} (no copies)", 0, 0, launches=n - 1)]
    views = [("its input", st.input)] if not st.input.flat else []
    views += [(n, given[n]) for n in plan.stage_values(st) if n in given]
    return [Work(f"{what} copied by ATen's matmul", 0, 2 * value_bytes(st) * batch * math.prod(buf.logical))
            for what, buf in views if not buf.batched_matrices]


def operand_reads(plan, st: Stage, batch: int) -> list[Work]:
    """The tensors a fused stage's elementwise ops read beside its input (``tensor:`` operands not held in a
    register): each read once by its kernel (a families' own work counts the stage's input and output only;
    level 2 #26's add of a second input of the output's size went unpriced)."""
    values = getattr(plan, "pipeline", None) and plan.pipeline.values
    if not values or st.family.name not in FUSED:
        return []
    return [Work(f"{n} read", 0, value_bytes(st) * batch * values[n].sample_numel, launches=0)
            for n in st.operand_values() if n in values]


def estimate_ms(plan, batch: int) -> float:
    return sum(e.ms for e in estimate(plan, batch))


def exposed_dispatch_s(plan, batch: int) -> float:
    """The host's dispatch of a call of ``plan`` at ``batch`` that the GPU waits for when the call launches its
    kernels one by one: the host issues each work item (its launches and library calls: a cuDNN convolution's
    call costs the host tens of microseconds, a generated kernel's launch a few) in plan order while the GPU runs
    those issued before it, so the dispatch adds to the call only where the host falls behind (the first item's
    always does). What a CUDA-graph replay of the call can save: many short kernels, not a few long ones."""
    t = plan.target
    issued = finished = busy = 0.0
    for w in (w for e in estimate(plan, batch) for w in e.work):
        issue = dispatch_s(w, t)
        run = work_s(w, t) - issue
        issued += issue
        finished = max(finished, issued) + run
        busy += run
    return finished - busy


def replay_terms(plan, batch: int) -> tuple[float, int]:
    """(the host's dispatch the GPU waits for, in seconds; bytes of the op's arguments) of a call of ``plan`` at
    ``batch``: what decides whether the module replays its kernels as one CUDA graph (kgen.runtime.replay_pays)."""
    return exposed_dispatch_s(plan, batch), argument_bytes(plan.original, batch)


def argument_bytes(pipe, batch: int) -> int:
    """Bytes of a call's inputs, outputs, parameters and running statistics at ``batch`` (what a CUDA-graph
    replay copies at most: kgen.runtime.replay_pays)."""
    values = [math.prod(pipe.inputs[n].concrete(batch)) for n in pipe.input_names] if pipe.inputs else \
        [math.prod(pipe.input.concrete(batch))]
    values += [math.prod(t.concrete(batch)) for t in pipe.output_types]
    values += [math.prod(t.shape) for t in (*pipe.tensor_args(), *pipe.buffer_args())]
    return DTYPE_BYTES[pipe.dtype] * sum(values)
