"""The linear_aten family: a matrix product (nn.Linear, torch.matmul with a parameter or a
batched operand) run by ATen, i.e. cuBLAS on the GPU, in full fp32 as PyTorch's default
(``torch.backends.cuda.matmul.allow_tf32 = False``) computes it, whatever the process
has set. A product whose outputs are only summed in windows (lowering.PooledProduct) runs with its
weight's window sums, derived once per parameter version. It takes a permute's, slice's or expand's view
as it is (its input or its operand); the next fused stage reads its contiguous output. Templates:
``templates/linear_aten/``.
"""
from __future__ import annotations

from dataclasses import replace

from ..buffer import flat_buffer
from ..ir import Linear, Matmul
from ..lowering import PooledProduct
from ..spec import DTYPES
from ..stage import Stage
from ..target import Target
from .base import Family, StageRequest, Work

# of the 16-bit tensor-core peak, cuBLAS's bfloat16/float16 products (assumed, as cuDNN's CUDNN_FRACTION of TF32's;
# not measured yet)
CUBLAS_HALF_FRACTION = 0.53


class LinearAten(Family):
    name = "linear_aten"
    stage_kind = "linear"
    generates_kernel = False
    pieces = ("binding.cpp",)
    summary = "ATen/cuBLAS matrix product (nn.Linear, matmul) in full fp32"
    dtypes = DTYPES  # cuBLAS computes each (16-bit: as eager's call)
    # at::matmul takes a view as it is (cuBLAS's transposed forms; eager's `x.transpose(1, 2) @ y` passes the view too)
    reads_views = True
    reads_view_operands = True

    def fits(self, ops):
        return len(ops) == 1 and isinstance(ops[0], (Linear, Matmul, PooledProduct))

    def unsupported(self, req: StageRequest) -> str | None:
        if req.pipeline.linear_impl == "gemm" and not isinstance(req.ops[0], PooledProduct):  # (linear_gemm has no pooled form)
            return "the spec asks for the generated product (plan.linear: gemm)"
        if req.dtype != "float32" and isinstance(req.ops[0], PooledProduct):
            return f"no {req.dtype} form of the pooled product yet"
        return None

    def make_stage(self, req: StageRequest) -> Stage:
        t_in, t_out = req.types
        return Stage(req.index, list(req.ops), t_in, t_out, input=req.input, output=flat_buffer(t_out))

    def work(self, st: Stage, batch: int, target: Target) -> list[Work]:
        """float32: one pass at the CUDA cores' fp32 rate (cuBLAS in full fp32); 16-bit: on the 16-bit tensor cores."""
        return [half_product(w, st, target) for w in super().work(st, batch, target)]


def half_product(w: Work, st: Stage, target: Target) -> Work:
    """``w``, a cuBLAS product's work, at the 16-bit tensor cores' rate where ``st`` computes 16 bits."""
    if st.dtype == "float32":
        return w
    return replace(w, flop_rate=target.product_flops(st.dtype) * CUBLAS_HALF_FRACTION)


FAMILY = LinearAten()
