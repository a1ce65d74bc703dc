"""The device a plan is made for: the facts its schedules and the cost model depend on.

Read from the current CUDA device when there is one, else the default target
(an H100 SXM: 132 SMs, 2048 resident threads per SM). ``KGEN_TARGET=default``
forces the default, so that rendering gives the committed ``generated/`` files
on any machine. The plan records its target in ``plan.json``.

The target's ``name`` is the CUDA device name: a tuning file's choices apply to
the target of the same name (``kgen.tunefile``). The default target is the H100
the committed tuning files were measured on, so rendering on a CPU-only machine
uses them too. The ceilings (tensor-core FLOP/s, DRAM bandwidth, the cost of a
launch) are the H100's; another device gets them as well (the cost model is
calibrated on the H100 only).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .errors import KgenError

H100_NAME = "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name() of an H100 SXM


@dataclass(frozen=True)
class Target:
    sm_count: int = 132
    max_threads_per_sm: int = 2048
    max_grid_y: int = 65535  # CUDA's limit on gridDim.y (a split reduction's blocks)
    name: str = H100_NAME
    tensor_flops: float = 400e12  # TF32 tensor cores (dense)
    half_tensor_flops: float = 790e12  # bfloat16/float16 tensor cores (dense, fp32 accumulation; measured on the H200)
    fp32_flops: float = 67e12  # FP32 on the CUDA cores (elementwise math, window pools)
    dram_bytes_per_s: float = 3.0e12  # HBM3
    launch_s: float = 4e-6  # one kernel launch from a host op: a few microseconds of dispatch
    wgmma: bool = True  # Hopper's warpgroup MMA (sm_90a): conv_gemm's wgmma main loop
    memory_bytes: int = 85_000_000_000  # device memory (an H100 80GB: 79.2 GiB)

    def product_flops(self, dtype: str) -> float:
        """The tensor cores' rate for products of ``dtype`` operands: TF32's for float32, else the 16-bit one."""
        return self.tensor_flops if dtype == "float32" else self.half_tensor_flops

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
    return replace(DEFAULT, sm_count=props.multi_processor_count,
                   max_threads_per_sm=props.max_threads_per_multi_processor, name=props.name,
                   wgmma=props.major == 9, memory_bytes=props.total_memory)
