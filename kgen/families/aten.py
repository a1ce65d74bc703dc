"""The aten family: one op run by its ATen function, in a stage of its own.

The first home of ops no generated kernel computes yet: softmax and
log_softmax, logsumexp, batch_norm (batch statistics and the running-statistics
update in training mode, running statistics in eval mode), views (reshape) and
dropout (the identity, refused in training mode with p > 0); and layer_norm
where the layer_norm family declines it (rows too long for its registers), or
as the other candidate of a layer_norm stage of its own.
Each is PyTorch's own computation, so its numerics are PyTorch's. The next
fused stage reads its contiguous output. Templates: ``templates/aten/``.
"""
from __future__ import annotations

from ..stage import Stage, flat_buffer
from .base import Family, StageRequest


class Aten(Family):
    name = "aten"
    stage_kind = "aten"
    generates_kernel = False
    pieces = ("binding.cpp",)
    summary = "one op by its ATen function (softmax, logsumexp, batch/layer norm, views, dropout)"

    def fits(self, ops):
        return len(ops) == 1

    def make_stage(self, req: StageRequest) -> Stage:
        t_in, t_out = req.types
        return Stage(req.index, list(req.ops), t_in, t_out, input=req.input, output=flat_buffer(t_out))


FAMILY = Aten()
