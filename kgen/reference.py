"""The reference model of a spec: the spec's ops as an ``nn.Module``.

Its submodules and parameters have the names, shapes and default
initialization a hand-written model would have (``nn.Conv3d`` as ``conv``, a
free parameter as a direct attribute), created in the order of first use, so
with the same seed it initializes exactly like the hand-written model and
``state_dict``s load both ways.
"""
from __future__ import annotations

import torch
from torch import nn

from .ir import Conv, Pipeline

PARAM_INIT = {"randn": torch.randn, "ones": torch.ones, "zeros": torch.zeros}


def make_submodule(op, rank: int) -> nn.Module:
    cls, kwargs = op.module_ctor() if isinstance(op, Conv) else op.module_ctor(rank)
    return getattr(nn, cls)(**kwargs)


def init_reference_members(module: nn.Module, pipeline: Pipeline) -> None:
    """Create the submodules and free parameters of ``pipeline`` on ``module``."""
    rank = len(pipeline.input.spatial)
    for kind, item in pipeline.creation_order():
        if kind == "module":
            setattr(module, item.module, make_submodule(item, rank))
        else:
            setattr(module, item.name, nn.Parameter(PARAM_INIT[item.init](*item.shape)))


class ReferenceModel(nn.Module):
    """Eager PyTorch semantics of a pipeline (run it in float64 for validation)."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self.pipeline = pipeline
        init_reference_members(self, pipeline)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pipeline.run(x, dict(self.named_parameters()))
