"""The reference model of a spec: the spec's ops as an ``nn.Module``.

Its submodules and parameters have the names, shapes and default
initialization a hand-written model would have (``nn.Conv3d`` as ``conv``, a
free parameter as a direct attribute, a nested model's members at their paths
``layer1.0.conv1`` in plain ``nn.Module`` containers), created in the reference's order
(``Pipeline.members``), so with the same seed it initializes exactly like the
hand-written model and ``state_dict``s load both ways. The generated module's
``Model`` creates the same members (rendered from the same list). Batch norm
runs as ``nn.BatchNorm`` does: in training mode on batch statistics, updating
the module's running statistics.
"""
from __future__ import annotations

import torch
from torch import nn

from .ir import Member, Pipeline
from .runtime import init_members, set_member

PARAM_INIT = {"randn": torch.randn, "ones": torch.ones, "zeros": torch.zeros}


def instantiate(member: Member) -> nn.Module | nn.Parameter:
    if member.nn_class is not None:
        return getattr(nn, member.nn_class)(**dict(member.kwargs))
    (tensor,) = member.tensors
    if isinstance(member.init, str):
        return nn.Parameter(PARAM_INIT[member.init](tensor.shape))
    if tensor.shape:
        return nn.Parameter(torch.full(tensor.shape, member.init))
    return nn.Parameter(torch.tensor(member.init))


def add_members(module: nn.Module, pipeline: Pipeline) -> None:
    """Create the submodules and free parameters of ``pipeline`` on ``module``, in order
    (a nested member ``layer1.0.conv1`` with its containers), then re-initialize them as the
    spec's ``constructor.init`` says."""
    for m in pipeline.members():
        set_member(module, m.attr, instantiate(m))
    init_members(module, [(i.member, i.fn, dict(i.args)) for i in pipeline.spec.init])


class ReferenceModel(nn.Module):
    """Eager PyTorch semantics of a pipeline (run it in float64 for validation)."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self.pipeline = pipeline
        add_members(self, pipeline)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers by their state_dict names: what the pipeline's ops read."""
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        tensors = self.tensors()
        others = dict(zip(self.pipeline.input_names[1:], inputs))
        return self.pipeline.run(x, tensors, inputs=others, training=self.training)
