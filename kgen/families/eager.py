"""eager: the whole pipeline as the spec wrote it, one ATen call per op.

The candidate that is always there: the same kernels eager PyTorch runs
(cuDNN for the convolution, ATen's pools, reductions, norms and elementwise
ops), called from the generated op in C++, so without Python between the
calls. The plan offers it for the whole pipeline (``kgen.plan``), never for a
group of ops: it is not in the registry the planner groups ops with. It works
wherever the op does (CPU, CUDA graphs, torch.compile: it is the same custom
op). Templates: ``templates/eager/``.

An elementwise op needs an ATen function for it (the op table's ``aten``, by
default ``at::`` and the name of its torch function; every op of the table has
one); named values (``as:``) are tensors of their own, read as operands or as
``from:`` starts, and the other inputs are the op's arguments. A spec that pins
who computes its convolutions (``plan.conv: aten | gemm``) has no eager candidate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cexpr import braces, cfloat
from ..buffer import flat_buffer
from ..ir import (AdaptivePool, BatchNorm, BatchStats, Capture, Cat, Conv, Cumsum, Dropout, Elementwise, Expand, Interpolate, LayerNorm, Linear,
                  Matmul, Norm, Op, Pad, Permute, Pipeline, Pool, Reduce, Reshape, Slice, Softmax, TensorType, dropout_refusal)
from ..ops import OPS, ElementwiseOp
from ..spec import DTYPES
from ..stage import Stage
from ..target import Target
from .base import Family, Work, value_bytes
from .conv_aten import conv_work
from .linear_aten import half_product

NORM_LAUNCHES = 3  # ATen's group, instance and (training mode) batch norms: statistics, (finalize), apply
# ATen's 16-bit batch norm over rows of channels ([N, C], BatchNorm1d after a GEMM) reads its input for the
# statistics at a fraction of the bandwidth: torch.profiler on the H200 (2026-12-02, bfloat16, training mode),
# batch_norm_collect_statistics_channels_last_kernel 223 us for KernelBench #41's 134 MB (7.2x the bytes' time at
# 4.3 TB/s) and 20.7 us for #33's 16.8 MB (5.0x); the apply pass near the bandwidth (110 us for 268 MB)
BATCH_NORM_ROWS16_STATS_FACTOR = 6.0


def aten_function(entry: ElementwiseOp) -> str | None:
    """The ATen C++ function of an elementwise op, or None when it has none."""
    if entry.aten:
        return entry.aten
    import torch

    fn = entry.torch_fn
    name = getattr(fn, "__name__", "")
    return f"at::{name}" if name and getattr(torch, name, None) is fn else None


@dataclass
class EagerStage(Stage):
    """Every op of the pipeline as written; ``Y`` is the running value in ``calls`` (upper case: no spec
    identifier can take it), a named value (``as:``) a tensor ``v_NAME``, the first input ``x`` and the
    others their own names."""

    inputs: dict = field(default_factory=dict)  # the pipeline's inputs: name -> type, the first is x
    fp32_kernel_convs: frozenset = frozenset()  # convolution modules whose eager call `kgen tune` measured in fp32

    def chain(self) -> list[tuple[Op, TensorType, TensorType]]:
        """(op, input type, output type) in order, an op reading a value (``from:``) from its type."""
        values, t, out = dict(self.inputs), self.in_type, []
        for op in self.ops:
            t_in = values[op.src] if op.src is not None else t
            t = op.infer(t_in)
            if isinstance(op, Capture):
                values[op.name] = t
            out.append((op, t_in, t))
        return out

    def value(self, name: str) -> str:
        """The C++ tensor of a value: an input's argument, or a named result."""
        names = list(self.inputs)
        return ("x" if name == names[0] else name) if name in self.inputs else f"v_{name}"

    def calls(self, ident, buffers=()) -> list[tuple[str, str]]:
        """(comment, C++ statement) per op: ``Y`` set to the op applied to it (or to the value it
        reads), or a named value defined; ``ident`` maps a parameter's state_dict name to its C++
        argument; ``buffers``: the op's running-statistics arguments' names in order (a batch norm's
        update weight is factors[its index // 2])."""
        out = []
        for op, t, _ in self.chain():
            comment = f"{op.key}: {op.describe()}"
            if op.src is not None:
                out.append((f"{op.key} reads {op.src}", f"Y = {self.value(op.src)};"))
            if isinstance(op, Capture):
                out.append((comment, f"const at::Tensor {self.value(op.name)} = Y;"))
            else:
                out.append((comment, f"Y = {_call(op, t, ident, list(buffers), self.value)};"))
        return out

    def prelude(self, ident) -> list[str]:
        """C++ statements before the calls: the refusal of dropout in training mode."""
        lines = []
        for op in self.ops:
            lines += [line for line in aten_prelude(op, ident) if line not in lines]
        return lines

    def includes(self) -> list[str]:
        return sorted({h for op in self.ops for h in _headers(op)})


def _opt(v) -> str:
    return "std::nullopt" if v is None else f"std::optional<at::Tensor>({v})"


def _scalar(v) -> str:
    return "std::nullopt" if v is None or math.isinf(v) else f"std::optional<at::Scalar>({float(v)!r})"


def aten_prelude(op: Op, ident) -> list[str]:
    """C++ statements ``aten_call``'s expression of ``op`` needs before it: dropout's refusal of training
    mode. (A batch norm's copies of the running statistics it updates, ``new_<buffer>``, the binding makes
    for all of a plan's norms at once: Plan.running_copies.)"""
    if isinstance(op, Dropout) and op.p > 0:
        return [f'TORCH_CHECK(!training, kOp, ": {dropout_refusal(op.p)}");']
    return []


# ops no generated kernel computes, ATen's call in a stage of their own (the aten family) or in the eager candidate:
# those that move or resample values, and the running sum
ATEN_ONLY_OPS = (Cat, Permute, Slice, Pad, Interpolate, AdaptivePool, Expand, Cumsum)


def aten_only_call(op: Op, src: str, value) -> str | None:
    """The ATen expression of a cat, permute/transpose, slice, pad, interpolation, adaptive pool,
    expand or cumsum on ``src`` (``value``: a named value -> its C++ tensor); None for another op.
    Views (permute, slice, expand) are made contiguous where they are used, as the stages hand on
    contiguous tensors."""
    if isinstance(op, Cumsum):
        return f"at::cumsum({src}, {op.dim})"
    if isinstance(op, Cat):
        return f"at::cat({{{', '.join([src] + [value(n) for n in op.tensors])}}}, {op.dim})"
    if isinstance(op, Permute):
        return f"{src}.permute({braces(op.dims)})"
    if isinstance(op, Slice):
        return f"{src}.slice({op.dim}, {op.start}, {op.end}, {op.step})"
    if isinstance(op, Expand):
        return f"{src}.expand({braces([f'{src}.size(0)'] + list(op.shape))})"
    if isinstance(op, Pad):
        return f"at::constant_pad_nd({src}, {braces(op.pad)}, {float(op.value)!r})"
    if isinstance(op, AdaptivePool):
        call = f"at::{op.op_name}({src}, {braces(op.output)})"
        return call if op.kind == "avg" else f"std::get<0>({call})"
    if isinstance(op, Interpolate):
        scales = ", ".join("std::nullopt" if op.scales is None else f"std::optional<double>({float(s)!r})"
                           for s in (op.scales or op.size))
        corners = f"{'true' if op.align_corners else 'false'}, " if op.mode == "bilinear" else ""
        return f"at::upsample_{op.mode}{len(op.size)}d({src}, {braces(op.size)}, {corners}{scales})"
    return None


def aten_only_headers(op: Op) -> list[str]:
    """The ATen headers ``aten_only_call``'s expression needs beyond kgen_runtime.h (Tensor methods need none)."""
    if isinstance(op, Cumsum):
        return ["ATen/ops/cumsum.h"]
    if isinstance(op, Pad):
        return ["ATen/ops/constant_pad_nd.h"]
    if isinstance(op, AdaptivePool):
        return [f"ATen/ops/{op.op_name}.h"]
    if isinstance(op, Interpolate):
        return [f"ATen/ops/upsample_{op.mode}{len(op.size)}d.h"]
    return []  # cat: kgen_runtime.h has it


def aten_call(op: Op, src: str, ident, buffers=(), value=None) -> str | None:
    """The ATen expression of an op that is not elementwise on ``src`` (a C++ tensor), for the eager
    and aten families alike (``ident``: a parameter's state_dict name -> its C++ argument;
    ``buffers``: the op's running-statistics arguments' names in order, a batch norm's update weight
    being factors[its index // 2]; ``value``: a named value -> its C++ tensor, for a cat); None for
    an op without one here."""
    if isinstance(op, Expand) and op.param is not None:  # the parameter broadcast over src's batch
        return f"{ident(op.param)}.expand({braces([f'{src}.size(0)'] + list(op.shape))})"
    if isinstance(op, ATEN_ONLY_OPS):
        return aten_only_call(op, src, value)
    if isinstance(op, BatchNorm):
        names = op.tensor_names()
        w, b = (_opt(ident(n)) for n in names) if names else ("std::nullopt", "std::nullopt")
        cudnn = "at::globalContext().userEnabledCuDNN()"
        if not op.track_running_stats:  # batch statistics in both modes
            return f"at::batch_norm({src}, {w}, {b}, std::nullopt, std::nullopt, true, 0.0, {op.eps!r}, {cudnn})"
        rm, rv = op.buffer_names()  # training mode: batch statistics, and the copies of aten_prelude updated
        k = list(buffers).index(rm) // 2
        return (f"at::batch_norm({src}, {w}, {b}, new_{ident(rm)}, new_{ident(rv)}, training, training ? factors[{k}] : 0.0, "
                f"{op.eps!r}, {cudnn})")
    if isinstance(op, Dropout):
        return src  # the identity in eval mode (aten_prelude refuses training mode with p > 0)
    if isinstance(op, Softmax):
        if not op.spanned:
            return f"at::{op.fn}({src}, {op.dim})"
        return f"at::{op.fn}({src}.flatten({op.dim}, {op.dims[-1]}), {op.dim}).unflatten({op.dim}, {braces(op.spanned)})"
    if isinstance(op, LayerNorm):
        names = op.tensor_names()
        return (f"at::layer_norm({src}, {braces(op.normalized_shape)}, {_opt(ident(names[0]) if names else None)}, "
                f"{_opt(ident(names[1]) if len(names) > 1 else None)}, {op.eps!r}, true)")
    if isinstance(op, Reshape):
        return f"{src}.reshape({braces([f'{src}.size(0)'] + list(op.shape))})"
    if isinstance(op, Linear):
        names = op.tensor_names()
        return f"kgen::linear({src}, {ident(names[0])}, {_opt(ident(names[1]) if op.bias else None)})"  # fp32, as PyTorch
    if isinstance(op, Matmul) and op.param is not None:
        w = ident(op.param)
        return f"kgen::matmul({src}, {w + '.t()' if op.transpose else w})"  # fp32, as PyTorch
    return None


def _call(op: Op, t: TensorType, ident, buffers: list, value) -> str:
    """The ATen expression of ``op`` on ``Y`` (its input type ``t``); ``value``: a value's C++ tensor."""
    r = len(t.spatial)
    if isinstance(op, Matmul) and op.tensor is not None:  # a batched product with a value
        v = value(op.tensor)
        return f"kgen::matmul(Y, {v + '.transpose(-1, -2)' if op.transpose else v})"  # fp32, as PyTorch
    other = aten_call(op, "Y", ident, buffers, value)
    if other is not None:
        return other
    if isinstance(op, Conv):
        bias = _opt(ident(op.bias_name)) if op.bias else "std::nullopt"
        return (f"kgen::convolution(Y, {ident(op.weight_name)}, {bias}, {braces(op.stride)}, {braces(op.padding)}, "
                f"{braces(op.dilation)}, {'true' if op.transposed else 'false'}, {braces(op.output_padding)}, {op.groups}, "
                "kPrecision, Y.suggest_memory_format())")
    if isinstance(op, Pool):
        k, s, p = braces(op.kernel), braces(op.stride), braces(op.padding)
        ceil = "true" if op.ceil_mode else "false"
        if op.kind == "max":
            return f"at::max_pool{r}d(Y, {k}, {s}, {p}, {braces(op.dilation)}, {ceil})"
        return f"at::avg_pool{r}d(Y, {k}, {s}, {p}, {ceil}, {'true' if op.count_include_pad else 'false'})"
    if isinstance(op, Reduce):
        if op.origin.startswith("adaptive_avg_pool"):
            return f"at::{op.origin}(Y, {braces([1] * r)})"
        fn = {"sum": "at::sum", "mean": "at::mean", "max": "at::amax", "min": "at::amin", "logsumexp": "at::logsumexp"}[op.fn]
        return f"{fn}(Y, at::IntArrayRef{braces(op.dims)}, {'true' if op.kept else 'false'})"
    if isinstance(op, Norm):
        w, b = (_opt(ident(n)) for n in op.tensor_names()) if op.affine else ("std::nullopt", "std::nullopt")
        if op.kind == "instance_norm":
            return (f"at::instance_norm(Y, {w}, {b}, std::nullopt, std::nullopt, true, 0.1, {op.eps!r}, "
                    "at::globalContext().userEnabledCuDNN())")
        return f"at::group_norm(Y, {op.num_groups}, {w}, {b}, {op.eps!r}, at::globalContext().userEnabledCuDNN())"
    assert isinstance(op, Elementwise), op
    fn = aten_function(OPS[op.fn])
    if op.entry.operand:
        if op.tensor is not None:
            other = value(op.tensor)
        elif op.param:
            other = ident(op.param)
        elif op.reverse:  # f(scalar, x) as the reference computes it: the scalar as a tensor like x
            other = f"at::full_like(Y, {float(op.scalar)!r})"
        elif op.fn in ("minimum", "maximum"):  # tensor-only ATen functions: a 0-d tensor, as torch.as_tensor
            other = f"at::scalar_tensor({float(op.scalar)!r}, Y.options())"
        else:
            other = f"at::Scalar({float(op.scalar)!r})"
        if op.fn == "masked_fill":  # the mask nonzero where filled; the value may be an infinity
            return f"{fn}(Y, at::ne({other}, 0), at::Scalar({cfloat(op.consts[0])}))"
        return f"{fn}({other}, Y)" if op.reverse else f"{fn}(Y, {other})"
    if op.fn == "gelu_tanh":
        return f'{fn}(Y, "tanh")'
    if op.fn == "clamp":  # optional bounds; the other ops' constants are plain Scalars
        return f"{fn}(Y{''.join(', ' + _scalar(c) for c in op.consts)})"
    return f"{fn}(Y{''.join(f', at::Scalar({float(c)!r})' for c in op.consts)})"


def _has_call(op: Op) -> bool:
    """Whether ``_call`` renders ``op`` (or ``EagerStage.calls`` names its value)."""
    if type(op) not in (Conv, Pool, Reduce, Norm, Elementwise, Capture, Softmax, LayerNorm, Reshape, Linear, Matmul, BatchNorm,
                        Dropout) + ATEN_ONLY_OPS:
        return False
    if isinstance(op, Reduce):
        return op.fn in ("sum", "mean", "max", "min", "logsumexp")
    if isinstance(op, Capture):
        return True
    if isinstance(op, Elementwise):  # as written: no parameter sums a rewrite made
        return not op.param_sum_dims and aten_function(OPS[op.fn]) is not None
    return True


def _headers(op: Op) -> list[str]:
    if isinstance(op, Capture):
        return []
    if isinstance(op, ATEN_ONLY_OPS):
        return aten_only_headers(op)
    if isinstance(op, Elementwise) and op.reverse and op.tensor is None and not op.param:
        return [f"ATen/ops/{aten_function(OPS[op.fn]).removeprefix('at::')}.h", "ATen/ops/full_like.h"]
    if isinstance(op, (Conv, Reshape, Linear, Matmul, BatchNorm, Dropout)):
        return []  # kgen_runtime.h has the convolution, linear, matmul and batch norm; reshape is a Tensor method
    if isinstance(op, Softmax):
        return [f"ATen/ops/{op.fn}.h"]
    if isinstance(op, LayerNorm):
        return ["ATen/ops/layer_norm.h"]
    if isinstance(op, Pool):
        return [f"ATen/ops/{op.kind}_pool{op.rank}d.h"]
    if isinstance(op, Reduce):
        name = op.origin if op.origin.startswith("adaptive_avg_pool") else {"max": "amax", "min": "amin"}.get(op.fn, op.fn)
        return [f"ATen/ops/{name}.h"]
    if isinstance(op, Norm):
        return [f"ATen/ops/{op.kind}.h"]
    scalar = ["ATen/ops/scalar_tensor.h"] if op.fn in ("minimum", "maximum") else []  # a scalar operand as a 0-d tensor
    scalar += ["ATen/ops/ne.h"] if op.fn == "masked_fill" else []  # its mask as booleans
    return [f"ATen/ops/{aten_function(OPS[op.fn]).removeprefix('at::')}.h"] + scalar


class Eager(Family):
    name = "eager"
    stage_kind = "eager"
    generates_kernel = False
    pieces = ("binding.cpp",)
    summary = "the spec's ops as written, one ATen call each (eager PyTorch's kernels)"
    dtypes = DTYPES  # eager PyTorch's kernels in each dtype: a plan for every dtype of a spec

    def fits(self, ops):
        return all(_has_call(op) for op in ops)

    def accepts(self, ops):  # every op of the table has its ATen call here (elementwise ops: if they name one)
        return self.fits(ops)

    def whole(self, pipe: Pipeline) -> EagerStage | None:
        """The eager stage of the whole pipeline as written; None when an op has no ATen call
        or the spec pins who computes its convolutions or matrix products (plan.conv, plan.linear)."""
        if not self.accepts(list(pipe.ops)) or pipe.conv_impl != "auto" or pipe.linear_impl != "auto":
            return None
        st = EagerStage(0, list(pipe.ops), pipe.input, pipe.output, input=flat_buffer(pipe.input), output=flat_buffer(pipe.output),
                        inputs=dict(pipe.inputs) or {"x": pipe.input},
                        fp32_kernel_convs=frozenset(m for m, tf32 in pipe.eager_conv_tf32 if not tf32))
        st.family, st.candidates = self, ("eager",)
        return st

    def make_stage(self, req):
        raise NotImplementedError("the eager stage is made for a whole pipeline (Eager.whole)")

    def work(self, st: EagerStage, batch: int, target: Target) -> list[Work]:
        """Each op reads its input and writes its output; the convolution as in conv_aten,
        its bias added by ATen in a pass of its own. What moves nothing costs nothing: naming a value
        (``as``), a reshape of a contiguous tensor, an expand the next call broadcasts (the stage makes
        only its result contiguous)."""
        out, size = [], value_bytes(st)
        chain = st.chain()
        values = dict(st.inputs)  # the named values' types, as the chain names them: what an op reads beside its input
        for op, _, t_out in chain:
            if isinstance(op, Capture):
                values[op.name] = t_out
        viewed = None  # what the op after an expand reads of its view: the expanded tensor's own values
        strided = False  # whether the running value is a view that is not contiguous (a reshape of it copies)
        for i, (op, t_in, t_out) in enumerate(chain):
            n_in, n_out = batch * t_in.sample_numel, batch * t_out.sample_numel
            if viewed is not None and op.src is None:
                n_in = viewed
            viewed = None
            flops = batch * op.flops(t_in, t_out)
            if isinstance(op, Capture) or (isinstance(op, Reshape) and not (strided and op.src is None)):
                out.append(Work(f"{op.key} (a view)", 0, 0, launches=0))
                continue
            strided = isinstance(op, (Permute, Slice, Expand))
            if isinstance(op, Expand) and i + 1 < len(chain):
                viewed = t_out.sample_numel if op.param is not None else batch * t_in.sample_numel
                out.append(Work(f"{op.key} (a view)", 0, 0, launches=0))
            elif isinstance(op, Conv):
                K = op.in_channels // op.groups * math.prod(op.kernel)
                read = n_in + math.prod(op.weight_shape())
                out += conv_work(op.key, flops, read, n_out, op.out_channels // op.groups, K, "contiguous", target,
                                 transposed_stride=op.stride if op.transposed else None, dtype=st.dtype,
                                 channels=op.in_channels // op.groups, bias=bool(op.bias), kernel=op.kernel,
                                 fp32=op.module in st.fp32_kernel_convs)
            elif isinstance(op, BatchNorm) and st.dtype != "float32" and math.prod(t_in.spatial) == 1:
                out += [Work(f"{op.key} statistics", 0, size * n_in * BATCH_NORM_ROWS16_STATS_FACTOR, launches=NORM_LAUNCHES - 1),
                        Work(op.key, flops, size * (n_in + n_out))]
            elif isinstance(op, (Norm, BatchNorm)):  # a batch norm as training mode runs it (eval mode: one pass less)
                out.append(Work(op.key, flops, size * (2 * n_in + n_out), launches=NORM_LAUNCHES))
            else:
                if isinstance(op, (Elementwise, Cat)):  # the tensors it reads beside its input, once each
                    n_in += batch * sum(values[n].sample_numel for n in op.value_names() if n in values)
                out.append(half_product(Work(op.key, flops, size * (n_in + n_out)), st, target)
                           if isinstance(op, (Linear, Matmul)) else Work(op.key, flops, size * (n_in + n_out)))
        return out

    def binding_includes(self, st: EagerStage) -> list[str]:
        return st.includes()


FAMILY = Eager()
