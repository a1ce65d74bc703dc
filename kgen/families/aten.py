"""The aten family: one op run by its ATen function, in a stage of its own.

The first home of ops no generated kernel computes yet: batch_norm (batch
statistics and the running-statistics update in training mode, running
statistics in eval mode), views (reshape) and dropout (the identity, refused in
training mode with p > 0), the ops that move or resample values (cat, permute and
transpose, slice, pad, expand, interpolate, adaptive pools to sizes other than 1) and cumsum; layer_norm where the layer_norm family declines it
(rows too long for its registers) and logsumexp over dims that are not
consecutive (the softmax family's axis); and the other candidate of a stage of
a layer_norm, softmax, log_softmax or logsumexp alone.
Each is PyTorch's own computation, so its numerics are PyTorch's. The next
fused stage reads its contiguous output; a permute, slice or expand whose every
reader reads views (``Family.reads_views``, ``plan._views_read_in_place``) hands
on ATen's view instead, read in place: the stage copies nothing. Templates:
``templates/aten/``.
"""
from __future__ import annotations

from dataclasses import replace

from ..buffer import Buffer, expanded_buffer, flat_buffer, permuted_buffer, sliced_buffer
from ..ir import Cat, Expand, Permute, Reduce, Reshape, Slice
from ..spec import DTYPES
from ..stage import Stage
from .base import Family, StageRequest, Work, value_bytes
from .eager import aten_only_headers


class Aten(Family):
    name = "aten"
    stage_kind = "aten"
    generates_kernel = False
    pieces = ("binding.cpp",)
    summary = ("one op by its ATen function (batch/layer norm, views, dropout, cat, permute, slice, pad, interpolate, "
               "adaptive pools, cumsum; softmax and logsumexp alone)")
    dtypes = DTYPES  # ATen's function computes each
    reads_views = True  # ATen's functions take any strides (a cat of a permuted value copies it once, into the cat)
    reads_view_operands = True

    def fits(self, ops):  # not a global pool: a reduction the fused families compute
        return len(ops) == 1 and not (isinstance(ops[0], Reduce) and ops[0].origin)

    def make_stage(self, req: StageRequest) -> Stage:
        t_in, t_out = req.types
        return Stage(req.index, list(req.ops), t_in, t_out, input=req.input, output=flat_buffer(t_out))

    def view_output(self, st: Stage) -> Buffer | None:
        """A permute, expand or slice of a tensor one tile holds (a plain tensor, or a view of one), as the view
        ATen makes of it (nothing copied)."""
        op = st.ops[0] if len(st.ops) == 1 else None
        if not st.input.addressable or st.in_type.rank < 3:
            return None
        if isinstance(op, Permute):
            return permuted_buffer(st.input, op.dims)
        if isinstance(op, Expand) and op.param is None:
            return expanded_buffer(st.input, tuple(st.out_type.shape[1:]))
        if isinstance(op, Slice):
            return sliced_buffer(st.input, op.dim, op.start, op.end, op.step)
        return None

    def work(self, st: Stage, batch: int, target) -> list[Work]:
        """A reshape of a plain contiguous tensor is a view (the stage's ``contiguous()`` copies nothing), and so
        is a permute, slice or expand its readers read in place (``view_output``): no pass; any other op reads its
        input and writes its output once."""
        if isinstance(st.ops[0], Reshape) and st.input.flat or not st.output.flat:
            return [Work(f"{st.ops[0].key} (a view)", 0, 0, launches=0)]
        op = st.ops[0]
        if st.in_place:  # a cat whose operands' stages wrote some in place: it copies the others into their slices
            copied = [t for pos, t in enumerate((st.in_type, *op.pieces)) if pos not in st.in_place]
            return [Work(f"{op.key}: {len(copied)} operand(s) copied into their slices", 0,
                         2 * value_bytes(st) * batch * sum(t.sample_numel for t in copied), launches=len(copied))]
        (one,) = super().work(st, batch, target)
        if isinstance(op, Cat):  # (its other pieces are read too)
            return [replace(one, bytes=one.bytes + value_bytes(st) * batch * sum(t.sample_numel for t in op.pieces))]
        return [one]

    def explain_lines(self, st: Stage) -> list[str]:
        if st.output.flat:
            return []
        t = st.output.tiles[0]
        return [f"ATen's view of its input ({st.output.layout}, strides {', '.join(map(str, t.strides))} over "
                f"[{', '.join(map(str, t.dims))}]): nothing copied, its readers read it in place"]

    def binding_includes(self, st: Stage) -> list[str]:
        return aten_only_headers(st.ops[0]) if st.ops else []


FAMILY = Aten()
