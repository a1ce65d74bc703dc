"""The device a plan is made for: the facts its schedules and the cost model depend on.

Read from the current CUDA device when there is one, else the default target:
the H200 kgen is measured on now (``KGEN_TARGET=default`` forces it, so that
rendering gives the committed ``generated/`` files on any machine). The plan
records its target in ``plan.json``.

The target's ``name`` is the CUDA device name: a tuning file's choices apply to
the target of the same name (``kgen.tunefile``), so rendering on a CPU-only
machine uses the committed H200 entries. The ceilings (tensor-core FLOP/s,
DRAM bandwidth, the cost of a launch) are per device, in ``KNOWN`` by name;
the SM count, resident threads and memory come from the device itself. A device
not in ``KNOWN`` gets the default's ceilings, and its target says so
(``ceilings_of``): the cost model was not calibrated on it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .errors import KgenError

H100_NAME = "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name() of an H100 SXM
H200_NAME = "NVIDIA H200"  # torch.cuda.get_device_name() of an H200 (SXM)


@dataclass(frozen=True)
class Target:
    """A device's facts. The field defaults are the H200's (``DEFAULT``)."""
    sm_count: int = 132
    max_threads_per_sm: int = 2048
    max_grid_y: int = 65535  # CUDA's limit on gridDim.y (a split reduction's blocks)
    name: str = H200_NAME
    tensor_flops: float = 400e12  # TF32 tensor cores (dense)
    half_tensor_flops: float = 790e12  # bfloat16/float16 tensor cores (dense, fp32 accumulation; measured on the H200)
    fp32_flops: float = 67e12  # FP32 on the CUDA cores (elementwise math, window pools)
    dram_bytes_per_s: float = 4.3e12  # HBM3e: the H200's measured copy rate (its datasheet says 4.8)
    launch_s: float = 4e-6  # one kernel launch from a host op: a few microseconds of dispatch
    wgmma: bool = True  # Hopper's warpgroup MMA (sm_90a): conv_gemm's wgmma main loop
    # device memory: the H200's 141 GB as decimal bytes (the datasheet's figure; what torch reports as its
    # total_memory is not recorded in the repository); a device's own comes from its properties (current())
    memory_bytes: int = 141_000_000_000
    ceilings_of: str | None = None  # the device whose ceilings these are, where not this one's own (not measured here)

    def product_flops(self, dtype: str) -> float:
        """The tensor cores' rate for products of ``dtype`` operands: TF32's for float32, else the 16-bit one."""
        return self.tensor_flops if dtype == "float32" else self.half_tensor_flops

    @property
    def resident_threads(self) -> int:
        """Threads the device holds at once."""
        return self.sm_count * self.max_threads_per_sm

    def described(self) -> str:
        """The target's name, and whose ceilings the cost model uses where they were not measured on it."""
        if self.ceilings_of is None:
            return self.name
        return f"{self.name} (ceilings of the {self.ceilings_of}: not measured on this device)"


H200 = Target()
# The H100 SXM kgen was measured on until 2026-11-28: the same compute, slower and smaller memory.
H100 = replace(H200, name=H100_NAME, dram_bytes_per_s=3.0e12,  # HBM3
               memory_bytes=85_000_000_000)  # torch's total_memory of an H100 80GB: 79.2 GiB
KNOWN = {t.name: t for t in (H100, H200)}  # the devices whose ceilings were measured, by CUDA device name
DEFAULT = H200  # the machine kgen is measured on now


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
    known = KNOWN.get(props.name)
    return replace(known or DEFAULT, sm_count=props.multi_processor_count,
                   max_threads_per_sm=props.max_threads_per_multi_processor, name=props.name,
                   wgmma=props.major == 9, memory_bytes=props.total_memory,
                   ceilings_of=None if known else DEFAULT.name)
