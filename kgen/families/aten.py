"""The aten family: one op run by its ATen function, in a stage of its own.

The first home of ops no generated kernel computes yet: batch_norm (batch
statistics and the running-statistics update in training mode, running
statistics in eval mode) and its batch statistics alone (batch_stats: ATen's
var_mean, one pass over its input, whose tensors the stages after it apply), views (reshape) and dropout (the identity, refused in
training mode with p > 0); layer_norm where the layer_norm family declines it
(rows too long for its registers) and logsumexp over dims that are not
consecutive (the softmax family's axis); and the other candidate of a stage of
a layer_norm, softmax, log_softmax or logsumexp alone.
Each is PyTorch's own computation, so its numerics are PyTorch's. The next
fused stage reads its contiguous output. Templates: ``templates/aten/``.
"""
from __future__ import annotations

from ..ir import BatchStats
from ..stage import Stage, flat_buffer
from ..target import Target
from .base import Family, StageRequest, Work

# batch_stats: var_mean, the scale (add, sqrt, div) and, in training mode, the running statistics'
# update (mul_, add_ for each of the two, the variance's correction): ATen calls of C values each
BATCH_STATS_SMALL_CALLS = 8


class Aten(Family):
    name = "aten"
    stage_kind = "aten"
    generates_kernel = False
    pieces = ("binding.cpp",)
    summary = "one op by its ATen function (batch/layer norm, views, dropout; softmax and logsumexp alone)"

    def fits(self, ops):
        return len(ops) == 1

    def work(self, stage: Stage, batch: int, target: Target) -> list[Work]:
        """batch_stats reads its input once and writes nothing (its output is its input); the
        other ops as the default: one pass over the input, one over the output."""
        if isinstance(stage.ops[0], BatchStats):
            return [Work("batch statistics", 0, self.read_bytes(stage, batch), launches=1 + BATCH_STATS_SMALL_CALLS)]
        return super().work(stage, batch, target)

    def make_stage(self, req: StageRequest) -> Stage:
        t_in, t_out = req.types
        return Stage(req.index, list(req.ops), t_in, t_out, input=req.input, output=flat_buffer(t_out))


FAMILY = Aten()
