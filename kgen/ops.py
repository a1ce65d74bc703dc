"""The op table: one entry per op a spec may name, read by every layer.

An entry holds what kgen knows about an op:

- its spec fields and their defaults, and cross-field rules (read by ``kgen.spec``);
- its role: which IR op computes it, and with it the shape rule and the torch
  semantics (``kgen.ir`` builds the op from the entry);
- which template families can absorb it into a stage (``kgen.plan`` asks them);
- for an elementwise op, the whole op: its torch function (the reference) and
  its C function in ``templates/kgen_math.h`` (used by the CUDA and the C++
  kernels alike).

Adding an elementwise op is one ``ElementwiseOp`` entry below plus one function
in ``templates/kgen_math.h`` (see CONTRIBUTING.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from . import fields as f
from .fields import REQUIRED

# Roles: the IR op that computes an entry (kgen.ir builds one per role).
ROLES = ("conv", "pool", "global_pool", "reduce", "norm", "elementwise", "linear", "softmax", "batch_norm",
         "batch_stats", "layer_norm", "reshape", "dropout", "capture", "cat", "permute", "slice", "pad", "interpolate",
         "expand", "cumsum")
MADE_BY_REWRITES = ("batch_stats",)  # ops only a rewrite makes (not in `kgen ops`)
# ops of the IR a spec does not name as ops (`as:` on an op makes one)
INTERNAL = ("as",) + MADE_BY_REWRITES

# The families that can absorb each kind of op (a new family adds its name here).
CONV = ("conv_gemm", "conv_aten")  # implementations of a convolution stage
FUSED = ("pool_reduce", "norm", "layer_norm", "softmax")  # families that fuse elementwise ops
REDUCING = ("pool_reduce", "norm")  # families that fuse sum / mean / max / min too
GEMM = ("linear_gemm", "linear_aten")  # implementations of a matrix product
SOFTMAX = ("softmax",)  # softmax, log_softmax and logsumexp over one axis (alone, also the aten family's)
ATEN = ("aten",)  # ops run by their ATen function in a stage of their own (not fused yet, or as a candidate)

# Ops that turn a small error of their input into a large one of their output (relative to its size):
# normalizations (batch_stats: training mode's batch norm) remove the input's scale and its mean, exponentials
# turn an absolute error of large inputs into a relative one. Before them a convolution needs fp32-level
# products (families.base.conv_precision), and a 16-bit plan keeps every rounding eager does (rewrites).
NORMALIZATIONS = ("group_norm", "instance_norm", "batch_norm", "batch_stats", "layer_norm")
EXPONENTIALS = ("softmax", "log_softmax", "logsumexp", "exp")
AMPLIFYING = NORMALIZATIONS + EXPONENTIALS


@dataclass(frozen=True)
class OpDef:
    name: str
    role: str
    fields: dict  # field -> (checker, default); REQUIRED marks a field without default
    families: tuple[str, ...]  # template families that can absorb the op
    doc: str
    check: Callable | None = None  # cross-field rule: check(args, key, path) raises SpecError
    rank: int = 0  # spatial rank of an N-d op (conv2d: 2)
    variant: str = ""  # within the role: "max" | "avg" for a pool, "transposed" for a convolution


@dataclass(frozen=True)
class ElementwiseOp(OpDef):
    """``v = c_fn(v, *consts)``, or ``v = c_fn(v, operand)`` with a scalar or a parameter operand."""

    torch_fn: Callable | None = None  # torch_fn(x, *consts) or torch_fn(x, operand): the reference
    c_fn: str = ""  # the function in kgen_math.h
    consts: tuple = ()  # ((field, value when the field is omitted), ...): float arguments after v
    operand: bool = False  # takes exactly one of the fields `scalar`, `param` or `tensor`
    example: dict = field(default_factory=dict)  # fields of a valid use (tests, docs)
    slope: float = 1.0  # largest |f'| (validation scales the input's rounding by it)
    aten: str = ""  # the ATen function the eager candidate calls (default: at:: and torch_fn's name)
    relative: bool = False  # |f'(x)| grows with |f(x)| (exp): validation scales the output by the input's size
    libm: bool = False  # calls a libm function (expf, tanhf, erff, ...): a long chain of dependent instructions

    @property
    def reversible(self) -> bool:
        """Whether ``reverse`` (the operand on the left, f(operand, x)) applies: a binary op without constants."""
        return self.operand and not self.consts


def _conv_fields(rank: int, transposed: bool) -> dict:
    out = {
        "out_channels": (f.integer(1), REQUIRED),
        "kernel_size": (f.ints(rank, 1), REQUIRED),
        "stride": (f.ints(rank, 1), 1),
        "padding": (f.ints(rank, 0), 0),
        "dilation": (f.ints(rank, 1), 1),
        "groups": (f.integer(1), 1),
        "bias": (f.boolean, True),
        "name": (f.optional(f.member_path), None),
    }
    if transposed:
        out["output_padding"] = (f.ints(rank, 0), 0)
    return out


def _pool_fields(rank: int, kind: str) -> dict:
    out = {
        "kernel_size": (f.ints(rank, 1), REQUIRED),
        "stride": (f.optional(f.ints(rank, 1)), None),  # None: the kernel size
        "padding": (f.ints(rank, 0), 0),
        "ceil_mode": (f.boolean, False),
    }
    if kind == "max":
        out["dilation"] = (f.ints(rank, 1), 1)
    else:
        out["count_include_pad"] = (f.boolean, True)
    return out


_REDUCE_FIELDS = {"dim": (f.dims, REQUIRED), "keepdim": (f.boolean, False)}
_SOFTMAX_FIELDS = {"dim": (f.dim, REQUIRED)}


def _check_operand(args, key, path):
    if sum(args[k] is not None for k in ("scalar", "param", "tensor")) != 1:
        f.fail(path, key, "give exactly one of 'scalar', 'param' or 'tensor'")
    if args["view"] is not None and args["param"] is None:
        f.fail(path, f"{key}.view", "a view applies to a 'param' only")


def _check_masked_fill(args, key, path):
    if (args["param"] is None) == (args["tensor"] is None):
        f.fail(path, key, "give exactly one of 'param' or 'tensor' (the mask: nonzero where filled)")
    if args["view"] is not None and args["param"] is None:
        f.fail(path, f"{key}.view", "a view applies to a 'param' only")
    if args["reverse"]:
        f.fail(path, f"{key}.reverse", "masked_fill takes no reversed operand")


def masked_fill_nonzero(x, mask, value):
    """``x.masked_fill(mask != 0, value)``: kgen's masks are tensors of x's dtype, nonzero where x is filled (the
    Dynamo backend turns a constant boolean mask into one: kgen.backend._float_masks)."""
    return x.masked_fill(torch.as_tensor(mask, device=x.device) != 0, value)


def _check_div(args, key, path):
    _check_operand(args, key, path)
    if args["scalar"] == 0.0:
        f.fail(path, f"{key}.scalar", "division by zero")


def _check_clamp(args, key, path):
    lo, hi = args["min"], args["max"]
    if lo is None and hi is None:
        f.fail(path, key, "give at least one of 'min' or 'max'")
    if None not in (lo, hi) and lo > hi:
        f.fail(path, key, f"min ({lo}) is larger than max ({hi})")


def _check_matmul(args, key, path):
    if (args["param"] is None) == (args["tensor"] is None):
        f.fail(path, key, "give exactly one of 'param' or 'tensor'")


def _check_instance_norm(args, key, path):
    if args["track_running_stats"]:
        f.fail(path, f"{key}.track_running_stats", "running statistics are not supported; use false")


def _check_dropout(args, key, path):
    if not 0.0 <= args["p"] < 1.0:
        f.fail(path, f"{key}.p", f"expected a probability in [0, 1), got {args['p']}")


def _check_interpolate(args, key, path):
    if (args["size"] is None) == (args["scale_factor"] is None):
        f.fail(path, key, "give exactly one of 'size' or 'scale_factor'")
    if args["align_corners"] is not None and args["mode"] == "nearest":
        f.fail(path, f"{key}.align_corners", "align_corners applies to mode bilinear only")


def _check_momentum(v, key, path):
    return None if v is None else f.number(v, key, path)


# The operand of a binary op: a number, a declared parameter (optionally viewed as
# another shape of the same size), or a value of the pipeline (an input or a value
# named with `as:`); `reverse` puts the operand on the left (operand - x).
_OPERAND_FIELDS = {
    "scalar": (f.optional(f.number), None),
    "param": (f.optional(f.member_path), None),
    "tensor": (f.optional(f.value_name), None),
    "view": (f.optional(f.shape), None),
    "reverse": (f.boolean, False),
}


def _binary(name: str, torch_fn, c_fn: str, doc: str, example: dict, check=_check_operand, aten: str = "") -> ElementwiseOp:
    return ElementwiseOp(
        name, "elementwise", dict(_OPERAND_FIELDS), FUSED, doc, check, torch_fn=torch_fn, c_fn=c_fn, operand=True,
        example=example, aten=aten,
    )


def _unary(name: str, torch_fn, doc: str, consts: dict | None = None, **kw) -> ElementwiseOp:
    """An elementwise function of x (and constant arguments ``consts``: field -> default), c function kgen::NAME."""
    consts = consts or {}
    fields = {k: (f.number, v) for k, v in consts.items()}
    return ElementwiseOp(name, "elementwise", fields, FUSED, doc, torch_fn=torch_fn, c_fn=f"kgen::{name}",
                         consts=tuple(consts.items()), **kw)


def _minimum(x, other):
    return torch.minimum(x, torch.as_tensor(other, dtype=x.dtype, device=x.device))


def _maximum(x, other):
    return torch.maximum(x, torch.as_tensor(other, dtype=x.dtype, device=x.device))


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _table() -> dict[str, OpDef]:
    entries: list[OpDef] = []
    for r in (1, 2, 3):
        entries += [
            OpDef(f"conv{r}d", "conv", _conv_fields(r, False), CONV, f"nn.Conv{r}d; a submodule named `conv`", rank=r),
            OpDef(f"conv_transpose{r}d", "conv", _conv_fields(r, True), CONV,
                  f"nn.ConvTranspose{r}d; a submodule named `conv_transpose`", rank=r, variant="transposed"),
            OpDef(f"max_pool{r}d", "pool", _pool_fields(r, "max"), ("pool_reduce",), f"F.max_pool{r}d", rank=r, variant="max"),
            OpDef(f"avg_pool{r}d", "pool", _pool_fields(r, "avg"), ("pool_reduce",), f"F.avg_pool{r}d", rank=r, variant="avg"),
            OpDef(f"adaptive_avg_pool{r}d", "global_pool", {"output_size": (f.ints(r, 1), REQUIRED)}, ("pool_reduce",) + ATEN,
                  f"F.adaptive_avg_pool{r}d; output_size 1 is a mean over the spatial dims (it fuses), any other an "
                  "ATen stage", rank=r, variant="avg"),
            OpDef(f"adaptive_max_pool{r}d", "global_pool", {"output_size": (f.ints(r, 1), REQUIRED)}, ("pool_reduce",) + ATEN,
                  f"F.adaptive_max_pool{r}d (the values); output_size 1 is a max over the spatial dims (it fuses), any "
                  "other an ATen stage", rank=r, variant="max"),
        ]
    entries += [
        ElementwiseOp("relu", "elementwise", {}, FUSED, "max(x, 0); NaN stays NaN",
                      torch_fn=torch.relu, c_fn="kgen::relu"),
        ElementwiseOp("sigmoid", "elementwise", {}, FUSED, "1 / (1 + exp(-x))",
                      torch_fn=torch.sigmoid, c_fn="kgen::sigmoid", slope=0.25, libm=True),
        ElementwiseOp("tanh", "elementwise", {}, FUSED, "torch.tanh(x)", torch_fn=torch.tanh, c_fn="kgen::tanh", libm=True),
        ElementwiseOp("clamp", "elementwise", {"min": (f.optional(f.number), None), "max": (f.optional(f.number), None)},
                      FUSED, "torch.clamp(x, min, max); at least one bound", _check_clamp,
                      torch_fn=torch.clamp, c_fn="kgen::clamp", consts=(("min", -math.inf), ("max", math.inf)),
                      example={"min": -0.5, "max": 0.75}),
        _binary("add", torch.add, "kgen::add", "x + operand", {"scalar": 1.5}),
        _binary("sub", torch.sub, "kgen::sub", "x - operand", {"scalar": 0.25}),
        _binary("mul", torch.mul, "kgen::mul", "x * operand", {"scalar": -1.25}),
        _binary("div", torch.div, "kgen::div", "x / operand", {"scalar": 3.0}, _check_div),
        _binary("minimum", _minimum, "kgen::minimum", "torch.minimum(x, operand) (torch.min with a tensor); NaN wins",
                {"scalar": 0.25}, aten="at::minimum"),
        _binary("maximum", _maximum, "kgen::maximum", "torch.maximum(x, operand) (torch.max with a tensor); NaN wins",
                {"scalar": -0.25}, aten="at::maximum"),
        ElementwiseOp("masked_fill", "elementwise", {**{k: _OPERAND_FIELDS[k] for k in ("param", "tensor", "view", "reverse")},
                                                     "value": (f.fill_value, REQUIRED)}, FUSED,
                      "x.masked_fill(mask != 0, value): value where the mask (a parameter or a value, broadcast to x) "
                      "is nonzero, else x (a NaN too)", _check_masked_fill, torch_fn=masked_fill_nonzero,
                      c_fn="kgen::masked_fill", operand=True, consts=(("value", 0.0),), aten="at::masked_fill",
                      example={"tensor": "x", "value": -1.5}),
        _unary("gelu", F.gelu, "F.gelu(x) (the erf form)", slope=1.13, aten="at::gelu", libm=True),
        _unary("gelu_tanh", _gelu_tanh, "F.gelu(x, approximate='tanh')", slope=1.13, aten="at::gelu", libm=True),
        _unary("silu", F.silu, "x * sigmoid(x) (SiLU, Swish)", slope=1.1, aten="at::silu", libm=True),
        _unary("mish", F.mish, "x * tanh(softplus(x))", slope=1.1, aten="at::mish", libm=True),
        _unary("softplus", F.softplus, "log(1 + exp(beta x)) / beta; x where beta x > threshold",
               {"beta": 1.0, "threshold": 20.0}, example={"beta": 2.0, "threshold": 1.5}, aten="at::softplus", libm=True),
        _unary("hardswish", F.hardswish, "x * clamp(x + 3, 0, 6) / 6", slope=1.5, aten="at::hardswish"),
        _unary("hardsigmoid", F.hardsigmoid, "clamp(x + 3, 0, 6) / 6", slope=1 / 6, aten="at::hardsigmoid"),
        _unary("hardtanh", F.hardtanh, "clamp(x, min_val, max_val)", {"min_val": -1.0, "max_val": 1.0},
               example={"min_val": -0.5, "max_val": 0.75}, aten="at::hardtanh"),
        _unary("leaky_relu", F.leaky_relu, "x if x > 0 else negative_slope * x", {"negative_slope": 0.01},
               example={"negative_slope": 0.2}, aten="at::leaky_relu"),
        _unary("elu", F.elu, "x if x > 0 else alpha * (exp(x) - 1)", {"alpha": 1.0}, example={"alpha": 0.7}, aten="at::elu", libm=True),
        _unary("exp", torch.exp, "exp(x)", relative=True, libm=True),
        _unary("log", torch.log, "log(x); NaN below 0, -inf at 0", relative=True, libm=True),
        _unary("sqrt", torch.sqrt, "sqrt(x); NaN below 0 (F.normalize's norm)", relative=True, libm=True),
        _unary("rsqrt", torch.rsqrt, "1 / sqrt(x) (RMSNorm); NaN below 0, inf at 0", relative=True, libm=True),
        _unary("abs", torch.abs, "|x|"),
        _unary("neg", torch.neg, "-x"),
        OpDef("sum", "reduce", _REDUCE_FIELDS, REDUCING, "torch.sum(x, dim, keepdim)"),
        OpDef("mean", "reduce", _REDUCE_FIELDS, REDUCING, "torch.mean(x, dim, keepdim)"),
        OpDef("max", "reduce", _REDUCE_FIELDS, REDUCING, "torch.max(x, dim, keepdim)[0] (the values); torch.amax"),
        OpDef("min", "reduce", _REDUCE_FIELDS, REDUCING, "torch.min(x, dim, keepdim)[0] (the values); torch.amin"),
        OpDef("logsumexp", "reduce", _REDUCE_FIELDS, SOFTMAX + ATEN,
              "torch.logsumexp(x, dim, keepdim); over dims that are not consecutive: an ATen stage"),
        OpDef("softmax", "softmax", _SOFTMAX_FIELDS, SOFTMAX + ATEN, "torch.softmax(x, dim)"),
        OpDef("log_softmax", "softmax", _SOFTMAX_FIELDS, SOFTMAX + ATEN, "torch.log_softmax(x, dim)"),
        OpDef("linear", "linear", {
            "out_features": (f.integer(1), REQUIRED),
            "bias": (f.boolean, True),
            "name": (f.optional(f.member_path), None),
        }, GEMM, "nn.Linear over the last dim (in full fp32, PyTorch's default); a submodule named `linear`"),
        OpDef("matmul", "linear", {
            "param": (f.optional(f.member_path), None),
            "tensor": (f.optional(f.value_name), None),
            "transpose": (f.boolean, False),
        }, GEMM, "torch.matmul(x, operand) with a 2-d parameter (transpose: operand.T) or a value (bmm)",
            _check_matmul),
        OpDef("batch_norm", "batch_norm", {
            "eps": (f.number, 1e-5),
            "momentum": (_check_momentum, 0.1),
            "affine": (f.boolean, True),
            "track_running_stats": (f.boolean, True),
            "name": (f.optional(f.member_path), None),
        }, ATEN, "nn.BatchNormNd: batch statistics and the running-statistics update in training mode, the "
                 "running statistics in eval mode; a submodule named `batch_norm`"),
        OpDef("layer_norm", "layer_norm", {
            "normalized_shape": (f.shape, REQUIRED),
            "eps": (f.number, 1e-5),
            "elementwise_affine": (f.boolean, True),
            "bias": (f.boolean, True),
            "name": (f.optional(f.member_path), None),
        }, ("layer_norm",) + ATEN, "nn.LayerNorm over the last dims; a submodule named `layer_norm`"),
        OpDef("reshape", "reshape", {"shape": (f.shape, REQUIRED)}, ATEN,
              "a view as [batch, *shape] (view, reshape, flatten, squeeze, unsqueeze); -1 once for the rest"),
        OpDef("dropout", "dropout", {"p": (f.number, REQUIRED)}, ATEN,
              "nn.Dropout: the identity in eval mode or with p = 0; kgen refuses it in training mode otherwise",
              _check_dropout),
        OpDef("cat", "cat", {"dim": (f.dim, REQUIRED), "tensors": (f.value_names, REQUIRED)}, ATEN,
              "torch.cat([x, *tensors], dim): the input (the previous result or `from:`) first, then the named values "
              "in order; not along the batch"),
        OpDef("permute", "permute", {"dims": (f.permutation, REQUIRED)}, ATEN,
              "x.permute(dims).contiguous(); the batch stays first (dims[0] = 0)"),
        OpDef("transpose", "permute", {"dim0": (f.dim, REQUIRED), "dim1": (f.dim, REQUIRED)}, ATEN,
              "x.transpose(dim0, dim1).contiguous(); neither is the batch"),
        OpDef("slice", "slice", {
            "dim": (f.dim, REQUIRED),
            "start": (f.index, 0),
            "end": (f.optional(f.index), None),
            "step": (f.integer(1), 1),
        }, ATEN, "x[..., start:end:step] along dim (not the batch), contiguous; Python's rules for negative and "
                 "out-of-range bounds; the result may not be empty"),
        OpDef("pad", "pad", {"pad": (f.pads, REQUIRED), "value": (f.number, 0.0)}, ATEN,
              "F.pad(x, pad, 'constant', value): pad[0], pad[1] before and after the last dim, then the dim before; "
              "negative amounts crop; not the batch"),
        OpDef("interpolate", "interpolate", {
            "mode": (f.choice("nearest", "bilinear"), "nearest"),
            "size": (f.optional(f.sizes), None),
            "scale_factor": (f.optional(f.scales), None),
            "align_corners": (f.optional(f.boolean), None),
        }, ATEN, "F.interpolate / nn.Upsample: nearest (1-3 spatial dims) or bilinear (2), to `size` or by "
                 "`scale_factor` (exactly one)", _check_interpolate),
        OpDef("expand", "expand", {"shape": (f.expand_shape, REQUIRED), "param": (f.optional(f.member_path), None)}, ATEN,
              "x.expand(N, *shape).contiguous(): dims of size 1 repeated (-1 keeps a size); the batch stays. With "
              "`param`: that parameter broadcast over the batch, param.expand(N, *shape) (a class token); the input "
              "only gives N"),
        OpDef("cumsum", "cumsum", {"dim": (f.dim, REQUIRED)}, ATEN,
              "torch.cumsum(x, dim): running sums along dim (not the batch), ATen's own"),
        OpDef("as", "capture", {}, FUSED, "names the value at this point (spec: `as: NAME` on the op before it)"),
        OpDef("batch_stats", "batch_stats", {}, ("batch_stats",),
              "training-mode batch norm's batch statistics, the norm then applied as a per-channel affine that fuses "
              "(rewrites.batch_norm_batch_stats)"),
        OpDef("group_norm", "norm", {
            "num_groups": (f.integer(1), REQUIRED),
            "eps": (f.number, 1e-5),
            "affine": (f.boolean, True),
            "name": (f.optional(f.member_path), None),
        }, ("norm", "layer_norm"), "nn.GroupNorm; a submodule named `group_norm`"),
        OpDef("instance_norm", "norm", {
            "eps": (f.number, 1e-5),
            "affine": (f.boolean, False),
            "track_running_stats": (f.boolean, False),
            "name": (f.optional(f.member_path), None),
        }, ("norm", "layer_norm"), "nn.InstanceNormNd; a submodule named `instance_norm`", _check_instance_norm),
    ]
    for e in entries:
        assert e.role in ROLES, e
    return {e.name: e for e in entries}


OPS: dict[str, OpDef] = _table()


def spec_op_names() -> list[str]:
    """The ops a spec may name, sorted."""
    return sorted(n for n in OPS if n not in INTERNAL)


def elementwise_ops() -> list[ElementwiseOp]:
    return [e for e in OPS.values() if isinstance(e, ElementwiseOp)]
