"""What every stage of a plan has: its ops, its types, and the buffers it reads and writes.

A stage reads a ``Buffer`` (``kgen.buffer``: the logical tensor and how it lies
in memory) and leaves one for the next stage. The
family that computes a stage (``kgen.families``) subclasses ``Stage`` with
its own fields and schedule. Everything here is static; only the batch is
known at run time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .buffer import Buffer
from .ir import Elementwise, Op, TensorType
from .lowering import LoweredConv


@dataclass(frozen=True)
class ChannelSlice:
    """Where a stage writes an output that a cat only concatenates: channels ``channel0`` on of the
    cat stage ``stage``'s output ``whole`` (an N x C x ... contiguous tensor), so the cat copies nothing."""

    stage: int
    channel0: int
    whole: TensorType

    @property
    def sample_stride(self) -> int:
        """Elements between two samples of the slice: a sample of the whole."""
        return self.whole.sample_numel


@dataclass
class Stage:
    index: int
    ops: list[Op]
    in_type: TensorType
    out_type: TensorType
    input: Buffer = None  # what it reads
    output: Buffer = None  # what the next stage reads
    # the family (implementation) that computes it, a kgen.families.base.Family; set by the plan
    # (not imported here: the families import this module)
    family: Any = None
    candidates: tuple[str, ...] = ()  # the families that could have
    choice: str = ""  # why this family
    absorbed_by: "Stage | None" = None  # the stage that runs this one as its epilogue (forward skips it)
    source: str = "x"  # the binding's tensor it reads (the previous stage's output, an input, a value)
    names: list = field(default_factory=list)  # values (``as``) that are its output, named right after it
    dtype: str = "float32"  # what it reads and writes: its plan's dtype (set by kgen.plan.Plan)
    # its ops whose output its math rounds to ``dtype`` (kgen.plan.rounding_points; set by kgen.plan.Plan)
    rounded: tuple = ()
    into: ChannelSlice | None = None  # a cat's operand: the slice of the cat's output it writes (kgen.plan)
    in_place: tuple = ()  # a cat: its operands' positions (0: the input) whose stages write them in place
    # kgen.families.base.typed_ops's last answer, with the ops and input type it was for: [(ops, type, result)],
    # one list shared by the stage's shallow copies (each plan of a search copies the stages it offers; the cost
    # model asks for every one, and a cat's type check over its pieces made planning a whole DenseNet slow)
    typed: list = field(default_factory=list, repr=False, compare=False)

    @property
    def out_sample(self) -> int:
        """Elements between two samples of the tensor the stage writes (more than one sample's where the
        stage writes a channel slice of a cat's output)."""
        return self.into.sample_stride if self.into else self.out_type.sample_numel

    @property
    def hands_on_view(self) -> bool:
        """Whether its output is a view of its input its readers read in place (a permute's, slice's or expand's:
        ``Family.view_output``, chosen by ``plan._views_read_in_place``), not a tensor it wrote."""
        return self.output is not None and not self.output.flat and self.family.view_output(self) is not None

    @property
    def kind(self) -> str:
        return self.family.stage_kind

    @property
    def keys(self) -> list[str]:
        return [o.key for o in self.ops]

    def operand_values(self) -> list[str]:
        """The values (inputs, named results) its elementwise ops read from memory beside its input: ``tensor:``
        operands not held in a register, each once, in op order."""
        return list(dict.fromkeys(op.tensor for op in self.ops
                                  if isinstance(op, Elementwise) and op.tensor and not op.register))

    def tensor_names(self) -> list[str]:
        names = []
        for op in self.ops:
            for n in op.tensor_names():
                if n not in names:
                    names.append(n)
        return names


@dataclass
class ConvStage(Stage):
    """A convolution, whatever implements it. The implementation fills in how it
    lies in memory; an implementation that generates the convolution may absorb
    the next stage as its ``epilogue`` (applied to its output tile). The
    absorbed stage stays in the plan (its math, its own op and its CPU code are
    still rendered; forward runs it through the convolution)."""

    conv: LoweredConv = None
    layout: str = "contiguous"  # memory format of the output
    input_extent: tuple = ()  # prefix of the input that is read (dead region)
    phases: list = field(default_factory=list)  # SubpixelPhase, for a sub-pixel lowering
    epilogue: Stage | None = None
    fp32_products: str = ""  # ATen's convolution: why it runs with TF32 off ("": the spec's precision)
    # ATen's convolution as eager calls it, whose call `kgen tune` measured running cuDNN's fp32 kernels with TF32
    # allowed: priced at cuDNN's fp32 rate (conv_aten.conv_work)
    eager_fp32_kernels: bool = False
    # ATen's channels_last call of a convolution eager runs NC[D]HW with TF32 products: on CUDA its input (in the
    # generated copy into channels_last) and its weight are rounded to TF32 ties away from zero first, as eager's
    # NC[D]HW kernels round them, so cuDNN's channels_last kernels (ties to even) find nothing left to round and the
    # products are eager's (conv_aten.eager_rounding_only)
    eager_rounding: bool = False
