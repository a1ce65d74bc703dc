"""What a template family is, and the schedule helpers the families share.

A family computes one kind of stage. It declares:

- which op sequences it can absorb into one stage (``accepts``): every op's
  op-table entry must list the family, and the sequence must fit the family's
  pattern (``fits``);
- its stage type and how a stage is made, with its schedule, at plan time
  (``make_stage``); every tunable number is a field of the stage's schedule;
- its templates: ``templates/<name>/<piece>.j2`` for each generated file it
  contributes to (``pieces``). ``binding.cpp.j2`` defines the macros
  ``host(st)`` (code before ``forward``, e.g. the stage's own op) and
  ``call(st)`` (the stage's lines in ``forward``, defining ``t<index>``);
  a family that generates kernels also renders ``stage.h`` (the math),
  ``kernel.cu`` (CUDA schedule) and ``kernel_cpu.cpp`` (C++ schedule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..ir import Op, Pipeline, TensorType
from ..ops import OPS
from ..stage import Buffer, Stage
from ..target import Target


@dataclass
class StageRequest:
    """What the planner hands a family to make a stage of."""

    index: int
    ops: list[Op]
    types: tuple[TensorType, ...]  # types[i] is ops[i]'s input; types[-1] the stage's output
    input: Buffer  # what the stage reads
    next_family: "Family | None"  # the family of the stage after it
    pipeline: Pipeline  # rewritten
    target: Target
    batch: int  # the example batch (schedules that depend on the batch count on it)


class Family:
    name: ClassVar[str]
    stage_kind: ClassVar[str]  # what its stages compute ("conv"): peers share it
    generates_kernel: ClassVar[bool]  # renders kernels; its stage is also the op kgen::NAME_stageK
    reads_channels_last: ClassVar[bool] = False  # reads a channels_last input as fast as a contiguous one
    pieces: ClassVar[tuple[str, ...]]  # generated files it contributes to, from templates/<name>/<piece>.j2
    cuda_includes: ClassVar[tuple[str, ...]] = ()  # headers (under the output root) its kernel.cu piece needs
    summary: ClassVar[str]

    def accepts(self, ops: list[Op]) -> bool:
        """Whether one stage of this family can compute ``ops``."""
        return all(self.name in OPS[op.op_name].families for op in ops) and self.fits(ops)

    def fits(self, ops: list[Op]) -> bool:
        """The family's pattern over the kinds of ops (their order, how many of each)."""
        raise NotImplementedError

    def unsupported(self, req: StageRequest) -> str | None:
        """Why this family declines a request it accepts by its ops (its input buffer, the
        precision, sizes it is not made for); None when it takes it."""
        return None

    def make_stage(self, req: StageRequest) -> Stage:
        raise NotImplementedError

    def absorbs_epilogue(self, stage: Stage, nxt: Stage) -> bool:
        """Whether ``stage`` takes the next stage as its epilogue (a generated convolution may)."""
        return False

    def stage_json(self, stage: Stage) -> dict:
        """The family's fields of a stage for plan.json."""
        return {}

    def template(self, piece: str) -> str:
        return f"{self.name}/{piece}.j2"

    def __repr__(self) -> str:
        return f"<family {self.name}>"


# ---------------------------------------------------------------- shared schedule helpers


def index_type(stage: Stage) -> str:
    """int when every per-sample index of the stage fits in 32 bits (cheaper divisions), else long long."""
    sizes = [math.prod(t.dims) for t in stage.input.tiles] + [stage.in_type.sample_numel, stage.out_type.sample_numel]
    return "int" if max(sizes) < 2**31 - 1 else "long long"


def target_blocks_per_sm(target: Target, threads: int, waves: int) -> int:
    """Blocks per SM a split reduction aims for: ``waves`` times what the SM holds at once."""
    return waves * (target.max_threads_per_sm // threads)


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()
