"""The device a plan is made for: the facts its schedules depend on.

Read from the current CUDA device when there is one, else the default target
(an H100 SXM: 132 SMs, 2048 resident threads per SM). ``KGEN_TARGET=default``
forces the default, so that rendering gives the committed ``generated/`` files
on any machine. The plan records its target in ``plan.json``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import KgenError


@dataclass(frozen=True)
class Target:
    sm_count: int = 132
    max_threads_per_sm: int = 2048
    max_grid_y: int = 65535  # CUDA's limit on gridDim.y (a split reduction's blocks)

    @property
    def resident_threads(self) -> int:
        """Threads the device holds at once."""
        return self.sm_count * self.max_threads_per_sm


DEFAULT = Target()


def current() -> Target:
    """The current CUDA device's target, or the default without one (or with KGEN_TARGET=default)."""
    forced = os.environ.get("KGEN_TARGET", "")
    if forced not in ("", "default", "device"):
        raise KgenError(f"KGEN_TARGET must be 'default' or 'device', got {forced!r}")
    if forced == "default":
        return DEFAULT
    import torch

    if not torch.cuda.is_available():
        return DEFAULT
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Target(sm_count=props.multi_processor_count, max_threads_per_sm=props.max_threads_per_multi_processor)
