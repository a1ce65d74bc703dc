"""linear_gemm: a matrix product (nn.Linear, matmul with a parameter) generated for Hopper's
warpgroup MMAs, with the next stage's elementwise ops as its epilogue: float32 in split TF32,
fp32-accurate as PyTorch's fp32 matmul is; bfloat16 and float16 on the 16-bit tensor cores with fp32
accumulation, as eager's cuBLAS call.

The kernel is ``templates/linear_gemm/gemm3xtf32.cuh`` (TMA into a 3-stage ring, two consumer
warpgroups of m64n128k8, each k-block's three products promoted into an fp32 total on the CUDA
cores: the tensor cores' own accumulation truncates). The weight is split into TF32 hi and lo planes
once per parameter version (kgen::WeightCache), the input once per call. Measured in lab gemm_lab
(docs/performance.md): 1.8-2.5x cuBLAS's fp32 SGEMM on the H100, at 0.16-0.25x its error against
float64.

16-bit plans: the same kernel with the operand type as a template parameter (``gemm16``): TMA reads x and W
as stored (no split, no workspace, no fixup: 16-bit operands multiply as IEEE products), wgmma m64n128k16, a
6-stage ring, the same per-k-block promotion into an fp32 total; + bias in fp32, the product rounded to the
dtype where the plan rounds it (kgen.plan.rounding_points, as cuBLAS's 16-bit output is), then the epilogue.
TMA needs 16-byte rows, so a K that is not a multiple of 8 keeps ATen's product (the family declines it).

Epilogue: a ``pool_reduce`` stage right after the product with no pools and no reduction (elementwise
ops on each output, values named in the same stage kept in registers) runs on each output value; the
product is never written. Input: a plain [N, ..., K] tensor, its rows (all but the last dim) the GEMM's M.
On the CPU the stage runs ATen's
product, then the epilogue stage's own C++ code. Templates: ``templates/linear_gemm/``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..buffer import flat_buffer
from ..ir import Linear, Matmul
from ..spec import DTYPES
from ..stage import Stage
from ..target import Target
from .base import DTYPE_BYTES, FLOAT_BYTES, Family, StageRequest, Work

# The split-TF32 kernel's useful rate as a fraction of the target's TF32 rate: 101-127 TFLOP/s of
# fp32 products at M >= 1024 on the H100 (run 4 of lab gemm_lab, docs/performance.md) against tensor_flops 400e12.
GEMM3_FRACTION = 0.28
MIN_K = 16  # below this the product is cheaper than the split (and the lab's error check only held from K = 32)
# The weight's TF32 planes stay allocated while the weight does (2x its bytes, kgen::WeightCache); cuBLAS
# needs nothing: beyond this share of the device's memory the product stays ATen's.
PLANES_MEMORY_SHARE = 0.25
# The 16-bit kernel's useful rate as a fraction of the target's 16-bit tensor rate: assumed, not measured yet
# (below linear_aten's CUBLAS_HALF_FRACTION: one product per k-block leaves its wait and promotion adds less
# MMA work to hide behind than split TF32's three).
GEMM16_FRACTION = 0.45
ROW_ALIGN_BYTES = 16  # TMA reads rows whose length is a multiple of 16 bytes


def padded_k(k: int) -> int:
    """K padded to whole 16-byte rows: the planes' row length (TMA)."""
    return (k + 3) // 4 * 4


@dataclass
class LinearStage(Stage):
    """A matrix product y = x W^T (+ b) with W [N, K] as the kernel reads it; ``epilogue``: the next
    stage, applied to each output value (the product is then not written)."""

    epilogue: Stage | None = None

    @property
    def product(self):
        return self.ops[0]

    @property
    def rows_per_sample(self) -> int:
        """GEMM rows of one sample: the product of the input's dims between the batch and K."""
        return math.prod(self.in_type.shape[1:-1])

    @property
    def row_dims(self) -> tuple:
        """Sizes of a sample's row dims (the input's dims between the batch and K)."""
        return tuple(self.in_type.shape[1:-1])

    @property
    def k(self) -> int:
        return self.in_type.shape[-1]

    @property
    def n(self) -> int:
        return self.out_type.shape[-1]

    @property
    def kp(self) -> int:
        return padded_k(self.k)

    @property
    def weight_transposed(self) -> bool:
        """Whether the kernel's [N, K] rows are the parameter transposed (a matmul operand [K, N])."""
        p = self.product
        return not (isinstance(p, Linear) or p.transpose)

    @property
    def weight_name(self) -> str:
        p = self.product
        return f"{p.module}.weight" if isinstance(p, Linear) else p.param

    @property
    def bias_name(self) -> str | None:
        p = self.product
        return f"{p.module}.bias" if isinstance(p, Linear) and p.bias else None

    def weight_nk(self, ident: str) -> str:
        """C++: the weight as [N, K] rows from the parameter ``ident`` (a matmul operand [K, N] transposed)."""
        return f"{ident}.t().contiguous()" if self.weight_transposed else ident


class LinearGemm(Family):
    name = "linear_gemm"
    stage_kind = "linear"
    generates_kernel = True
    pieces = ("stage.h", "kernel.cu", "binding.cpp")
    cuda_includes = ("linear_gemm/gemm3xtf32.cuh",)
    summary = ("matrix product on Hopper's tensor cores (float32: split TF32, fp32-accurate; 16-bit: bf16/fp16 MMAs, fp32 "
               "accumulation), elementwise epilogue")
    dtypes = DTYPES

    def fits(self, ops):
        return len(ops) == 1 and (isinstance(ops[0], Linear) or (isinstance(ops[0], Matmul) and ops[0].param is not None))

    def unsupported(self, req: StageRequest) -> str | None:
        t_in = req.types[0]
        if req.pipeline.linear_impl == "aten":
            return "the spec asks for ATen's product (plan.linear: aten)"
        if not req.target.wgmma:
            return "the target has no warpgroup MMA (Hopper's sm_90a)"
        if not req.input.flat:
            return "its input is not a plain tensor"
        if t_in.shape[-1] < MIN_K:
            return f"K = {t_in.shape[-1]} < {MIN_K}"
        k, n = t_in.shape[-1], req.types[1].shape[-1]
        if req.dtype != "float32":
            size = DTYPE_BYTES[req.dtype]
            if k * size % ROW_ALIGN_BYTES:  # (padding x per call would cost a copy; ATen's product takes it as it is)
                return f"K = {k} is not a multiple of {ROW_ALIGN_BYTES // size}: TMA reads whole {ROW_ALIGN_BYTES}-byte rows of {req.dtype}"
            p = req.ops[0]
            kept = size * n * k if isinstance(p, Matmul) and not p.transpose else 0  # a [K, N] operand's rows, kept
            what = "the weight's transposed copy"
        else:
            kept, what = 2 * FLOAT_BYTES * n * padded_k(k), "the weight's TF32 planes"
        if kept > PLANES_MEMORY_SHARE * req.target.memory_bytes:
            return (f"{what} ({kept / 1e9:.1f} GB, kept beside it) would take more than "
                    f"{PLANES_MEMORY_SHARE:.0%} of the device's {req.target.memory_bytes / 1e9:.0f} GB")
        return None

    def make_stage(self, req: StageRequest) -> LinearStage:
        t_in, t_out = req.types
        return LinearStage(req.index, list(req.ops), t_in, t_out, input=req.input, output=flat_buffer(t_out))

    def absorbs_epilogue(self, st: Stage, nxt: Stage) -> bool:
        """A pool_reduce stage of elementwise ops only (no pools, no reduction) over the product's output."""
        return (nxt.family.name == "pool_reduce" and len(nxt.levels) == 1 and nxt.reduce is None
                and nxt.input.flat and nxt.in_type == st.out_type)

    def work(self, st: LinearStage, batch: int, target: Target) -> list[Work]:
        m = batch * st.rows_per_sample
        flops = 2 * m * st.n * st.k
        if st.epilogue is not None:
            flops += batch * sum(op.flops(st.epilogue.in_type, st.epilogue.out_type) for op in st.epilogue.ops)
        if st.dtype != "float32":  # x and W read as stored, the output written once: one launch
            size = DTYPE_BYTES[st.dtype]
            return [Work(f"{st.dtype} GEMM", flops, size * (m * st.k + st.n * st.k + m * st.n),
                         target.product_flops(st.dtype) * GEMM16_FRACTION)]
        split = FLOAT_BYTES * 3 * m * st.k  # read x, write its hi and lo planes
        gemm = FLOAT_BYTES * (2 * m * st.kp + 2 * st.n * st.kp + m * st.n)
        # launches: the row flags' memset and the split; the GEMM and the fp32 pass over flagged rows
        return [Work("input split", 0, split, launches=2),
                Work("split-TF32 GEMM", flops, gemm, target.tensor_flops * GEMM3_FRACTION, launches=2)]

    def explain_lines(self, st: LinearStage) -> list[str]:
        e = f"; stage {st.epilogue.index}'s elementwise ops as its epilogue (the product is not written)" if st.epilogue else ""
        m = "batch" if st.rows_per_sample == 1 else f"batch * {st.rows_per_sample}"
        if st.dtype != "float32":
            kept = "; the weight's [N, K] rows kept per parameter version" if st.weight_transposed else ""
            return [f"{st.dtype} wgmma GEMM (m64n128k16, fp32 accumulation), M = {m} x N = {st.n} x K = {st.k}, 128 x 128 "
                    f"tiles, x and W read as stored{kept}{e}"]
        return [f"split-TF32 wgmma GEMM, M = {m} x N = {st.n} x K = {st.k}, 128 x 128 tiles; the weight's TF32 planes kept "
                f"per parameter version{e}"]

    def stage_json(self, st: LinearStage) -> dict:
        return dict(n=st.n, k=st.k, kp=st.kp, epilogue_stage=st.epilogue.index if st.epilogue else None)


FAMILY = LinearGemm()
